"""`sgraf.metrics.evaluate_sims` on a random score matrix: this checkout against another's.

The metrics are host work in every `sgraf evaluate` (1.3 s of an MSCOCO-5K-size one on a 2-core
EPYC, `--timings`). Both modules are loaded from their files into this process and timed in
turn on the same matrix (medians); their results must be equal.

    git worktree add /tmp/before HEAD~3
    python benchmarks/bench_metrics.py --baseline /tmp/before                  # 5,000 x 25,000
    python benchmarks/bench_metrics.py --baseline /tmp/before --images 1000    # Flickr30K size
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="CHECKOUT", help="the other checkout (its src/sgraf)")
    parser.add_argument("--images", type=int, default=5000, help="images (x5 captions); MSCOCO 5K: 5000")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    from sgraf.kernels.tuning import cpu_model

    modules = {"baseline": load(Path(args.baseline) / "src" / "sgraf" / "metrics.py", "metrics_baseline"),
               "ours": load(HERE.parent / "src" / "sgraf" / "metrics.py", "metrics_ours")}
    sims = np.random.default_rng(0).random((args.images, 5 * args.images), dtype=np.float32)
    print(f"{args.images} x {5 * args.images} scores; {cpu_model()}, torch threads {torch.get_num_threads()}",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name in modules}
    results = {}
    for _ in range(args.repeats):
        for name, module in modules.items():
            start = time.perf_counter()
            results[name] = module.evaluate_sims(sims)
            times[name].append(time.perf_counter() - start)
    for name, measured in times.items():
        print(f"{name}: runs {', '.join(f'{t:.2f}' for t in measured)} s; median {statistics.median(measured):.3f} s")
    ratio = statistics.median(times["baseline"]) / statistics.median(times["ours"])
    print(f"ours: {ratio:.2f}x the baseline's speed; same metrics: {results['ours'] == results['baseline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
