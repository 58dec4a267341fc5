"""Batches of whole families (`TrainConfig.batches = "families"`) and the loss's truth mask.

A family's pictures differ by one change each (`sgraf.data.families`). Each batch holds whole
families: for every family, one caption of each of its pictures, so that the caption of the base
picture meets its relation twin, its binding twin and the others in the same batch, and the
hardest negative of the ranking loss is usually the picture that differs by one change.

An epoch still takes every caption once: a family of pictures with 5 captions each gives 5
units (unit r holds the r-th caption of each picture, in an order drawn per picture), the units
of all families are shuffled and packed into batches of up to `batch_size` captions without
splitting a unit. Like `EpochBatchSampler`, the order depends only on (seed, epoch), and with
several processes each batch is the global batch of which rank r yields its contiguous share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from sgraf.errors import InputError
from sgraf.training.batches import PlannedBatches
from sgraf.training.global_batch import gather_ids

if TYPE_CHECKING:
    from sgraf.data.precomp import Batch


class FamilyBatchSampler(PlannedBatches):
    """Batches of caption indices holding whole families (see the module docstring).

    Args:
        groups: the picture indices of each family (`Families.groups`).
        captions_per_image: captions per picture (caption k belongs to picture k // it).
        batch_size: global batch size; at least the largest family.
        seed, epoch: the order depends only on these.
        family_share: the share of families drawn whole this epoch (chosen from seed and
            epoch); the other families' captions are units of one caption each.
        start_batch: batches of this epoch already taken (resume).
        rank, world_size: this process and how many share each batch.

    Raises:
        InputError: `batch_size` smaller than the largest family.
    """

    def __init__(self, groups: Sequence[np.ndarray], captions_per_image: int, batch_size: int, seed: int,
                 epoch: int, start_batch: int = 0, rank: int = 0, world_size: int = 1,
                 family_share: float = 1.0) -> None:
        largest = max((len(g) for g in groups), default=0)
        if batch_size < largest:
            raise InputError(f"batch_size={batch_size} is smaller than a family ({largest} pictures); "
                             f"batches=families needs batch_size >= {largest}")
        rng = np.random.default_rng([seed, epoch, 1])
        whole = np.ones(len(groups), dtype=bool) if family_share >= 1 else \
            np.random.default_rng([seed, epoch, 2]).random(len(groups)) < family_share
        units: list[np.ndarray] = []
        for members, in_whole in zip(groups, whole):
            # per picture an order of its captions: unit r takes the r-th of each
            order = np.stack([rng.permutation(captions_per_image) for _ in members])   # (pictures, c)
            captions = np.asarray(members)[:, None] * captions_per_image + order
            if in_whole:
                units.extend(captions[:, r] for r in range(captions_per_image))
            else:
                units.extend(captions.reshape(-1, 1))
        batches: list[np.ndarray] = []
        current: list[np.ndarray] = []
        filled = 0
        for index in rng.permutation(len(units)):
            unit = units[index]
            if filled + len(unit) > batch_size:
                batches.append(np.concatenate(current))
                current, filled = [], 0
            current.append(unit)
            filled += len(unit)
        if current:
            batches.append(np.concatenate(current))
        super().__init__(batches, start_batch, rank, world_size)


class TruthCollate:
    """`collate_batch`, plus each caption's `true_of` row (the pictures it is true of).

    A class rather than a closure, so that DataLoader workers can receive it.
    """

    def __init__(self, true_of: np.ndarray) -> None:
        self.true_of = true_of

    def __call__(self, items: Sequence[tuple]) -> "Batch":
        from sgraf.data.precomp import collate_batch

        batch = collate_batch(items)
        batch.true_of = torch.from_numpy(self.true_of[batch.caption_ids.numpy()])
        return batch


def truth_mask(image_ids: torch.Tensor, true_of: torch.Tensor) -> torch.Tensor:
    """(B, B) bool over the global batch: True where caption j is true of row i's picture.

    Args:
        image_ids: (n,) this process's pictures, one per caption.
        true_of: (n, width) the pictures each caption is true of, -1 padded (its own first).
    """
    ids = gather_ids(image_ids)
    truth = gather_ids(true_of.reshape(-1)).view(-1, true_of.shape[1])
    return (ids.view(-1, 1, 1) == truth.unsqueeze(0)).any(dim=2)
