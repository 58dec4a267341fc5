"""The training loader's cost to the process that trains: the NaN/inf check there or in the workers.

On a GPU a training step is bound by the thread that launches its kernels (the H100: the GPU busy
18.5 ms of a 61.5 ms bf16 step), so every millisecond that thread spends on a batch is a
millisecond of the step. `CheckedLoader` checks each batch's features for NaN/inf; with worker
processes the worker that collates a batch now looks first (`FiniteCollate`, `Batch.finite`) and
the training thread checks only a batch found not finite.

This writes a paper-size training split (`--images` x 36 regions x 2048-d float32, five captions
per image) and iterates a loader over it with `--workers` workers and batches of 128, in turns
with the check in the training thread (as before session 20) and in the workers. On a GPU the
loader's own thread copies each batch into page-locked memory before the training thread gets
it; that copy is made here too, untimed (no page-locked memory without CUDA: a plain copy), and
the training thread's CPU time on each batch after it (`time.thread_time`: the check, or the look
at the flag) is what is timed, medians over `--repeats` epochs after one that fills the page cache.

    python benchmarks/bench_train_loader.py
    python benchmarks/bench_train_loader.py --images 300 --repeats 3
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch.utils.data import DataLoader

from sgraf.data import precomp
from sgraf.data.precomp import PrecompDataset, PrecompSplit
from sgraf.data.vocab import build_vocab
from bench_finite_check import features_parser, write_features
from sgraf.kernels.tuning import cpu_model


def write_split(folder: Path, images: int, regions: int, dim: int) -> None:
    """A training split: random features, five captions of 8-17 random words per image."""
    write_features(folder / "train_ims.npy", images, regions, dim)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    (folder / "train_caps.txt").write_text("".join(" ".join(rng.choice(words, size=8 + i % 10)) + "\n"
                                                   for i in range(5 * images)))


class TimedLoader(precomp.CheckedLoader):
    """`CheckedLoader`, each batch first copied as the pin-memory thread would (untimed), then
    checked as `CheckedLoader.__iter__` does, with the training thread's CPU time of that."""

    seconds = 0.0

    def __iter__(self):
        for batch in DataLoader.__iter__(self):
            batch = batch._apply(torch.clone)           # the pin-memory thread's copy
            start = time.thread_time()
            if getattr(batch, "finite", None) is not True:
                self.dataset.check_batch(batch)
            self.seconds += time.thread_time() - start
            yield batch


def epoch(dataset: PrecompDataset, batch: int, workers: int, in_workers: bool) -> tuple[float, int]:
    """(the training thread's CPU seconds on the batches after their copy, batches) of one pass."""
    collate = precomp.FiniteCollate if in_workers else (lambda collate: collate)
    with mock.patch.object(precomp, "FiniteCollate", collate):
        loader = TimedLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                             collate_fn=precomp.collate_batch)
        batches = sum(1 for _ in loader)
        return loader.seconds, batches


def main() -> None:
    parser = features_parser(__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write_split(Path(folder), args.images, args.regions, args.dim)
        split = PrecompSplit(folder, "train")
        dataset = PrecompDataset(split, build_vocab(split.captions, min_count=1))
        ways = {"the training thread checks": False, "the workers check": True}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for turn in range(args.repeats + 1):       # the first turn fills the page cache
            for way, in_workers in ways.items():
                seconds, batches = epoch(dataset, args.batch, args.workers, in_workers)
                if turn:
                    times[way].append(seconds / batches)
    print(f"{cpu_model()}, torch {torch.__version__}: {args.images} x {args.regions} x {args.dim} float32 "
          f"features, {5 * args.images} captions, batches of {args.batch}, {args.workers} workers; the "
          f"training thread's CPU time per batch after its copy, median of {args.repeats} epochs:")
    medians = {way: statistics.median(values) for way, values in times.items()}
    for way, value in medians.items():
        print(f"  {way}: {value * 1e3:.2f} ms")
    before, after = medians.values()
    print(f"  saved: {(before - after) * 1e3:.2f} ms per batch ({before / after:.2f}x)")


if __name__ == "__main__":
    main()
