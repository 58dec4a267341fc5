"""The eval fast path's chunks: how a block of images x captions is cut, and each piece scored.

The math of a chunk is the model's (`SimilarityEncoder.fast_forward`, then `fast_head_scores`,
through `chunk_scores`); this module decides only how much of the block runs at once:

- on the CPU, chunks of at most a byte budget of (image, caption, word) x d operands in the
  matmul dtype, so that their intermediates are reused while hot (cache-sized chunks score a pair
  about 1.7x faster than 128 MiB blocks). The best budget depends on the processor and the
  precision: `choose_budget` times `EVAL_CHUNK_CANDIDATES` once per machine, model size and
  precision (`sgraf.kernels.tuning`); `EVAL_CHUNK_DEFAULT` stays unless another size is clearly
  faster (on a 2-core AMD EPYC Zen 5, 4-16 MiB score within 5 % of each other: it stays), and
  among near-equal faster ones the smallest wins (less memory). An int in `EVAL_CHUNK_BYTES`
  fixes it;
- under compiled scoring (`sgraf.kernels.compiled`), every CPU chunk padded to one grid for a
  caption width (`compiled_chunk_shape`), so that a width compiles one graph; under the GPU plan
  the block's counts rounded up to powers of two;
- under the GPU plan, the block is one chunk.

`SGRAF._eval_similarity_heads` prepares a block (global nodes, Gram matrices, casts) and calls
`score_chunks`. The similarity encoder is an argument (nothing here imports `sgraf.model`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from sgraf.kernels import compiled, plan, tuning

EVAL_CHUNK_CANDIDATES = (4 * 2**20, 8 * 2**20, 16 * 2**20, 32 * 2**20)   # most frugal first
EVAL_CHUNK_DEFAULT = 8 * 2**20
EVAL_CHUNK_BYTES: int | None = None
# images per CPU chunk (a chunk of few captions takes more images instead, but not when compiled)
EVAL_CHUNK_IMAGES = 8


def chunk_budget(low: torch.dtype, size_key: str, measured: int | None = None) -> int:
    """The CPU chunk budget in bytes for matmuls in `low`: `EVAL_CHUNK_BYTES` if set, else
    `measured` (a scorer's own measurement) if given, else the choice stored for this machine
    and model size (`size_key`), or the default."""
    if EVAL_CHUNK_BYTES is not None:
        return EVAL_CHUNK_BYTES
    if measured is not None:
        return measured
    return tuning.peek(_budget_name(low, size_key), EVAL_CHUNK_CANDIDATES, default=EVAL_CHUNK_DEFAULT)


def choose_budget(low: torch.dtype, size_key: str, measure: Callable[[int], float], label: str = "") -> int:
    """Time the candidate budgets once (`measure(budget)`: seconds per probe block) and store the
    choice for this machine, model size and, with `label`, the caller's way of scoring."""
    name = _budget_name(low, size_key) + (f"|{label}" if label else "")
    return tuning.choose(name, EVAL_CHUNK_CANDIDATES, measure, default=EVAL_CHUNK_DEFAULT)


def _budget_name(low: torch.dtype, size_key: str) -> str:
    return f"eval chunk bytes|{low}|{size_key}"


def chunk_pairs(budget: int, n_words: int, embed_size: int, low: torch.dtype) -> int:
    """(image, caption) pairs of caption width `n_words` whose (word x d) operands in `low` fit
    `budget` bytes: the size of a CPU eval chunk."""
    return max(1, budget // (n_words * embed_size * low.itemsize))


def compiled_chunk_shape(budget: int, n_words: int, embed_size: int, low: torch.dtype) -> tuple[int, int]:
    """(images, captions) of every CPU eval chunk of caption width `n_words` under compiled
    scoring: `EVAL_CHUNK_IMAGES` x as many captions as `budget` allows, at most
    `compiled.MAX_CHUNK_CAPTIONS`."""
    pairs = chunk_pairs(budget, n_words, embed_size, low)
    return EVAL_CHUNK_IMAGES, min(max(1, pairs // EVAL_CHUNK_IMAGES), compiled.MAX_CHUNK_CAPTIONS)


def chunk_grid(n_img: int, n_cap: int, n_words: int, embed_size: int, low: torch.dtype, device: torch.device,
               budget: int) -> Iterator[tuple[slice, slice]]:
    """(image rows, caption columns) of a block's chunks (see the module's docstring): one chunk
    under the GPU plan; on the CPU at most `budget` bytes of operands each, or under compiled
    scoring the fixed grid of `compiled_chunk_shape` (the last chunks are padded to it)."""
    if plan.gpu_plan(device):
        yield slice(0, n_img), slice(0, n_cap)
        return
    if compiled.eval_enabled():
        img_step, cap_step = compiled_chunk_shape(budget, n_words, embed_size, low)
    else:
        pairs = chunk_pairs(budget, n_words, embed_size, low)
        img_step = min(n_img, EVAL_CHUNK_IMAGES)
        cap_step = max(1, pairs // img_step)
        if cap_step >= n_cap:  # few captions: take more images instead
            cap_step = n_cap
            img_step = min(n_img, max(img_step, pairs // n_cap))
    for row in range(0, n_img, img_step):
        for col in range(0, n_cap, cap_step):
            yield slice(row, min(row + img_step, n_img)), slice(col, min(col + cap_step, n_cap))


def score_chunks(sim: Any, heads: tuple[str, ...], regions: torch.Tensor, words: torch.Tensor,
                 word_mask: torch.Tensor, lengths: torch.Tensor, glo_nodes: torch.Tensor | None,
                 gram: torch.Tensor | None, constants: dict[str, Any], budget: int,
                 centres: torch.Tensor | None = None, directions: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
    """Scores {head: float32 (n_img, n_cap)} of a prepared block, chunk by chunk.

    Args:
        sim: the model's similarity encoder (`fast_forward`, `fast_head_scores`).
        regions: (n_img, K, d) and `words` (n_cap, L, d) in the matmul dtype (autocast off).
        lengths: (n_cap,) caption lengths, best on the CPU (a chunk is padded to its own longest
            caption: read on the host without waiting for a device).
        glo_nodes: (n_img, n_cap, m) global nodes of the block, or None.
        gram: (n_img, K, K) Gram matrices of the regions, or None.
        constants: the model's weight-only constants in the matmul dtype ('layers', 'folded').
        budget: the CPU chunk budget (`chunk_budget`).
        centres: (n_img, K, 2) a place model's region centres; `directions` (n_cap, L, 2) its
            words' directions.
    """
    low, device = words.dtype, words.device
    n_img, n_cap = regions.size(0), words.size(0)
    scores = {head: torch.empty((n_img, n_cap), dtype=torch.float32, device=device) for head in heads}
    compile_chunks = compiled.eval_enabled()   # read once for the block
    if compile_chunks:
        # fixed shapes for the compiler: the width rounded up, every chunk padded to the grid
        width = compiled.bucket_width(words.size(1))
        words, word_mask = compiled.pad_to(words, width, 1), compiled.pad_to(word_mask, width, 1)
        if directions is not None:
            directions = compiled.pad_to(directions, width, 1)
    score = compiled.compiled(chunk_scores) if compile_chunks else chunk_scores
    embed_size = regions.size(2)
    for rows, cols in chunk_grid(n_img, n_cap, words.size(1), embed_size, low, device, budget):
        if compile_chunks:
            chunk = _compiled_chunk(score, sim, heads, rows, cols, regions, words, word_mask, glo_nodes, gram,
                                    constants, budget, centres, directions)
        else:
            n_words = int(lengths[cols].max())   # a chunk is padded to its own longest caption
            chunk = score(sim, regions[rows], words[cols, :n_words], word_mask[cols, :n_words], low,
                          None if glo_nodes is None else glo_nodes[rows, cols],
                          None if gram is None else gram[rows], constants["layers"], constants["folded"], heads,
                          None if centres is None else centres[rows],
                          None if directions is None else directions[cols, :n_words])
        for head, block in chunk.items():
            scores[head][rows, cols] = block
    return scores


def chunk_scores(sim: Any, regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                 low: torch.dtype, glo_nodes: torch.Tensor | None, gram: torch.Tensor | None,
                 layers: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 folded: list[tuple[torch.Tensor, ...]] | None, heads: tuple[str, ...],
                 centres: torch.Tensor | None = None, directions: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
    """Scores {head: float32 (n_img, n_cap)} of one eval chunk: the nodes (`fast_forward`) and the
    heads (`fast_head_scores`); for a place model (`centres` and the words' `directions`) with the
    place term of the places the chunk's attention reads. A function of its arguments only,
    weights included, so that `sgraf.kernels.compiled` compiles it once per shape for every model
    and set of weights."""
    nodes, node_mask, places = sim.fast_forward(regions, words, word_mask, low, glo_nodes, gram, layers, centres)
    offset = None if places is None else sim.place_term.term(places, directions)
    return sim.fast_head_scores(nodes, node_mask, heads, low, folded, offset)


def _compiled_chunk(score: Callable[..., dict[str, torch.Tensor]], sim: Any, heads: tuple[str, ...], rows: slice,
                    cols: slice, regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                    glo_nodes: torch.Tensor | None, gram: torch.Tensor | None, constants: dict[str, Any],
                    budget: int, centres: torch.Tensor | None, directions: torch.Tensor | None
                    ) -> dict[str, torch.Tensor]:
    """One eval chunk through the compiled `chunk_scores`, padded to a fixed shape: the CPU's
    chunk grid, or under the GPU plan the block's counts rounded up to powers of two. Padded
    images and captions are zeros (their scores are dropped)."""
    pad = compiled.pad_to
    low = words.dtype
    n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
    if plan.gpu_plan(words.device):
        img_size, cap_size = compiled.padded_count(n_rows), compiled.padded_count(n_cols)
    else:
        img_size, cap_size = compiled_chunk_shape(budget, words.size(1), regions.size(2), low)
    chunk = score(
        sim, pad(regions[rows], img_size), pad(words[cols], cap_size), pad(word_mask[cols], cap_size), low,
        None if glo_nodes is None else pad(pad(glo_nodes[rows, cols], img_size), cap_size, 1),
        None if gram is None else pad(gram[rows], img_size), constants["layers"], constants["folded"],
        heads, None if centres is None else pad(centres[rows], img_size),
        None if directions is None else pad(directions[cols], cap_size))
    return {head: block[:n_rows, :n_cols] for head, block in chunk.items()}
