"""Time the embedded benchmark generator: synthetic vs CNN (EfficientNet-Lite0) features.

Generates the same small benchmark in both modes (several repeats, medians) and prints
seconds per image, the ratio cnn / synthetic, and the extrapolated time of the default
sizes (3,000 + 500 + 500 images). CNN mode needs `sgraf[vision]`.

    python benchmarks/bench_generate.py [--images 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=300, help="images per run (train; dev and test add 10%% each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.features import efficientnet_lite0

    torch.set_num_threads(args.threads)
    n_train, n_small = args.images, max(1, args.images // 10)
    total = n_train + 2 * n_small
    backbone = efficientnet_lite0()
    backbone.extract([__import__("PIL.Image", fromlist=["Image"]).new("RGB", (192, 192))] * 2)  # warm-up
    per_image: dict[str, list[float]] = {"synthetic": [], "cnn": []}
    for _ in range(args.repeats):
        for mode in per_image:
            with tempfile.TemporaryDirectory() as out:
                started = time.perf_counter()
                generate_benchmark(out, seed=0, features=mode, n_train=n_train, n_dev=n_small, n_test=n_small,
                                   backbone=backbone if mode == "cnn" else None)
                per_image[mode].append((time.perf_counter() - started) / total)
    default_images = 3000 + 500 + 500
    med = {m: statistics.median(v) for m, v in per_image.items()}
    print(f"{total} images per run, {args.repeats} repeats, torch threads {args.threads}")
    for mode, seconds in med.items():
        print(f"{mode:9s}: {seconds * 1000:7.1f} ms/image (median; runs {', '.join(f'{s * 1000:.1f}' for s in per_image[mode])})"
              f" -> default sizes ({default_images} images) ~{seconds * default_images:.0f}s")
    print(f"ratio cnn / synthetic = {med['cnn'] / med['synthetic']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
