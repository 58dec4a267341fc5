"""Similarity Attention Filtration (Eq. 9) and the AVE baseline (Table 4 "AA").

SAF: `beta = l1norm(sigmoid(BN(W_f N + b_f)))` over the valid nodes, `s_f = l2norm(sum beta N)`.
In training mode the authors score one caption at a time, so their BatchNorm1d(1) takes its
statistics over (images x nodes) of ONE caption and updates its running statistics once per
caption, in caption order. `AttentionFiltration` reproduces that for a whole block at once:
per-caption statistics with masks, and the running-statistics recurrence in closed form.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sgraf.errors import InputError
from sgraf.model.norms import l1norm, l2norm


class AttentionFiltration(nn.Module):
    """SAF, Eq. 9."""

    def __init__(self, sim_dim: int) -> None:
        super().__init__()
        self.attn_sim_w = nn.Linear(sim_dim, 1)
        self.bn = nn.BatchNorm1d(1)

    def per_caption_batch_norm(self, logits: torch.Tensor,
                               node_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train-mode BatchNorm1d(1) with statistics per caption, without touching the buffers.

        Args:
            logits: (n_img, n_cap, P) filter logits `W_f s + b_f`.
            node_mask: (n_cap, P) bool valid nodes.

        Returns:
            the normalised logits (n_img, n_cap, P), and each caption's batch mean and unbiased
            variance (n_cap,), detached: what `update_running_stats` takes.
        """
        bn = self.bn
        mask = node_mask.unsqueeze(0).to(logits.dtype)                         # (1, n_cap, P)
        count = logits.size(0) * node_mask.sum(dim=1).to(logits.dtype)         # (n_cap,)
        # every caption has a valid node, so with two images it has two values: only a single
        # image needs the (device-synchronising) look at the counts
        if logits.size(0) < 2 and bool((count < 2).any()):
            raise InputError("SAF BatchNorm in training mode needs more than one value per caption "
                             "(more than one image or node)")
        mean = (logits * mask).sum(dim=(0, 2)) / count                         # (n_cap,)
        centred = (logits - mean.view(1, -1, 1)) * mask
        var = centred.pow(2).sum(dim=(0, 2)) / count                           # biased, (n_cap,)
        normed = centred / (var.view(1, -1, 1) + bn.eps).sqrt()
        if bn.affine:
            normed = normed * bn.weight + bn.bias
        return normed, mean.detach(), (var * count / (count - 1)).detach()

    def train_filter(self, nodes: torch.Tensor,
                     node_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train-mode Eq. 9 as a pure function (safe to recompute under activation checkpointing).

        Args:
            nodes: (n_img, n_cap, P, m); node_mask: (n_cap, P) bool.

        Returns:
            pooled (n_img, n_cap, m), and the per-caption BatchNorm mean and unbiased variance
            (n_cap,) for `update_running_stats`, which the caller applies once, in caption order.
        """
        logits = self.attn_sim_w(nodes).squeeze(3)                             # (n_img, n_cap, P)
        normed, mean, var = self.per_caption_batch_norm(logits, node_mask)
        return self._pool(nodes, node_mask, normed), mean, var

    def update_running_stats(self, means: torch.Tensor, variances: torch.Tensor) -> None:
        """Advance the running statistics by one caption per entry, in order (no-op if untracked)."""
        if self.bn.track_running_stats:
            with torch.no_grad():
                self._update_running_stats(means.float(), variances.float())

    @staticmethod
    def _pool(nodes: torch.Tensor, node_mask: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """`l2norm(sum_p beta_p s_p)`, the sum a batched matmul as the authors' `matmul(attn, nodes)`
        where `beta` and the nodes share a dtype: forward and backward of a float32 training chunk
        3.5x faster than the product and its sum, which wrote and read back an (n_img, n_cap, P, m)
        tensor. Beside float32 `beta`, 16-bit nodes keep the product (in float32) and its sum: a
        batched matmul would keep a float32 copy of every chunk's nodes for backward (a SAF bf16
        step's peak memory 2.26 GiB instead of 2.00)."""
        beta = l1norm(torch.sigmoid(normed) * node_mask.unsqueeze(0).to(normed.dtype), dim=2)
        if beta.dtype != nodes.dtype:
            return l2norm((beta.unsqueeze(3) * nodes).sum(dim=2))
        n_img, n_cap, n_nodes, dim = nodes.shape
        with torch.autocast(nodes.device.type, enabled=False):
            pooled = torch.bmm(beta.reshape(-1, 1, n_nodes), nodes.reshape(-1, n_nodes, dim))
        return l2norm(pooled.view(n_img, n_cap, dim))

    def _update_running_stats(self, means: torch.Tensor, variances: torch.Tensor) -> None:
        """Apply `r <- (1 - mom) r + mom x` for each caption in order, in closed form."""
        bn = self.bn
        n_cap = means.numel()
        # the weights are host arithmetic (float64, numpy): nothing here waits for a device
        if bn.momentum is None:  # cumulative average, as nn.BatchNorm1d does with momentum=None
            start = int(bn.num_batches_tracked)
            factors = 1.0 / np.arange(start + 1, start + n_cap + 1, dtype=np.float64)
        else:
            factors = np.full(n_cap, float(bn.momentum), dtype=np.float64)
        # weight of caption c in the final value: f_c * prod_{c' > c} (1 - f_c')
        keep = np.cumprod((1 - factors)[::-1])[::-1]                            # prod_{c' >= c}
        after = np.concatenate([keep[1:], np.ones(1)])
        weights = torch.from_numpy(factors * after).to(means.device, non_blocking=True)
        for buffer, values in ((bn.running_mean, means), (bn.running_var, variances)):
            total = float(keep[0]) * buffer.double() + (weights * values.double()).sum()
            buffer.copy_(total.to(buffer.dtype))
        bn.num_batches_tracked.add_(n_cap)

    def forward(self, nodes: torch.Tensor, node_mask: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, P, m) nodes, (n_cap, P) bool -> (n_img, n_cap, m)."""
        if self.training:
            pooled, means, variances = self.train_filter(nodes, node_mask)
            self.update_running_stats(means, variances)
            return pooled
        logits = self.attn_sim_w(nodes).squeeze(3)                             # (n_img, n_cap, P)
        bn = self.bn
        normed = F.batch_norm(logits.reshape(-1, 1), bn.running_mean, bn.running_var, bn.weight,
                              bn.bias, False, 0.0, bn.eps).view_as(logits)
        return self._pool(nodes, node_mask, normed)


def average_scores(nodes: torch.Tensor, node_mask: torch.Tensor, eval_layer: nn.Linear | None) -> torch.Tensor:
    """AVE: mean over the valid nodes of per-alignment scores.

    With vector nodes each node is scored by FC + sigmoid; with scalar (cosine) nodes the
    cosines themselves are averaged (Table 4 rows 1 and 5).

    Args:
        nodes: (n_img, n_cap, P, m).
        node_mask: (n_cap, P) bool.
        eval_layer: the FC of the score head, or None for scalar nodes.

    Returns:
        (n_img, n_cap).
    """
    per_node = nodes.squeeze(3) if eval_layer is None else torch.sigmoid(eval_layer(nodes)).squeeze(3)
    mask = node_mask.unsqueeze(0).to(per_node.dtype)
    return (per_node * mask).sum(dim=2) / mask.sum(dim=2)
