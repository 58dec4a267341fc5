"""The host side of `sgraf evaluate`: everything a GPU does not speed up, first and later runs.

On a GPU, a Flickr30K-size `sgraf evaluate` spends most of its wall time on the host: Python's
and PyTorch's imports, the checkpoint, the captions' tokenisation (nltk's import and its rules),
the metrics and the saved matrix (issue 20: 9.8 s on an H200, of which about 1.6 s scoring).
This times exactly that part on any machine: the real command in a fresh process, started and
ended as the `sgraf` script is (`command_child.py`), on a generated split of `bench_eval.py`,
with the two device stages replaced by stand-ins (the encoder returns at once, the scorer
returns a random matrix of the split's shape). Runs alternate between a cold token cache (the captions
are tokenised, as in a first evaluation of a split) and a warm one (the ids an earlier run kept,
`sgraf.data.token_cache`); the medians and their ratio are printed, and each run's time inside
the tokenisation, and the command's own breakdown of its time (`sgraf evaluate --timings`).

    python benchmarks/bench_evaluate_host.py                   # 1,000 x 5,000 (Flickr30K test)
    python benchmarks/bench_evaluate_host.py --images 5000     # MSCOCO 5K
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

HERE = Path(__file__).resolve().parent


def run(out: Path, state: str) -> dict:
    from bench_eval import set_token_cache

    set_token_cache(out, state)
    report = out / "report.json"
    argv = ["evaluate", "--checkpoint", str(out / "model.pt"), "--data", str(out / "data"), "--split", "test",
            "--json", "--quiet", "--timings", "--save-sims", str(out / "sims.npy")]
    env = dict(os.environ, SGRAF_CACHE_DIR=str(out / "tuning"))
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, str(HERE / "command_child.py"), str(report), "--stand-in", "--", *argv],
                               capture_output=True, text=True, env=env, cwd=HERE)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed:\n{completed.stderr[-3000:]}")
    timings = json.loads(completed.stdout.strip().splitlines()[-1])["timings"]
    return {"wall_s": wall, "timings": timings, **json.loads(report.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1000, help="images (x5 captions); Flickr30K test: 1000")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, interleaved (medians)")
    args = parser.parse_args()

    from bench_eval import build

    from sgraf.kernels.tuning import cpu_model
    from sgraf.stopwatch import format_timings

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        build(out, args.images, "sgr", 0)
        print(f"{args.images} images x {args.images * 5} captions; {cpu_model()}, cpus {os.cpu_count()}", flush=True)
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            for state in runs:
                runs[state].append(run(out, state))
        medians = {}
        for state, measured in runs.items():
            medians[state] = statistics.median(r["wall_s"] for r in measured)
            walls = ", ".join(f"{r['wall_s']:.2f}" for r in measured)
            print(f"token cache {state}: runs {walls} s, median "
                  f"{medians[state]:.2f} s; of which tokenisation (median) "
                  f"{statistics.median(r['tokenize_s'] for r in measured):.2f} s", flush=True)
            stages = {name: statistics.median(r["timings"][name] for r in measured) for name in measured[0]["timings"]}
            print(f"token cache {state}: stages (median s; encode and score stood in for): "
                  f"{format_timings(stages)}", flush=True)
        print(f"warm / cold: {medians['cold'] / medians['warm']:.2f}x faster, "
              f"{medians['cold'] - medians['warm']:.2f} s less", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
