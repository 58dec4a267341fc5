"""Private memory while iterating a ~5 GB precomp split through the DataLoader.

Writes (or reuses) the embedded benchmark with 2048-d synthetic features (BUTD-sized) and
enough training images for ~5 GB in `train_ims.npy`, then iterates shuffled batches through
`PrecompDataset` + `make_loader` and reports the process's RssAnon (private memory; the
memory-mapped file's pages are file-backed and count as RssFile) against the reference of
loading the whole file into RAM (its size).

    python benchmarks/bench_memory.py                 # ~5 GB in $TMPDIR/sgraf_bench_memory
    python benchmarks/bench_memory.py --gb 0.5 --batches 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=5.0, help="size of train_ims.npy in GB (default 5)")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "sgraf_bench_memory"))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=0, help="stop after N batches (0: a whole epoch)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the data for the next run")
    args = parser.parse_args()

    import numpy as np

    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.precomp import PrecompDataset, PrecompSplit, make_loader
    from sgraf.data.vocab import load_vocab

    dim, regions = 2048, 36
    n_train = int(args.gb * 1e9 / (regions * dim * 4))
    root = Path(args.dir)
    ims = root / "train_ims.npy"
    expected_bytes = n_train * regions * dim * 4
    if ims.is_file() and abs(ims.stat().st_size - expected_bytes) < 1 << 20:
        print(f"reusing {ims}")
    else:
        free = shutil.disk_usage(root.parent if not root.exists() else root).free
        if free < expected_bytes * 1.2:
            print(f"not enough free disk in {root}: {free / 1e9:.1f} GB free, need {expected_bytes * 1.2 / 1e9:.1f}")
            return 1
        started = time.perf_counter()
        generate_benchmark(root, seed=0, features="synthetic", synthetic_dim=dim, n_train=n_train, n_dev=4,
                           n_test=4, save_images=False, overwrite=True)   # its own data of another size
        print(f"generated {n_train} images in {time.perf_counter() - started:.0f}s")
    print(f"train_ims.npy: {ims.stat().st_size / 1e9:.2f} GB, {n_train} x {regions} x {dim} float32")

    anon_start = status_kb("RssAnon")
    split = PrecompSplit(root, "train")
    dataset = PrecompDataset(split, load_vocab(root / "vocab.json"))
    loader = make_loader(dataset, batch_size=args.batch_size, shuffle=True, seed=0, num_workers=args.workers)
    assert isinstance(split.images, np.memmap)
    anon, seconds = [], []
    started = time.perf_counter()
    tick = started
    for i, batch in enumerate(loader):
        assert batch.images.shape[1:] == (regions, dim)
        anon.append(status_kb("RssAnon"))
        now = time.perf_counter()
        seconds.append(now - tick)
        tick = now
        if args.batches and i + 1 >= args.batches:
            break
    elapsed = time.perf_counter() - started
    peak_mb = max(anon) / 1024
    reference_mb = ims.stat().st_size / 2**20
    print(f"batches {len(anon)} x {args.batch_size} captions in {elapsed:.0f}s "
          f"(median {statistics.median(seconds) * 1000:.0f} ms/batch), workers {args.workers}")
    print(f"RssAnon: start {anon_start / 1024:.0f} MB, median {statistics.median(anon) / 1024:.0f} MB, "
          f"peak {peak_mb:.0f} MB (limit 600 MB: {'OK' if peak_mb < 600 else 'OVER'})")
    print(f"RssFile now {status_kb('RssFile') / 1024:.0f} MB (file-backed pages of the mapping, reclaimable)")
    print(f"reference (whole file in RAM): {reference_mb:.0f} MB -> ratio peak RssAnon / reference = "
          f"{peak_mb / reference_mb:.3f}")
    if not args.keep and not os.environ.get("SGRAF_BENCH_KEEP"):
        shutil.rmtree(root)
        print(f"removed {root} (pass --keep to reuse it)")
    return 0 if peak_mb < 600 else 1


if __name__ == "__main__":
    sys.exit(main())
