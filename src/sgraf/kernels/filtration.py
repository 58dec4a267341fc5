"""SAF's attention filtration over every (image, caption) pair of an eval scoring block (Eq. 9),
by the faster of two routes on this device.

Each pair has P similarity nodes of m values (the global node and the caption's words). With
SAF's BatchNorm in eval mode folded into the filter (`scale`, `shift`), the pooled vector is
`l2norm(sum_p beta_p s_p)` with `beta = l1norm(sigmoid(scale (W_f s_p + b_f) + shift))` over
the caption's valid nodes.

- `eager`: PyTorch's operations in float32. For bf16 nodes that first casts them to float32:
  at a block of 256 images x 1,024 captions of 13 words, 1.9 GB read and 3.8 GB written, then
  read twice (the filter's logits, the pooling): about 13 GB, where the bf16 nodes are 1.9 GB
  (`benchmarks/launch_counts.py --traffic`).
- `fused`: one Triton kernel. Each program takes `PAIRS` pairs in turn; for each it loads the
  pair's nodes once (in their dtype, to float32 on chip), and computes the logits, the filter,
  the pooling and the l2 norm in float32, the operations of the eager route, then writes the
  pooled vector. The two agree to the summation order.

`measure_filter_route(device, dtype, dim)` times the eager route and the kernel with each of
`TILES` once per device, dtype and node width on a block-shaped probe (`sgraf.kernels.fused_routes`,
like the other kernels; `SGRAF.tune_eval` calls it before a large split on a CUDA device with
Triton) and keeps `eager` unless a tile is more than 20 % faster and agrees with it.
`filter_route` returns the stored choice without measuring; `SGRAF_FILTER_ROUTE=eager|fused`
forces one. Elsewhere (the CPU, a compiled graph, `plan.emulate_gpu`, no Triton) and for pairs
larger than `MAX_VALUES`, the route is `eager`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgraf.kernels.compiled import padded_count
from sgraf.kernels.cpu import fast_linear
from sgraf.kernels.fused_routes import FP_FUSION, ROUTES, FusedRoutes, dtype_key, fusable
from sgraf.kernels.norms import EPS, inverse_norm

# a pair's values (nodes x features, each padded to a power of two) in one program, at most
# (larger pairs: eager): 64 nodes of 256 features, which compile for sm_90 without spilling
# registers with the tiles as `launch` adjusts them
MAX_VALUES = 64 * 256
# the probe: (images, captions, nodes) of a scoring block's middle length bucket
PROBE_BLOCK = (64, 256, 14)
# the kernel's tiles: (pairs per program, warps, pipeline stages). The first is "fused"'s; the
# probe times each as a route of its own
TILES = ((4, 4, 1), (8, 4, 1), (2, 4, 1), (4, 8, 1))
ROUTE = FusedRoutes("SGRAF_FILTER_ROUTE", "attention-filtration", TILES)
MEASURED = ROUTE.measured


def filter_route(device: torch.device | str, dtype: torch.dtype, dim: int) -> str:
    """'eager' or a fused route ('fused' or 'fused PxWxS') for `filtered` on `device` for nodes
    in `dtype`, `dim` wide: `SGRAF_FILTER_ROUTE` if set, else the choice `measure_filter_route`
    stored for this device, else the default. Never measures."""
    return ROUTE.peek(_name(dtype, dim), device, fusable(device))


def measure_filter_route(device: torch.device | str, dtype: torch.dtype, dim: int) -> str:
    """`filter_route`, measured on this device if it has not been (a scorer calls this before
    scoring a large split)."""
    device = torch.device(device)

    def runner(route: str) -> Callable[[], Any]:
        inputs = probe(device, dtype, dim)
        return lambda: filtered(*inputs, route=route)

    return ROUTE.choose(_name(dtype, dim), device, fusable(device), True, runner, dtype)


def _name(dtype: torch.dtype, dim: int) -> str:
    return f"saf filter route|{dtype_key(dtype)}|m={dim}"


def applies(route: str, n_nodes: int, dim: int) -> bool:
    """Whether `route` runs the kernel for pairs of `n_nodes` nodes of `dim` features (else the
    eager route)."""
    return route != ROUTES[0] and _padded(n_nodes, 2) * _padded(dim, 16) <= MAX_VALUES


def launch(tile: tuple[int, ...], nodes: int, dim: int) -> tuple[int, int, int]:
    """(pairs per program, warps, stages) of `tile` for pairs padded to `nodes` x `dim` values: a
    tile is sized for pairs of up to 16 x 256 values, larger ones get fewer pairs per program and
    more warps (so that every tile compiles without spilling up to `MAX_VALUES`)."""
    pairs, warps, stages = tile
    factor = max(1, nodes * dim // (16 * 256))
    return max(1, pairs // factor), max(warps, min(16, 2 * factor)), stages


def _padded(n: int, least: int) -> int:
    """The power of two at least `n` and `least` (the kernel's block sizes)."""
    return max(least, padded_count(n))


def filtered(nodes: torch.Tensor, node_mask: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
             scale: torch.Tensor, shift: torch.Tensor, route: str) -> torch.Tensor:
    """SAF's pooled vector of every pair, `l2norm(sum_p beta_p s_p)` (Eq. 9, BatchNorm in eval mode).

    Args:
        nodes: (n_img, n_cap, P, m) in float32 or a 16-bit dtype, the last dim contiguous.
        node_mask: (n_cap, P) bool, the caption's valid nodes.
        weight: (1, m) and bias: (1,) float32, the filter `W_f`, `b_f`.
        scale, shift: (1,) float32, the eval BatchNorm folded: `scale * logit + shift`.
        route: `filter_route`'s answer.

    Returns:
        (n_img, n_cap, m) float32.
    """
    n_img, n_cap, n_nodes, dim = nodes.shape
    if applies(route, n_nodes, dim):
        return _fused(nodes, node_mask, weight, bias, scale, shift, ROUTE.tile(route))
    nodes = nodes.float()
    logits = fast_linear(nodes, weight, bias).squeeze(3)                                   # (n_img, n_cap, P)
    beta = torch.sigmoid_(logits.mul_(scale).add_(shift)).mul_(node_mask.unsqueeze(0))
    beta = beta.div_(beta.sum(dim=2, keepdim=True).add_(EPS))                              # l1norm (beta >= 0)
    pooled = torch.bmm(beta.view(-1, 1, n_nodes), nodes.reshape(-1, n_nodes, dim)).view(n_img, n_cap, dim)
    return pooled.mul_(inverse_norm(pooled))


def _fused(nodes: torch.Tensor, node_mask: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
           scale: torch.Tensor, shift: torch.Tensor, tile: tuple[int, ...]) -> torch.Tensor:
    import triton

    n_img, n_cap, n_nodes, dim = nodes.shape
    padded_nodes, padded_dim = _padded(n_nodes, 2), _padded(dim, 16)
    pairs, warps, stages = launch(tile, padded_nodes, padded_dim)
    if nodes.stride(3) != 1:
        nodes = nodes.contiguous()
    out = torch.empty(n_img, n_cap, dim, device=nodes.device, dtype=torch.float32)
    n_pairs = n_img * n_cap
    _kernel()[(triton.cdiv(n_pairs, pairs),)](
        nodes, node_mask.contiguous().view(torch.uint8), weight.float().contiguous(), bias.float(),
        scale.float(), shift.float(), out, n_pairs, n_cap, n_nodes, dim,
        nodes.stride(0), nodes.stride(1), nodes.stride(2),
        NODES=padded_nodes, DIM=padded_dim, PAIRS=pairs,
        EPSILON=EPS, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
    return out


def _kernel() -> Any:
    """The Triton kernel (its module imported at the first use)."""
    from sgraf.kernels.triton_filtration import filter_kernel

    return filter_kernel


def probe(device: torch.device, dtype: torch.dtype, dim: int, seed: int = 0,
          block: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """`filtered` inputs drawn on `device`, shaped like a scoring block (`block`: images,
    captions, nodes; default `PROBE_BLOCK` on a GPU, a small one elsewhere): (nodes, node_mask,
    weight, bias, scale, shift), unit nodes in `dtype`, a third of the captions a node shorter."""
    n_img, n_cap, n_nodes = block or (PROBE_BLOCK if device.type == "cuda" else (3, 5, 6))
    generator = torch.Generator(device).manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale

    nodes = torch.nn.functional.normalize(draw(n_img, n_cap, n_nodes, dim), dim=-1).to(dtype)
    lengths = n_nodes - (torch.arange(n_cap, device=device) % 3 == 0).long()
    node_mask = torch.arange(n_nodes, device=device) < lengths[:, None]
    weight, bias = draw(1, dim, scale=dim ** -0.5), draw(1, scale=0.1)
    scale, shift = 1.0 + draw(1, scale=0.1), draw(1, scale=0.1)
    return nodes, node_mask, weight, bias, scale, shift
