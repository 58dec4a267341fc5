"""The word nodes of a training chunk, Eq. 1 before its l2 norm, `W (A R - T)^2 + b`, as autograd
functions that keep no (image x caption x word x feature) tensor for backward.

`sgraf.model.similarity.local_nodes` holds the equation as plain autograd (what the tests hold
these to) and takes `light_nodes` wherever it applies: float32 outside autocast (`_LocalNodes`),
and bf16 or fp16 autocast (`_LowPrecisionLocalNodes`, autograd's values and gradients bit for
bit). Autograd would keep the contexts `A R` and their squared differences, two (n_img, n_cap,
L, d) tensors per chunk; these keep the attention (K wide instead of d) and recompute the
contexts in backward with one K-deep matmul, so a chunk's nodes are computed once instead of
recomputed (`sgraf.model.similarity.SimilarityRepresentation.light_train_nodes`). The CPU plan
runs float32's whole pipeline, matmuls included, image tile by image tile, and the low-precision
elementwise passes tile by tile (`plan.cache_tiles`) or fused (`compiled.elementwise`, where
`compiled.fuses_word_nodes` says so); the GPU plan whole.
"""

from __future__ import annotations

from typing import Any

import torch

from sgraf import torch_compat
from sgraf.kernels import compiled, plan
from sgraf.kernels.cpu import weight_gradient


def light_dtype(device_type: str, *tensors: torch.Tensor) -> torch.dtype | None:
    """The dtype in which `light_nodes` computes the nodes of these tensors (the attention, or the
    words, first), or None where it does not (the model's autograd then): float32 outside
    autocast where the first tensor is float32; under bf16 or fp16 autocast that dtype where
    every tensor is float32 or it."""
    if not torch_compat.autocast_enabled(device_type):
        return torch.float32 if tensors[0].dtype == torch.float32 else None
    low = torch_compat.autocast_dtype(device_type)
    if low not in (torch.bfloat16, torch.float16):
        return None
    return low if all(t.dtype in (torch.float32, low) for t in tensors) else None


