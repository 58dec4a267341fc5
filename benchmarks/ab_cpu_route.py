"""The two CPU float32 matmul routes (`sgraf.kernels.cpu`: oneDNN, MKL), each forced in turn, in one process.

`sgraf.kernels.cpu` picks a route per machine by a short probe; this says what the choice is
worth where users feel it: a training step (`train_step`, paper size, the batch of
`bench_train.py`) and eval scoring (`SGRAF.score` of random region features against captions of
Flickr30K-like lengths). Each piece of work runs once per route per round, with
`SGRAF_CPU_MATMUL` set before it, the order alternating per round (so that a change of the
machine's load reaches both), after a warm-up round: seconds per route (median) and the ratio
per round (oneDNN's seconds / MKL's; above 1, MKL is faster). The probe's own timings are
printed beside them, measured in this process the way `sgraf.kernels.cpu` takes them.

    python benchmarks/ab_cpu_route.py                      # SGR and SAF, training and scoring
    python benchmarks/ab_cpu_route.py --work train --modules saf --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROUTES = ("onednn", "aten")


def training(module: str, batch: int, threads: int):
    """{route: one training step} on copies of one paper-size model and batch (`bench_train.setup`)."""
    from bench_train import make_step, setup

    model, data = setup(module, batch, threads)
    return {route: make_step(model, data, module, "ours", "fp32") for route in ROUTES}


def scoring(module: str, images: int, captions: int, threads: int):
    """{route: `SGRAF.score` of `images` x `captions`} with one paper-size eval-mode model."""
    import torch

    from launch_counts import batch_of, scaled_model

    torch.set_num_threads(threads)
    model = scaled_model(module, 1).eval()
    data = batch_of(model, max(images, captions), seed=2)   # Flickr30K-like caption lengths

    def score() -> float:
        with torch.inference_mode():
            return float(model.score(data.images[:images], data.captions[:captions], data.lengths[:captions]).sum())
    return {route: score for route in ROUTES}


def probe() -> dict[str, float]:
    """The route probe's timings (seconds), as `sgraf.kernels.cpu` measures each route."""
    from sgraf.kernels import cpu

    return {route: cpu._time_route(route) for route in ROUTES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", choices=("sgr", "saf"), default=["sgr", "saf"])
    parser.add_argument("--work", nargs="+", choices=("train", "score"), default=["train", "score"])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up round")
    parser.add_argument("--batch", type=int, default=128, help="training batch")
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--captions", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    import torch

    from sgraf.kernels import cpu, tuning

    if not cpu.ONEDNN:
        raise SystemExit(f"this PyTorch ({torch.__version__}) has no oneDNN route: nothing to compare")
    torch.set_num_threads(args.threads)
    print(f"{tuning.cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    seconds = probe()
    print(f"probe (2,048 x 1,024 -> 256): oneDNN {seconds['onednn'] * 1e3:.2f} ms, MKL {seconds['aten'] * 1e3:.2f} ms, "
          f"oneDNN / MKL {seconds['onednn'] / seconds['aten']:.2f}")
    for work in args.work:
        for module in args.modules:
            runs = (training(module, args.batch, args.threads) if work == "train"
                    else scoring(module, args.images, args.captions, args.threads))
            times: dict[str, list[float]] = {route: [] for route in ROUTES}
            for turn in range(args.rounds + 1):
                for route in (ROUTES if turn % 2 else ROUTES[::-1]):
                    os.environ["SGRAF_CPU_MATMUL"] = route
                    start = time.perf_counter()
                    runs[route]()
                    if turn:
                        times[route].append(time.perf_counter() - start)
            os.environ.pop("SGRAF_CPU_MATMUL")
            ratios = [a / b for a, b in zip(times["onednn"], times["aten"])]
            what = f"train step, batch {args.batch}" if work == "train" else f"score {args.images} x {args.captions}"
            print(f"{module} {what}: oneDNN {statistics.median(times['onednn']):.3f} s, "
                  f"MKL {statistics.median(times['aten']):.3f} s, oneDNN / MKL {statistics.median(ratios):.3f} "
                  f"(per round {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
