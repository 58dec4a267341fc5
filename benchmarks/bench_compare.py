"""`sgraf compare` and `sgraf evaluate --bootstrap`, timed beside the plain evaluations they add to.

Two saved score matrices of a split's shape (MSCOCO 5K by default: model B is model A with noise
added), then, in fresh processes taking turns: `sgraf evaluate --sims A.npy` and the same of B
(the evaluations a user runs anyway), `sgraf compare --sims A.npy --against B.npy` (10,000
resamples), and `sgraf evaluate --sims A.npy --bootstrap 1000`. Prints the medians and what the
significance costs beside the evaluations.

    python benchmarks/bench_compare.py                 # 5,000 x 25,000
    python benchmarks/bench_compare.py --images 1000   # Flickr30K size
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def write_matrices(out: Path, n_images: int) -> tuple[Path, Path]:
    """A: noise with the true pairs raised; B: A plus noise (a weaker model of the same split)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n_images, 5 * n_images), dtype=np.float32)
    a[np.repeat(np.arange(n_images), 5), np.arange(5 * n_images)] += 3.0
    paths = out / "a.npy", out / "b.npy"
    np.save(paths[0], a)
    a += 0.5 * rng.standard_normal(a.shape, dtype=np.float32)
    np.save(paths[1], a)
    return paths


def timed(*args: str) -> float:
    """Wall seconds of one `sgraf ARGS` in a fresh process with this checkout's sgraf."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                                   os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", "sgraf", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf {' '.join(args)} failed:\n{completed.stderr[-3000:]}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=5000, help="images (x5 captions); MSCOCO 5K: 5000")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, in turns (medians)")
    parser.add_argument("--resamples", type=int, default=10000, help="sgraf compare's resamples")
    parser.add_argument("--bootstrap", type=int, default=1000, help="sgraf evaluate --bootstrap's resamples")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE.parent / "src"))
    from sgraf.kernels.tuning import cpu_model

    with tempfile.TemporaryDirectory() as scratch:
        a, b = map(str, write_matrices(Path(scratch), args.images))
        print(f"two matrices of {args.images} x {5 * args.images}; {cpu_model()}, cpus {os.cpu_count()}", flush=True)
        commands = {
            "evaluate A": ("evaluate", "--sims", a),
            "evaluate B": ("evaluate", "--sims", b),
            "compare": ("compare", "--sims", a, "--against", b, "--resamples", str(args.resamples)),
            "evaluate A --bootstrap": ("evaluate", "--sims", a, "--bootstrap", str(args.bootstrap)),
        }
        timed(*commands["evaluate A"])                 # the page cache holds the matrices
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                times[name].append(timed(*command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name}: runs {', '.join(f'{v:.2f}' for v in values)} s, median {medians[name]:.2f} s", flush=True)
    both = medians["evaluate A"] + medians["evaluate B"]
    print(f"compare ({args.resamples} resamples): {medians['compare'] / both:.2f}x the time of evaluating both "
          f"matrices ({both:.2f} s)", flush=True)
    print(f"evaluate --bootstrap {args.bootstrap}: {medians['evaluate A --bootstrap'] / medians['evaluate A']:.2f}x "
          "the plain evaluate's time", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
