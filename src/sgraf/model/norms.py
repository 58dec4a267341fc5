"""The authors' normalisations.

They add the epsilon AFTER the square root (`x / (sqrt(sum x^2) + 1e-8)`), unlike
`F.normalize`, which clamps the norm; exact equality with their numbers needs their formula.
"""

from __future__ import annotations

from typing import Any

import torch

EPS = 1e-8


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """`x / (||x||_2 + eps)` along `dim` (the authors' epsilon placement).

    With autograd, its backward is written out (`_L2Norm`): the same forward bits, a gradient
    of 6 operations where autograd's chain through the square, sum, root and division takes 10
    (on a GPU each is a kernel launch; a training step normalises a dozen tensors)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _L2Norm.apply(x, dim, eps)
    return x / ((x * x).sum(dim=dim, keepdim=True).sqrt() + eps)


# float32's smallest normal number: a floor for a norm that changes no float32 or bfloat16 value
# a computation can reach above it, and rounds to 0 in a float16 tensor (the old clamp there)
FLOAT32_TINY = torch.finfo(torch.float32).tiny


class _L2Norm(torch.autograd.Function):
    """`l2norm` with the gradient `g / (n + eps) - y (y . g) / n` (n = ||x||, y the output), and
    at x = 0 its limit, `g / eps` (y is 0 there): autograd's chain through the root gives NaN,
    which an all-zero region (padding; a features file cut short) had spread through a training
    step from its start, the encoder's bias being zero then. Elsewhere the same bits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
        norm = (x * x).sum(dim=dim, keepdim=True).sqrt()
        denominator = norm + eps
        out = x / denominator
        ctx.dim, ctx.dtype = dim, x.dtype
        ctx.save_for_backward(out, norm, denominator)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out, norm, denominator = ctx.saved_tensors
        product = out * grad
        along = product.sum(dim=ctx.dim, keepdim=True).div_(norm.clamp_min(FLOAT32_TINY))
        result = grad / denominator
        # `out * along` written over `product` where their dtypes agree (the same operations and
        # bits, in memory already touched: a node-sized backward 1.3x faster on a 2-core Xeon)
        reuse = product.dtype == torch.promote_types(out.dtype, along.dtype)     # its shape is out's (grad's)
        result = result.sub_(torch.mul(out, along, out=product) if reuse else out * along)
        # in x's dtype (under CUDA's autocast the norm may be float32 beside a bf16 x)
        return result.to(ctx.dtype), None, None


def _in_place_ok(x: torch.Tensor) -> bool:
    # in-place updates save a pass over memory; only when autograd is not recording
    return not (torch.is_grad_enabled() and x.requires_grad)


def l2norm_(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """`l2norm`, in place on `x` (a fresh intermediate) when autograd does not need it."""
    if not _in_place_ok(x):
        return l2norm(x, dim, eps)
    return x.div_((x * x).sum(dim=dim, keepdim=True).sqrt_().add_(eps))


def squared_difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`(x - y)^2` with one intermediate instead of two when autograd does not need it."""
    diff = x - y
    return diff.mul_(diff) if _in_place_ok(diff) else diff * diff


def l1norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """`x / (||x||_1 + eps)` along `dim`."""
    return x / (x.abs().sum(dim=dim, keepdim=True) + eps)


def cosine(x: torch.Tensor, y: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """Cosine similarity along `dim` with the authors' clamp of the norm product."""
    return (x * y).sum(dim) / (x.norm(dim=dim) * y.norm(dim=dim)).clamp(min=eps)