def light_nodes(attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor | None:
    """`W (A R - T)^2 + b` (the word nodes before their l2 norm) by `_LocalNodes` or
    `_LowPrecisionLocalNodes`, or None where neither applies (`light_dtype`).

    Args:
        attn: (n_img, n_cap, L, K) attention rows already divided by their context's norm.
        regions: (n_img, K, d); words: (n_cap, L, d) shared by every image, or (n_img, 1, L, d)
            with one caption per image (aligned pairs); weight: (m, d); bias: (m,).

    Returns:
        (n_img, n_cap, L, m), with autograd, or None.
    """
    dtype = light_dtype(attn.device.type, attn, regions, words, weight, bias)
    if dtype is None:
        return None
    if dtype == torch.float32:
        return _LocalNodes.apply(attn, regions, words, weight, bias)
    return _LowPrecisionLocalNodes.apply(attn, regions, words, weight, bias, dtype)


class _LocalNodes(torch.autograd.Function):
    """Eq. 1 for the word nodes before their l2 norm, `W (A R - T)^2 + b`, keeping no (word x
    feature) tensor.

    `A` holds each word's normalised attention over the regions, so `A R` is the normalised
    context `a_j / |a_j|`. Autograd would keep the contexts and their squared differences for
    backward, two (n_img, n_cap, L, d) tensors; this keeps only the attention (K wide instead of
    d) and recomputes the contexts in backward with one K-deep matmul. The l2 norm after it is
    the model's `l2norm` (`sgraf.model.similarity.local_nodes`), whose backward takes 6 passes
    over the nodes where autograd's order of operations took 10.

    Forward and backward run image tile by image tile (`plan.FLOAT32_TILE_BYTES` of differences
    per tile; the whole chunk under the GPU plan): each tile's contexts, differences, squares and
    their gradient pass from one matmul to the next while they are in the cache, in two reused
    tile-sized buffers. The weight's and the words' gradients are summed over the tiles.
    """

    @staticmethod
    def forward(ctx: Any, attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        tiles = _float32_tiles(attn, regions)
        (buffer,) = _tile_buffers(attn, regions, tiles, 1)
        dim = regions.shape[-1]
        out = attn.new_empty(*attn.shape[:3], weight.shape[0])                  # (n_img, n_cap, L, m)
        for tile in tiles:
            square = _differences(attn, regions, words, tile, buffer).square_().view(-1, dim)
            torch.addmm(bias, square, weight.t(), out=out[tile].view(-1, weight.shape[0]))
        ctx.save_for_backward(attn, regions, words, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        attn, regions, words, weight = ctx.saved_tensors
        n_img, n_cap, n_words, n_regions = attn.shape
        dim, needs = regions.shape[-1], ctx.needs_input_grad
        tiles = _float32_tiles(attn, regions)
        differences, products = _tile_buffers(attn, regions, tiles, 2)
        # d(diff^2) = 2 diff d(square), d(square) = grad_out W: the doubling on the (m, d) weight,
        # not on the (word x feature) tensor
        doubled = weight.mul(2)
        flat_attn = attn.reshape(n_img, n_cap * n_words, n_regions)
        grad_attn = torch.empty_like(flat_attn) if needs[0] else None
        grad_regions = torch.empty_like(regions) if needs[1] else None
        grad_words = torch.zeros_like(words) if needs[2] else None
        grad_weight = None
        for tile in tiles:
            n = tile.stop - tile.start
            diff = _differences(attn, regions, words, tile, differences)        # (n, n_cap, L, d)
            rows = grad_out[tile].reshape(-1, grad_out.shape[-1])               # (n * n_cap * L, m)
            product = products[:n].view(-1, dim)
            if needs[3]:
                square = torch.mul(diff, diff, out=product.view(diff.shape)).view(-1, dim)
                tile_weight = weight_gradient(rows, square)
                grad_weight = tile_weight if grad_weight is None else grad_weight.add_(tile_weight)
            grad_diff = diff.mul_(torch.mm(rows, doubled, out=product).view(diff.shape)).view(n, -1, dim)
            if needs[0]:
                torch.bmm(grad_diff, regions[tile].transpose(1, 2), out=grad_attn[tile])
            if needs[1]:
                torch.bmm(flat_attn[tile].transpose(1, 2), grad_diff, out=grad_regions[tile])
            if needs[2]:   # summed over the images that share the words
                tile_diff = grad_diff.view(n, n_cap, n_words, dim)
                if words.dim() == 4:       # one caption per image (aligned pairs)
                    torch.neg(tile_diff, out=grad_words[tile])
                else:
                    grad_words.sub_(tile_diff.sum(dim=0))
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0) if needs[4] else None
        return (None if grad_attn is None else grad_attn.view(attn.shape), grad_regions, grad_words,
                grad_weight, grad_bias)


def _float32_tiles(attn: torch.Tensor, regions: torch.Tensor) -> list[slice]:
    """`plan.cache_tiles` over the images of a float32 chunk, `plan.FLOAT32_TILE_BYTES` of its
    (n_cap, L, d) differences per tile."""
    n_img, n_cap, n_words, _ = attn.shape
    return plan.cache_tiles(n_img, n_cap * n_words * regions.shape[-1] * 4, attn.device,
                            plan.FLOAT32_TILE_BYTES)


def _tile_buffers(attn: torch.Tensor, regions: torch.Tensor, tiles: list[slice], count: int) -> torch.Tensor:
    """`count` buffers for a tile's (images, n_cap * L, d) differences, as large as the first
    (largest) tile."""
    n_img, n_cap, n_words, _ = attn.shape
    return attn.new_empty(count, tiles[0].stop - tiles[0].start, n_cap * n_words, regions.shape[-1])


def _differences(attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor, tile: slice,
                 buffer: torch.Tensor) -> torch.Tensor:
    """`A R - T` of the images in `tile`, written into `buffer`: (n, n_cap, L, d)."""
    n_img, n_cap, n_words, n_regions = attn.shape
    n = tile.stop - tile.start
    contexts = torch.bmm(attn[tile].reshape(n, n_cap * n_words, n_regions), regions[tile], out=buffer[:n])
    return contexts.view(n, n_cap, n_words, -1).sub_(_tile_words(words, tile))


class _LowPrecisionLocalNodes(torch.autograd.Function):
    """`W (A R - T)^2 + b` (the word nodes before their l2 norm) under autocast, keeping no
    (word x feature) tensor: `_LocalNodes` for bf16 and fp16 training.

    The same operations in the same dtypes as autograd through autocast (the K-deep matmul and
    the linear layer in the low precision, the squared difference in the promoted dtype, float32
    beside float32 words), so the same values and gradients bit for bit
    (`tests/test_train_low_precision_nodes.py`); autograd would keep the squared difference and
    the difference itself for backward (two (n_img, n_cap, L, d) tensors, float32), which this
    recomputes from the attention instead. On a CPU with bf16 matmuls that makes a bf16 chunk
    light as a float32 one is (`sgraf.model.similarity.SimilarityRepresentation.light_train_nodes`):
    computed once, its heads kept, instead of computed twice. The difference, its square and its gradient are computed
    image tile by image tile (`plan.cache_tiles`), in float32 only inside a tile; only the
    words' gradient, summed over the images, takes a whole float32 (word x feature) tensor.
    """

    @staticmethod
    def forward(ctx: Any, attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor, low: torch.dtype) -> torch.Tensor:
        ctx.low = low
        # backward follows the forward's setting; float32 words only: with low-precision words
        # eager rounds each intermediate to `low`, where Inductor's fused loop would not
        n_img, n_cap, n_words, _ = attn.shape
        ctx.fused = words.dtype == torch.float32 and compiled.fuses_word_nodes(
            n_img * n_cap * n_words * regions.shape[-1], not plan.gpu_plan(attn.device))
        with torch.autocast(attn.device.type, enabled=False):
            context = _low_contexts(attn, regions, low)
            if ctx.fused or torch.compiler.is_compiling():
                square = _elementwise(_squares)(context, words)
            else:
                square = _low_squares(context, words)                         # (n_img, n_cap, L, d)
            del context
            out = torch.addmm(bias.to(low), square.view(-1, square.shape[-1]), weight.to(low).t())
        ctx.save_for_backward(attn, regions, words, weight, bias)
        return out.view(*square.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        attn, regions, words, weight, bias = ctx.saved_tensors
        low = ctx.low
        context = _low_contexts(attn, regions, low)                              # recomputed
        rows = grad.reshape(-1, grad.shape[-1]).to(low)                         # (n, m)
        # d(diff^2) = 2 diff d(square): doublings are exact, so 2 (grad W) diff rounds as autograd's
        # grad W diff + grad W diff, and grad (2 W) is 2 (grad W) bit for bit (every product and
        # partial sum doubled; outside the subnormal range, around 1e-38, where the two may round
        # apart): the doubling on the small weight, not on the (word x feature) tensor
        grad_square = rows.mm(weight.to(low).mul(2)).view(context.shape)        # (n_img, n_cap, L, d), doubled
        if ctx.fused or torch.compiler.is_compiling():
            square, flat, grad_diff = _elementwise(_square_and_gradient)(context, words, grad_square)
            return _low_backward(ctx, attn, regions, words, bias, rows, square, flat, grad_diff)
        promoted = torch.promote_types(low, words.dtype)
        square = torch.empty_like(context) if ctx.needs_input_grad[3] else None
        tiles = _image_tiles(context)
        # the words' gradient sums the difference's gradient over the images as autograd does,
        # in one reduction over the whole tensor (tile by tile would round differently)
        grad_diff = (context.new_empty(context.shape, dtype=promoted)
                     if ctx.needs_input_grad[2] and len(tiles) > 1 else None)
        flat = context      # the context's gradient, written over each tile's contexts once read
        for tile in tiles:
            difference = torch.sub(context[tile], _tile_words(words, tile))   # in the promoted dtype
            if square is not None:
                square[tile] = difference * difference
            difference.mul_(grad_square[tile])
            flat[tile] = difference
            if ctx.needs_input_grad[2]:
                if grad_diff is None:
                    grad_diff = difference                                       # one tile: the whole
                else:
                    grad_diff[tile] = difference
        del grad_square
        return _low_backward(ctx, attn, regions, words, bias, rows, square, flat, grad_diff)


def _low_backward(ctx: Any, attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor, bias: torch.Tensor,
                  rows: torch.Tensor, square: torch.Tensor | None, flat: torch.Tensor,
                  grad_diff: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """`_LowPrecisionLocalNodes.backward` after its elementwise passes: the matmuls of the
    weight's, the attention's and the regions' gradients, and the words' sum over the images."""
    n_img, n_cap, n_words, n_regions = attn.shape
    low = ctx.low
    grad_weight = grad_bias = None
    if square is not None and ctx.needs_input_grad[3]:   # autograd's addmm backward: (grad^T square)
        grad_weight = rows.t().mm(square.view(-1, square.shape[-1]))
    del square
    if ctx.needs_input_grad[4]:
        grad_bias = rows.sum_to_size(bias.shape)
    flat = flat.view(n_img, n_cap * n_words, -1)
    grad_attn = grad_regions = grad_words = None
    if ctx.needs_input_grad[0]:
        grad_attn = torch.bmm(flat, regions.to(low).transpose(1, 2)).view(attn.shape)
    if ctx.needs_input_grad[1]:
        grad_regions = torch.bmm(attn.to(low).reshape(n_img, n_cap * n_words, n_regions).transpose(1, 2), flat)
    if grad_diff is not None and ctx.needs_input_grad[2]:   # summed over the images that share the words
        grad_words = grad_diff.sum_to_size(words.shape).neg_()
    return grad_attn, grad_regions, grad_words, grad_weight, grad_bias, None


def _elementwise(function: Any) -> Any:
    """`function` compiled by `compiled.elementwise` (each chain of the low-precision nodes'
    elementwise passes one fused loop; `compiled.fuses_word_nodes` says when), or as it is inside
    a graph being compiled (the compiled selected pairs: Inductor fuses it there, and tiles would
    only unroll). Its inputs are detached (the passes run inside an autograd Function): Dynamo
    guards on `requires_grad`, and the words come with it and without, which compiled each
    function twice, the second time in the middle of a run."""
    if torch.compiler.is_compiling():
        return function
    fused = compiled.elementwise(function)
    return lambda *tensors: fused(*(tensor.detach() for tensor in tensors))


def _squares(context: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`(A R - T)^2` in the context's dtype, the difference and its square in the promoted one
    (`_low_squares` in one expression, for `compiled.elementwise`)."""
    difference = context - words
    return (difference * difference).to(context.dtype)


def _square_and_gradient(context: torch.Tensor, words: torch.Tensor, grad_square: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The square (in the context's dtype), the difference's gradient `2 (grad W) diff` in the
    context's dtype (for the matmuls) and in the promoted one (for the words' sum), as the eager
    tile loop of `_LowPrecisionLocalNodes.backward` computes them (`grad_square` doubled already)."""
    difference = context - words
    gradient = difference * grad_square
    return (difference * difference).to(context.dtype), gradient.to(context.dtype), gradient


def _contexts(attn: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """(n_img, n_cap, L, K) attention, (n_img, K, d) regions -> the contexts `A R`, (n_img, n_cap, L, d)."""
    n_img, n_cap, n_words, n_regions = attn.shape
    return torch.bmm(attn.reshape(n_img, n_cap * n_words, n_regions), regions).view(n_img, n_cap, n_words, -1)


def _low_contexts(attn: torch.Tensor, regions: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """`A R` as autograd computes it under autocast: the matmul in `low`."""
    return _contexts(attn.to(low), regions.to(low))


def _image_tiles(tensor: torch.Tensor) -> list[slice]:
    """`plan.cache_tiles` over the images of an (n_img, n_cap, L, d) tensor, sized in float32 (the
    dtype of the low-precision nodes' differences)."""
    return plan.cache_tiles(tensor.shape[0], tensor[0].numel() * 4, tensor.device)


def _tile_words(words: torch.Tensor, tile: slice) -> torch.Tensor:
    """The words of an image tile: (n_cap, L, d) words shared by every image, or the tile's rows of
    (n_img, 1, L, d) words, one caption per image."""
    return words if words.dim() == 3 else words[tile]


def _low_squares(context: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`(A R - T)^2` in the context's (low) dtype, from low-precision contexts: the difference and
    its square in the promoted dtype, as autograd under autocast, tile by tile."""
    square = torch.empty_like(context)
    for tile in _image_tiles(context):
        difference = torch.sub(context[tile], _tile_words(words, tile))        # in the promoted dtype
        square[tile] = difference.mul_(difference)
    return square
