"""What the NaN/inf check of region features costs, next to reading and encoding the same batches.

Writes a Flickr30K-test-sized features file (default 1,000 images x 36 regions x 2048-d
float32, 295 MB) and reads it back memory-mapped in batches of 128, as `sgraf evaluate` does:

- read: each batch copied off the memory map into a float32 array (the readers' own work);
- check: `check_finite_features` on the batch (one `isfinite(...).all()` when all is finite);
- encode: the paper-size image encoder (a 2048 -> 1024 linear layer and l2 norm) on the batch,
  the first thing every reader does with it (scoring then costs far more).

Each figure is the median of `--repeats` passes over the whole file (the first pass, which
also fills the page cache, is not counted), in CPU seconds of this process (all its threads),
so that other work on a shared machine does not blur the comparison.

    python benchmarks/bench_finite_check.py
    python benchmarks/bench_finite_check.py --images 200 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sgraf.data.arrays import check_finite_features
from sgraf.model.encoders import ImageEncoder


def features_parser(description: str) -> argparse.ArgumentParser:
    """The options of a paper-size features file and its batches (this and bench_train_loader.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def write_features(path: Path, images: int, regions: int, dim: int, block: int = 128) -> None:
    """A float32 (images, regions, dim) `.npy` of uniform random values, written `block` images at a time."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(images, regions, dim))
    rng = np.random.default_rng(0)
    for start in range(0, images, block):
        part = out[start:start + block]
        part[...] = rng.random(part.shape, dtype=np.float32)
    out.flush()


def main() -> None:
    args = features_parser(__doc__.splitlines()[0]).parse_args()

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "test_ims.npy"
        write_features(path, args.images, args.regions, args.dim, args.batch)
        features = np.load(path, mmap_mode="r")
        encoder = ImageEncoder(args.dim, 1024).eval()

        def one_pass() -> dict[str, float]:
            seconds = {"read": 0.0, "check": 0.0, "encode": 0.0}
            for start in range(0, args.images, args.batch):
                t0 = time.process_time()
                batch = np.array(features[start:start + args.batch], dtype=np.float32)
                t1 = time.process_time()
                check_finite_features(batch, path, first_image=start)
                t2 = time.process_time()
                with torch.no_grad():
                    encoder(torch.from_numpy(batch))
                t3 = time.process_time()
                seconds["read"] += t1 - t0
                seconds["check"] += t2 - t1
                seconds["encode"] += t3 - t2
            return seconds

        one_pass()  # fills the page cache
        runs = [one_pass() for _ in range(args.repeats)]
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    size = args.images * args.regions * args.dim * 4 / 2**20
    print(f"{args.images} x {args.regions} x {args.dim} float32 ({size:.0f} MiB), batches of {args.batch}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}:")
    for key, value in median.items():
        print(f"  {key:<7} {value * 1e3:8.1f} ms CPU  ({value / median['read'] * 100:5.1f}% of read, "
              f"{value / median['encode'] * 100:5.1f}% of encode)")


if __name__ == "__main__":
    main()
