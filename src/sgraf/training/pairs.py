"""A training step's backward pass through the pairs its loss reads, not the whole score matrix.

The authors' loss (VSE++'s hinge with hardest negatives, `sgraf.model.loss`) reads at most three
scores per caption of a batch's (B, B) matrix: each positive pair, each image's hardest negative
caption and each caption's hardest negative image. Its gradient with respect to the matrix is
zero everywhere else, so the gradient with respect to the weights is `sum_e g_e ds_e/dtheta` over
at most 3B entries e, where `g = dLoss/dscores`. For SGR every score depends on its own pair
alone (no BatchNorm across pairs, no random numbers past the encoders), so:

1. the encoders and the global vectors run once, with autograd;
2. the score matrix is computed without autograd (a forward pass that keeps nothing);
3. the loss and `g` come from that matrix (B x B numbers, autograd over the loss alone);
4. the selected pairs are scored again with autograd (`SGRAF.train_scores`), and
   `sum_e g_e s_e` is backpropagated.

The loss, the gradients and so every update are the authors' up to float rounding (the
selected pairs are computed in another batch shape); the ties of the hardest negatives are
broken as `torch.max` breaks them on the matrix. A step does one forward pass over the B^2
pairs instead of a forward pass and a backward pass of twice its cost, and keeps no per-pair
intermediates for backward. SAF's training BatchNorm takes its statistics over all the images
of each caption, so every pair reaches its loss: SAF and joint models, a loss summed over all
negatives (`max_violation=false`, a warm-up) keep the whole-matrix backward (`applies`). On
several processes the matrix is assembled from every process's columns without autograd, and
each process scores again the selected entries of its own columns
(`sgraf.training.global_batch.global_batch_train_scores`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from sgraf.training.config import TrainConfig


# The smallest batch (`TrainConfig.batch_size`) that takes the pairs' backward: it scores 3B of
# the B^2 pairs a second time, besides the encoders' and the matrix's own work. On a 2-core AMD
# EPYC Zen 3, SGR fp32, against the whole matrix's backward: at the paper's sizes 1.09x at batch
# 16, 1.31x at 32, 2.4x at 128; at the `tiny` preset's sizes 0.69x at 8, 0.81x at 16, 0.89x at
# 24, 1.79x at 64.
MIN_BATCH = 32


def applies(model: nn.Module, config: TrainConfig) -> bool:
    """Whether `train_step` takes the pairs' backward for this model and this epoch's loss:
    `pair_backward` on, hardest negatives (`max_violation`, after any warm-up), a batch of at
    least `MIN_BATCH` captions and a model whose head couples no pairs (`SGRAF.pair_training`)."""
    return (config.pair_backward and config.max_violation and config.batch_size >= MIN_BATCH
            and bool(getattr(model, "pair_training", False)))


def loss_and_pairs(values: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor], bound: int | None,
                   columns: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of a score matrix and the entries of `columns` its gradient is not zero at.

    Args:
        values: (n_img, n_cap) scores without autograd.
        loss_of: the loss of a score matrix (differentiable).
        bound: None lists exactly the non-zero entries (reads their number from the device);
            a number lists that many entries, the non-zero ones and others of weight 0 (no
            device read, for the GPU plan; the loss must have at most `bound` non-zero entries
            there, `sgraf.model.loss.max_pairs`).
        columns: the columns to list (this process's captions, `TrainScores.columns`).

    Returns:
        the loss (no autograd), and rows, cols (numbered within `columns`) and weights (P,):
        the entries and the loss's gradient there.
    """
    leaf = values.detach().float().requires_grad_()
    with torch.enable_grad():
        loss = loss_of(leaf)
        (grad,) = torch.autograd.grad(loss, leaf)
    grad = grad[:, columns]
    if bound is None:
        if not bool(torch.isfinite(loss)):   # nothing to select: the step refuses this loss
            rows = cols = torch.zeros(0, dtype=torch.long, device=grad.device)
            return loss.detach(), rows, cols, grad[rows, cols]
        rows, cols = grad.nonzero().unbind(1)
        return loss.detach(), rows, cols, grad[rows, cols]
    # the `bound` largest |gradients| hold every non-zero one (topk runs on any device without a
    # read; nonzero_static has no CUDA kernel before PyTorch 2.6)
    flat = grad.reshape(-1)
    index = flat.abs().topk(min(bound, flat.numel()), sorted=False).indices
    return loss.detach(), index // grad.size(1), index % grad.size(1), flat[index]


def surrogate(pair_scores: torch.Tensor, weights: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """`copies * sum_e g_e s_e`: a scalar whose gradient is the loss's (its value is not the
    loss). On several processes each backpropagates its columns' entries; `copies` (their
    number) scales them so that the average over processes of their gradients is the loss's."""
    return (pair_scores.float() * weights).sum() * copies
