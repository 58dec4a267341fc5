"""The word nodes of an eval scoring block, `l2norm(W_loc (a_j / |a_j| - t_j)^2 + b)` (Eq. 1-2)
for every (image, caption, word), by the faster of two routes on this device.

At a block of 256 images x 1,024 captions of 13 words, the context vectors `a_j / |a_j| - t_j`
are 3.4 million rows of 1,024 values: 7 GB in bf16, written by one matmul, squared in place and
read by `W_loc`. On an H100 those crossings of memory were a third of an SGR block's time.

- `eager`: PyTorch's operations: the context matmul with the words as its (negated) addend, the
  square in place, `W_loc` (`sgraf.kernels.cpu.fast_linear`), and the l2 norm.
- `fused`: one Triton kernel per block. Each program takes one image and a tile of its (caption,
  word) rows: it computes the contexts 32 or 64 features at a time, squares them on chip and adds
  their product with `W_loc`'s columns to the tile's accumulator, then adds the bias, normalises
  and writes the nodes. The context rows never reach memory. The kernel rounds where the eager
  route rounds (the difference and its square to the nodes' dtype), so the two agree to the
  accumulation order.

`measure_word_route(device, dtype, dim, width)` times the eager route and the kernel with each
of `TILES` once per device, dtype and sizes on a block-shaped probe (`sgraf.kernels.tuning`;
`SGRAF.tune_eval` calls it before a large split on a CUDA device with Triton) and keeps `eager`,
the default, unless a tile is more than 20 % faster; the tile is stored with the choice
('fused 64x32x8x2'). A tile that fails to build there is timed as never finishing. `word_route`
then returns the stored choice without measuring. `SGRAF_WORD_ROUTE=eager|fused` forces one.
Elsewhere (the CPU, a compiled graph, `plan.emulate_gpu`, no Triton) the route is `eager`. The
reasoning steps' kernel chooses its route the same way (`sgraf.kernels.fused_routes`).

The global nodes `l2norm(W_glo (g_i - h_c)^2 + b)` of every (image, caption) pair are the same
chain with the attention left out (`global_nodes`): they take the word nodes' route, the fused
one running this kernel with the images' global vectors in place of the contexts (the
difference in float32, as the eager route takes it), and the probe times the two together.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from sgraf.kernels.cpu import fast_linear
from sgraf.kernels.fused_routes import FP_FUSION, ROUTES, FusedRoutes, dtype_key, fusable
from sgraf.kernels.norms import EPS, inverse_norm


# the probe: (images, captions, words) of a scoring block's middle length bucket
PROBE_BLOCK = (64, 256, 13)
# the fused kernel's tiles (rows of (caption, word) per program, features per step, warps,
# pipeline stages): those that compile for sm_90 in bf16 without spilling registers (`ptxas -v`
# on Triton 3.6's output; 128 rows spill). The first is "fused"'s; the probe times each as a
# route of its own ("fused 64x32x8x2"), so the tile chosen is stored with the route, and a later
# process compiles that one tile and times nothing
TILES = ((64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2))
ROUTE = FusedRoutes("SGRAF_WORD_ROUTE", "word-node", TILES)
MEASURED = ROUTE.measured
# float32's: without 64x64x8x3, whose three stages of float32 tiles need more shared memory than an
# H100/H200 gives a block (232,448 bytes): Triton 3.9 for sm_90 asked 294,912 under TF32 and
# 229,376 exact; the probe would time it as failed, storing an infinite time
FLOAT32_ROUTE = FusedRoutes("SGRAF_WORD_ROUTE", "word-node", tuple(tile for tile in TILES if tile != (64, 64, 8, 3)))


def _route(dtype: torch.dtype) -> FusedRoutes:
    return FLOAT32_ROUTE if dtype == torch.float32 else ROUTE


def word_route(device: torch.device | str, dtype: torch.dtype, dim: int, width: int) -> str:
    """'eager' or a fused route ('fused', or 'fused RxFxWxS' with its tile) for `word_nodes` on
    `device` in `dtype`, `dim` features in and `width` out: `SGRAF_WORD_ROUTE` if set, else the
    choice `measure_word_route` stored for this device, else the default. Never measures (it is
    asked inside the scoring loop)."""
    return _route(dtype).peek(_name(dtype, dim, width), device, fusable(device))


def measure_word_route(device: torch.device | str, dtype: torch.dtype, dim: int, width: int) -> str:
    """`word_route`, measured on this device if it has not been (a scorer calls this before
    scoring a large split)."""
    device = torch.device(device)

    def runner(route: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        inputs = probe(device, dtype, dim, width)
        # global vectors for the probe block's images and captions (the shape of its output)
        generator = torch.Generator(device).manual_seed(1)
        img_glo, cap_glo = (torch.randn(n, dim, generator=generator, device=device) * 0.05
                            for n in inputs[5].shape[:2])

        def run() -> tuple[torch.Tensor, torch.Tensor]:   # the word and global nodes: fused routes run both
            word_nodes(*inputs, route=route)
            return inputs[5], global_nodes(img_glo, cap_glo, inputs[3], inputs[4], route)

        return run

    return _route(dtype).choose(_name(dtype, dim, width), device, fusable(device), True, runner, dtype)


def word_nodes(attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor, out: torch.Tensor, route: str) -> None:
    """Write `l2norm((attn^T R_i - T)^2 W^T + b)` of every image into `out`.

    Args:
        attn: (n_img, K, n_cap * L) float32 attention of each word over the K regions, each
            column already scaled by `1 / (|a_j| + eps)`.
        regions: (n_img, K, d) and words: (n_cap * L, d), contiguous, in the nodes' dtype `low`.
        weight: (m, d) and bias: (m,) of `W_loc`, in `low`.
        out: (n_img, n_cap, L, m) in `low`, any strides with the last dim contiguous (the word
            nodes' slice of a block's node tensor).
        route: `word_route`'s answer: 'eager', 'fused' (the first of `TILES`) or 'fused RxFxWxS'.
    """
    if route != ROUTES[0]:
        _fused(attn, regions, words, weight, bias, out, ROUTE.tile(route))
        return
    n_img, n_cap, n_words, _ = out.shape
    dim = regions.size(2)
    # a_j / |a_j| - t_j from one matmul with the words as its (negated) addend
    diff = torch.baddbmm(words.view(1, n_cap * n_words, dim), attn.to(regions.dtype).transpose(1, 2), regions, beta=-1)
    square = diff.view(n_img, n_cap, n_words, dim).square_()              # (a_j / |a_j| - t_j)^2
    local = fast_linear(square.view(-1, dim), weight, bias).view(n_img, n_cap, n_words, -1)
    # the norm in the nodes' dtype (accumulated in float32), so no float32 copy of the block
    inverse = inverse_norm(local, dtype=None)
    if torch.compiler.is_compiling():   # the same product; a compiled graph takes no `out=` view
        out.copy_(local * inverse)
    else:
        torch.mul(local, inverse, out=out)


def global_nodes(img_glo: torch.Tensor, cap_glo: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 route: str) -> torch.Tensor:
    """The global nodes `l2norm((g_i - h_c)^2 W^T + b)` of every (image, caption) pair (Eq. 1).

    Args:
        img_glo, cap_glo: (n_img, d) and (n_cap, d) float32 global vectors.
        weight: (m, d) and bias: (m,) of `W_glo`, in the nodes' dtype `low`.
        route: `word_route`'s answer: the fused routes run the word nodes' kernel with the
            attention left out (the difference in float32, as here).

    Returns:
        (n_img, n_cap, m) in `low`.
    """
    low = weight.dtype
    if route != ROUTES[0]:
        out = torch.empty(img_glo.size(0), cap_glo.size(0), 1, weight.size(0), device=weight.device, dtype=low)
        _fused(None, img_glo.float().contiguous(), cap_glo.float().contiguous(), weight, bias, out, ROUTE.tile(route))
        return out.squeeze(2)
    diff = img_glo.unsqueeze(1) - cap_glo.unsqueeze(0)                        # (n_img, n_cap, d)
    square = torch.mul(diff, diff, out=diff if low == diff.dtype else torch.empty_like(diff, dtype=low))
    sim_glo = fast_linear(square, weight, bias)
    return sim_glo.mul_(inverse_norm(sim_glo, dtype=None))


def _fused(attn: torch.Tensor | None, regions: torch.Tensor, words: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor, out: torch.Tensor, tile: tuple[int, ...]) -> None:
    """The kernel over `out` (n_img, n_cap, L, m); without `attn`, the global nodes: `regions`
    the images' global vectors (n_img, d), `words` the captions' (n_cap, d), L = 1."""
    glob = attn is None
    n_img, n_cap, n_words, width = out.shape
    n_regions, n_rows = (1, n_cap) if glob else attn.shape[1:]
    dim = regions.size(-1)
    if out.stride(3) != 1 or not (glob or attn.is_contiguous()) or not (regions.is_contiguous()
                                                                         and words.is_contiguous()):
        raise ValueError("word_nodes(route='fused') takes contiguous inputs and an output whose last dim is contiguous")
    import triton

    rows, features, warps, stages = tile
    exact = weight.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    _kernel()[(n_img, triton.cdiv(n_rows, rows))](
        regions if glob else attn, regions, words, weight.contiguous(), bias.contiguous(), out, n_regions, n_rows,
        n_words, *out.stride()[:3], DIM=dim, REGIONS=max(16, triton.next_power_of_2(n_regions)), WIDTH=width,
        WIDTH_TILE=max(16, triton.next_power_of_2(width)), ROWS=rows, FEATURES=features, EPSILON=EPS,
        PRECISION="ieee" if exact else "tf32", GLOBAL=glob,
        # the interpreter (CPU tests) multiplies bf16 tiles wrongly: there, in float32
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps, num_stages=stages,
        enable_fp_fusion=FP_FUSION)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined at its first use (Triton is imported only then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def word_nodes_kernel(attn, regions, words, weight, bias, out,
                          n_regions, n_rows, n_words, stride_img, stride_cap, stride_word,
                          DIM: tl.constexpr, REGIONS: tl.constexpr, WIDTH: tl.constexpr, WIDTH_TILE: tl.constexpr,
                          ROWS: tl.constexpr,
                          FEATURES: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                          EPSILON: tl.constexpr, GLOBAL: tl.constexpr):
        image = tl.program_id(0).to(tl.int64)          # 64-bit offsets: a block's nodes pass 2**31 values
        rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        ks = tl.arange(0, REGIONS)
        k_ok = ks < n_regions
        outs = tl.arange(0, WIDTH_TILE)
        o_ok = outs < WIDTH
        low = out.dtype.element_ty
        if not GLOBAL:
            # the tile's attention (ROWS, REGIONS), rounded to the nodes' dtype as the eager matmul reads it
            a = tl.load(attn + image * n_regions * n_rows + ks[None, :] * n_rows + rows[:, None],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(low)
            if WIDEN:
                a = a.to(tl.float32)
        acc = tl.zeros((ROWS, WIDTH_TILE), dtype=tl.float32)
        for start in range(0, DIM, FEATURES):
            feats = start + tl.arange(0, FEATURES)
            f_ok = feats < DIM
            t = tl.load(words + rows[:, None] * DIM + feats[None, :], mask=row_ok[:, None] & f_ok[None, :], other=0.0)
            if GLOBAL:   # the image's global vector against the captions', in float32 as the eager route
                g = tl.load(regions + image * DIM + feats, mask=f_ok, other=0.0).to(tl.float32)
                diff = g[None, :] - t.to(tl.float32)
            else:
                r = tl.load(regions + image * n_regions * DIM + ks[:, None] * DIM + feats[None, :],
                            mask=k_ok[:, None] & f_ok[None, :], other=0.0)
                if WIDEN:
                    r = r.to(tl.float32)
                context = tl.dot(a, r, input_precision=PRECISION, out_dtype=tl.float32)
                diff = (context - t.to(tl.float32)).to(low).to(tl.float32)      # rounded as the eager matmul's output
            square = (diff * diff).to(low)
            w = tl.load(weight + outs[None, :] * DIM + feats[:, None], mask=f_ok[:, None] & o_ok[None, :],
                        other=0.0)                                                   # (FEATURES, WIDTH_TILE)
            if WIDEN:
                square = square.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(square, w, input_precision=PRECISION, out_dtype=tl.float32)
        acc += tl.load(bias + outs, mask=o_ok, other=0.0).to(tl.float32)[None, :]   # 0 past WIDTH
        local = acc.to(low).to(tl.float32)                                     # W_loc's output, rounded
        inverse = (1.0 / (tl.sqrt(tl.sum(local * local, axis=1)) + EPSILON)).to(low).to(tl.float32)
        caps, positions = rows // n_words, rows % n_words
        place = image * stride_img + caps * stride_cap + positions * stride_word
        tl.store(out + place[:, None] + outs[None, :], (local * inverse[:, None]).to(low),
                 mask=row_ok[:, None] & o_ok[None, :])

    return word_nodes_kernel


def _name(dtype: torch.dtype, dim: int, width: int) -> str:
    return f"word nodes route|{dtype_key(dtype)}|d={dim}|m={width}"


def probe(device: torch.device, dtype: torch.dtype, dim: int, width: int, seed: int = 0,
          block: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """A set of `word_nodes` inputs drawn on `device`, shaped like a scoring block of `block`
    (images, captions, words; default `PROBE_BLOCK` on a GPU, a small one elsewhere): (attn,
    regions, words, weight, bias, out), `out` the word slice of a node tensor with a global node
    in front, unwritten."""
    n_img, n_cap, n_words = block or (PROBE_BLOCK if device.type == "cuda" else (4, 8, 5))
    n_regions = 36
    generator = torch.Generator(device).manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale

    attn = draw(n_img, n_regions, n_cap * n_words).softmax(dim=1) * 0.3
    regions = draw(n_img, n_regions, dim).to(dtype)
    words = (draw(n_cap * n_words, dim) * 0.05).to(dtype)
    weight = draw(width, dim, scale=dim ** -0.5).to(dtype)
    bias = draw(width, scale=0.01).to(dtype)
    nodes = torch.empty(n_img, n_cap, n_words + 1, width, device=device, dtype=dtype)
    return attn, regions, words, weight, bias, nodes[:, :, 1:]
