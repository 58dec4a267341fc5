"""The l2 norm's epsilon and reciprocal shared by the kernels' eager routes (`sgraf.model.norms`
holds the model's own; nothing here imports the model)."""

from __future__ import annotations

import torch

EPS = 1e-8                           # sgraf.model.norms.EPS: the l2 and l1 norms' epsilon


def inverse_norm(x: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """`1 / (||x||_2 + eps)` over the last dim, keepdim (one fused reduction), in float32 by
    default; `dtype=None` keeps x's dtype (a bf16 norm still accumulates in float32)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=dtype).add_(EPS).reciprocal_()
