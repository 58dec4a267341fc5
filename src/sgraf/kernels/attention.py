"""The text-to-image attention of an eval scoring block (SCAN's, Eq. 3-4): for every word of
every caption, its weights over the regions of every image, by the faster of two routes on this
device.

`relevance` is one matmul's output: every region against every word of the block, (n_img, K,
n_cap x L). From it, per column (a caption's word), the attention is
`softmax_k(lambda * r / ||r||_words)` with `r = LeakyReLU_0.1(relevance)` and the norm taken over
the caption's words for each region; each column is then scaled by `1 / (|a_j| + eps)`, the norm
of its attended context `a_j = attn_j^T R` read from the image's Gram matrix `R R^T`, so that the
word nodes' kernel (`sgraf.kernels.words`) gets normalised contexts from its matmul.

- `eager`: PyTorch's operations, in place where they can be. At a block of 256 images x 1,024
  captions of 13 words the attention is 490 MB in float32, and these operations cross it about
  16 times: 7.5 GB, a quarter of an SGR bf16 block's memory traffic once the word nodes and the
  reasoning steps run in their kernels (`benchmarks/launch_counts.py --traffic`).
- `fused`: one Triton kernel. Each program takes one image and a tile of captions: it loads their
  relevance once, and computes the leaky ReLU, the norms over each caption's words, the softmax
  over the regions, the Gram products and the scaling on chip, in float32, then writes the
  attention once.

`measure_attention_route(device, dtype)` times the eager route and the kernel with each of
`TILES` once per device and dtype on a block-shaped probe (`sgraf.kernels.fused_routes`, like
the other kernels; `SGRAF.tune_eval` calls it before a large split on a CUDA device with Triton)
and keeps `eager` unless a tile is more than 20 % faster. `attention_route` returns the stored
choice without measuring. `SGRAF_ATTENTION_ROUTE=eager|fused` forces one. Elsewhere (the CPU, a
compiled graph, `plan.emulate_gpu`, no Triton), for captions of more than `MAX_WORDS` words and
where the caller reads the attention before its scaling (a place model), the route is `eager`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sgraf.kernels.fused_routes import FP_FUSION, ROUTES, FusedRoutes, dtype_key, fusable
from sgraf.kernels.norms import EPS, inverse_norm

MAX_WORDS = 128                      # a caption's words in one tile, at most (longer captions: eager)
# the probe: (images, captions, words) of a scoring block's middle length bucket
PROBE_BLOCK = (64, 256, 13)
# the kernel's tiles: (columns, i.e. (caption, word) pairs per program, warps, pipeline stages);
# a tile holds as many captions as fit its columns, each padded to a power of two of words (one
# caption when it is wider). The first is "fused"'s; the probe times each as a route of its own
TILES = ((128, 8, 1), (64, 4, 1), (64, 8, 1), (32, 4, 1))
ROUTE = FusedRoutes("SGRAF_ATTENTION_ROUTE", "attention", TILES)
MEASURED = ROUTE.measured


def attention_route(device: torch.device | str, dtype: torch.dtype) -> str:
    """'eager' or a fused route ('fused' or 'fused CxWxS') for `scaled_attention` on `device`
    for relevance in `dtype`: `SGRAF_ATTENTION_ROUTE` if set, else the choice
    `measure_attention_route` stored for this device, else the default. Never measures."""
    return ROUTE.peek(_name(dtype), device, fusable(device))


def measure_attention_route(device: torch.device | str, dtype: torch.dtype) -> str:
    """`attention_route`, measured on this device if it has not been (a scorer calls this
    before scoring a large split)."""
    device = torch.device(device)

    def runner(route: str) -> Callable[[], Any]:
        relevance, gram, n_words = probe(device, dtype)
        return lambda: scaled_attention(relevance.clone(), gram, n_words, 9.0, route)

    return ROUTE.choose(_name(dtype), device, fusable(device), True, runner, dtype)


def _name(dtype: torch.dtype) -> str:
    return f"attention route|{dtype_key(dtype)}"


def applies(route: str, n_words: int) -> bool:
    """Whether `route` runs the kernel for captions `n_words` wide (else the eager route)."""
    return route != ROUTES[0] and n_words <= MAX_WORDS


def scaled_attention(relevance: torch.Tensor, gram: torch.Tensor, n_words: int, smooth: float, route: str,
                     read: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Every word's attention over the regions, each column scaled by `1 / (|a_j| + eps)`.

    Args:
        relevance: (n_img, K, n_cap * n_words) regions against words, in the nodes' dtype,
            contiguous; consumed (the eager route works in it when it is float32).
        gram: (n_img, K, K) float32 Gram matrices of the regions.
        n_words: the block's caption width L.
        smooth: the softmax temperature lambda.
        route: `attention_route`'s answer.
        read: called as `read(logits, attn)` with the softmax's float32 input and output before
            the scaling (a place model reads its places there); the eager route then runs.

    Returns:
        (n_img, K, n_cap * n_words) float32.
    """
    if read is None and applies(route, n_words):
        return _fused(relevance, gram, n_words, smooth, ROUTE.tile(route))
    n_img, n_regions, n_rows = relevance.shape
    logits = F.leaky_relu_(relevance.float(), 0.1).view(n_img, n_regions, n_rows // n_words, n_words)
    # lambda / (||r||_words + eps), over each caption's words
    logits = logits.mul_(inverse_norm(logits).mul_(smooth)).view(n_img, n_regions, n_rows)
    # the softmax over the regions where they lie: every (caption, word) column side by side in
    # memory, no transposed copy
    attn = logits.softmax(dim=1)
    if read is not None:
        read(logits, attn)
    # |a_j|^2 = attn_j (R R^T) attn_j^T from each image's (K, K) Gram matrix, in float32
    square = torch.bmm(gram, attn).mul_(attn).sum(dim=1, keepdim=True)     # (n_img, 1, n_rows)
    return attn.mul_(square.clamp_(min=0).sqrt_().add_(EPS).reciprocal_())


def _fused(relevance: torch.Tensor, gram: torch.Tensor, n_words: int, smooth: float,
           tile: tuple[int, ...]) -> torch.Tensor:
    import triton

    columns, warps, stages = tile
    n_img, n_regions, n_rows = relevance.shape
    relevance, gram = relevance.contiguous(), gram.float().contiguous()     # (as they come: no copy)
    words = max(2, triton.next_power_of_2(n_words))
    captions = max(1, columns // words)
    n_cap = n_rows // n_words
    out = torch.empty(n_img, n_regions, n_rows, device=relevance.device, dtype=torch.float32)
    _kernel()[(n_img, triton.cdiv(n_cap, captions))](
        relevance, gram, out, n_cap, n_words, n_rows, float(smooth), n_regions=n_regions,
        REGIONS=max(16, triton.next_power_of_2(n_regions)), WORDS=words, CAPTIONS=captions,
        EPSILON=EPS, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
    return out


def _kernel() -> Any:
    """The Triton kernel (its module imported at the first use)."""
    from sgraf.kernels.triton_attention import attention_kernel

    return attention_kernel


def probe(device: torch.device, dtype: torch.dtype, seed: int = 0,
          block: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`scaled_attention` inputs drawn on `device`, shaped like a scoring block (`block`:
    images, captions, words; default `PROBE_BLOCK` on a GPU, a small one elsewhere): (relevance,
    gram, n_words), the relevance of unit region and word vectors, a third of it negative."""
    n_img, n_cap, n_words = block or (PROBE_BLOCK if device.type == "cuda" else (3, 5, 6))
    n_regions, dim = 36, 32
    generator = torch.Generator(device).manual_seed(seed)
    regions = F.normalize(torch.randn(n_img, n_regions, dim, generator=generator, device=device), dim=-1)
    words = F.normalize(torch.randn(n_cap * n_words, dim, generator=generator, device=device), dim=-1)
    relevance = (regions @ words.t()).to(dtype).contiguous()
    gram = regions @ regions.transpose(1, 2)
    return relevance, gram, n_words
