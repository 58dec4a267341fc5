"""The bidirectional hinge ranking loss of VSE++ (margin 0.2, hardest negatives, summed)."""

from __future__ import annotations

import torch

from sgraf.errors import InputError


def ranking_loss(scores: torch.Tensor, margin: float = 0.2, max_violation: bool = True,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """Hinge loss over an (n_img, n_cap) score matrix, summed over the batch.

    Args:
        scores: (n, n) scores, image i matching caption i.
        margin: the hinge margin.
        max_violation: hardest negative per image and per caption (the authors' default);
            False sums over all negatives.
        positives: optional (n, n) bool mask of pairs that are not negatives (default: the
            diagonal), e.g. several captions of one image in a batch.

    Returns:
        a scalar tensor.
    """
    if scores.dim() != 2 or scores.size(0) != scores.size(1):
        raise InputError(f"ranking_loss needs a square (n, n) score matrix, got shape {tuple(scores.shape)}")
    eye = torch.eye(scores.size(0), dtype=torch.bool, device=scores.device)
    if positives is None:
        positives = eye
    elif positives.shape != scores.shape or positives.dtype != torch.bool:
        raise InputError(f"positives must be a bool mask of shape {tuple(scores.shape)}, "
                         f"got {positives.dtype} {tuple(positives.shape)}")
    diagonal = scores.diag().view(-1, 1)
    cost_caption = (margin + scores - diagonal).clamp(min=0).masked_fill(positives, 0)     # rows: images
    cost_image = (margin + scores - diagonal.t()).clamp(min=0).masked_fill(positives, 0)   # columns: captions
    if max_violation:
        return cost_caption.max(dim=1).values.sum() + cost_image.max(dim=0).values.sum()
    return cost_caption.sum() + cost_image.sum()


def max_pairs(n_images: int, n_columns: int) -> int:
    """The most entries of `n_columns` columns of an (n_images, n_cap) matrix the
    hardest-negative loss (`ranking_loss` with `max_violation`) has a gradient at: each column's
    positive and hardest negative image, and each image's hardest negative caption (3B for a
    whole B x B matrix). `sgraf.training.pairs` lists that many entries under the GPU plan, and
    the compiled pairs (`sgraf.kernels.train_chunks.pair_scores`) are padded to it."""
    return min(2 * n_columns + n_images, n_images * n_columns)
