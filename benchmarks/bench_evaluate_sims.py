"""`sgraf evaluate --sims A.npy B.npy`: an ensemble of saved score matrices, this checkout against another's.

Users ensemble SGR and SAF by averaging the score matrices `sgraf evaluate --save-sims` wrote.
This writes `--models` random float32 matrices of a split's shape (MSCOCO 5K by default) and runs
the whole command, in a fresh process each time, with this checkout's `src/` and with the
baseline's first on PYTHONPATH, in turns; it prints the medians, their ratio and the command's
own stages (`--timings`), and checks that both give the same metrics.

    git worktree add /tmp/before HEAD~3
    python benchmarks/bench_evaluate_sims.py --baseline /tmp/before                  # 5,000 x 25,000
    python benchmarks/bench_evaluate_sims.py --baseline /tmp/before --images 1000    # Flickr30K size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def write_matrices(out: Path, n_images: int, models: int) -> list[Path]:
    """`models` random float32 (n_images, 5 n_images) matrices, written a block of rows at a time."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(models):
        path = out / f"sims_{k}.npy"
        matrix = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n_images, 5 * n_images))
        for start in range(0, n_images, 500):
            matrix[start:start + 500] = rng.random((min(500, n_images - start), 5 * n_images), dtype=np.float32)
        matrix.flush()
        del matrix
        paths.append(path)
    return paths


def run(paths: list[Path], source: Path) -> dict:
    """One `sgraf evaluate --sims ...` with `source`'s sgraf: wall seconds, metrics, stages."""
    path = os.pathsep.join(filter(None, [str(source / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    argv = [sys.executable, "-m", "sgraf", "evaluate", "--sims", *map(str, paths), "--json", "--quiet", "--timings"]
    start = time.perf_counter()
    completed = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=HERE)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed ({source}):\n{completed.stderr[-3000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    timings = result.pop("timings", {})
    return {"wall_s": wall, "result": result, "timings": timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="CHECKOUT", help="the other checkout (its src/)")
    parser.add_argument("--images", type=int, default=5000, help="images (x5 captions); MSCOCO 5K: 5000")
    parser.add_argument("--models", type=int, default=2, help="saved matrices averaged")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, in turns (medians)")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE.parent / "src"))
    from sgraf.kernels.tuning import cpu_model
    from sgraf.stopwatch import format_timings

    sources = {"ours": HERE.parent, "baseline": Path(args.baseline)}
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_matrices(Path(scratch), args.images, args.models)
        print(f"{args.models} matrices of {args.images} x {5 * args.images}; {cpu_model()}, cpus {os.cpu_count()}",
              flush=True)
        runs: dict[str, list[dict]] = {who: [] for who in sources}
        run(paths, sources["ours"])                      # the page cache holds the matrices
        for _ in range(args.repeats):
            for who, source in sources.items():
                runs[who].append(run(paths, source))
    medians = {}
    for who, measured in runs.items():
        medians[who] = statistics.median(r["wall_s"] for r in measured)
        stages = {name: statistics.median(r["timings"][name] for r in measured) for name in measured[0]["timings"]}
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in measured)
        print(f"{who}: runs {walls} s, median {medians[who]:.2f} s; stages (median s): {format_timings(stages)}",
              flush=True)
    same = all(r["result"] == runs["ours"][0]["result"] for who in runs for r in runs[who])
    print(f"ours {medians['baseline'] / medians['ours']:.2f}x the baseline's speed, "
          f"{medians['baseline'] - medians['ours']:.2f} s less; the same metrics: {same}", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
