"""What every training batch sampler shares: a fixed plan of global batches for one epoch.

A sampler decides the epoch's batches (caption indices) from the seed and the epoch alone, then
`PlannedBatches` drops a last batch too small to train on, skips the batches a resumed run has
taken, and gives each process its contiguous share of every global batch
(`sgraf.distributed.shard_range`), so the shares concatenated in rank order are the batch of
one process. `loop.EpochBatchSampler` (random batches) and `families.FamilyBatchSampler`
(whole families) plan their batches and hand them here.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from sgraf import distributed


class PlannedBatches(Sampler[list[int]]):
    """Yields this process's share of each planned global batch from `start_batch` on.

    The last batch is kept when it holds at least `max(2, world_size)` captions (BatchNorm in
    training mode needs two images, and every process one caption).
    """

    def __init__(self, batches: Sequence[np.ndarray], start_batch: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        batches = list(batches)
        if batches and len(batches[-1]) < max(2, world_size):
            batches.pop()
        self.batches = batches
        self.start_batch = start_batch
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.start_batch)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches[self.start_batch:]:
            share = distributed.shard_range(len(batch), self.rank, self.world_size)
            yield batch[share.start:share.stop].tolist()
