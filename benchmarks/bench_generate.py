"""Time the embedded benchmark generator: synthetic vs CNN (EfficientNet-Lite0) features.

Generates the same small benchmark in both modes (several repeats, medians) and prints
seconds per image, the ratio cnn / synthetic, and the extrapolated time of the default
sizes (3,000 + 500 + 500 images). CNN mode needs `sgraf[vision]`.

    python benchmarks/bench_generate.py [--images 300] [--repeats 3]
    python benchmarks/bench_generate.py --extraction [--images 128] [--repeats 5]

`--extraction` times the CNN extraction alone (`GridBackbone.extract` on rendered scenes) as
shipped (`efficientnet_lite0`: BatchNorms folded into the convolutions, channels-last pixels and
weights on a CPU), with each of the two changes alone, and the network as published, in turn in
one process: medians, each against the network as published, and the largest difference of the
features from its.
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
    parser.add_argument("--extraction", action="store_true",
                        help="time the CNN extraction as shipped against the network as published instead")
    args = parser.parse_args()
    if args.extraction:
        return extraction(args)

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


def extraction(args: argparse.Namespace) -> int:
    """The CNN extraction as shipped (BatchNorms folded, channels-last on a CPU) against the network
    as published, and against each change alone."""
    import numpy as np
    import torch

    from sgraf.data.benchmark import random_scene
    from sgraf.data.features import efficientnet_lite0
    from sgraf.data.render import render_scene

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    images = [render_scene(random_scene(rng, family).objects) for family in range(args.images)]
    backbones = {"shipped": efficientnet_lite0(), "norms folded": efficientnet_lite0(),
                 "channels_last": efficientnet_lite0(fold_batch_norms=False),
                 "as published": efficientnet_lite0(fold_batch_norms=False)}
    backbones["norms folded"].channels_last = backbones["as published"].channels_last = False
    features = {name: backbone.extract(images[:2]) for name, backbone in backbones.items()}   # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in backbones}
    for _ in range(args.repeats):
        for name, backbone in backbones.items():
            started = time.perf_counter()
            features[name] = backbone.extract(images)
            seconds[name].append(time.perf_counter() - started)
    med = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"EfficientNet-Lite0 extraction of {args.images} rendered scenes, {args.repeats} rounds in turn, "
          f"torch threads {args.threads}")
    for name, values in seconds.items():
        difference = float(np.abs(features[name] - features["as published"]).max())
        print(f"{name:13s}: {med[name]:.3f} s (median; rounds {', '.join(f'{v:.3f}' for v in values)}), "
              f"{med[name] / args.images * 1000:.1f} ms/image, {med['as published'] / med[name]:.2f}x the network as "
              f"published, features within {difference:.2e} of its")
    print(f"(features up to {float(features['as published'].max()):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
