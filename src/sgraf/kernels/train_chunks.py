"""Training's chunks: a batch's captions scored a chunk at a time, and a step's selected pairs.

The math is the model's whatever the cut (`SimilarityEncoder.train_nodes` and
`train_head_scores`); this module decides how much of it runs at once and what is kept for
backward:

- `caption_chunks`: the captions sorted by length, so that a chunk is padded only to its own
  longest caption, and cut by a memory budget (`chunk_bytes`: bytes on the CPU; under the GPU plan
  a number of (image, word) pairs within a share of the free memory);
- `block_scores`: the train-mode score matrix chunk by chunk, the intermediates of the first
  chunks kept for backward up to `keep_bytes` and the later ones recomputed (activation
  checkpointing); SAF's per-caption BatchNorm statistics applied once, in caption order; the
  regions' Gram matrices and their relevance to every chunk's words (`_relevances`) formed once;
- `pair_scores`: a step's selected pairs (`sgraf.training.pairs`) scored again with autograd, in
  groups of similar caption length on the CPU, padded to fixed shapes when compiled.

`SGRAF` calls them; the similarity encoder is an argument (nothing here imports `sgraf.model`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

from sgraf.errors import InputError
from sgraf.kernels import compiled, plan

# Auto chunk size for train-mode scoring: captions per chunk such that one chunk's
# (n_img, n_cap, L, d) float32 block is about this many bytes (its other intermediates are
# a few times that).
TRAIN_CHUNK_BYTES = 64 * 2**20
# On a GPU a chunk holds up to this many (image, word) pairs: at the paper's embed size of 1,024
# its float32 block is 576 MiB. A chunk is padded to its own longest caption, so one chunk for a
# whole batch pads every caption to the batch's longest (a Flickr30K-like batch of 128: 5,632 word
# slots for 1,733 words; in 3 chunks, 2,966). Measured on an H200 (benchmarks/gpu_profile.py
# --sweep, benchmarks/results/gpu-h200-*-a53a8d5.txt), SGR fp32 at batch 128 trains in 0.068 s
# and 3.7 GiB in 3 such chunks, against 0.125 s and 9.5 GiB in one (1/32 of the free memory).
# Counting pairs rather than bytes cuts a batch the same way at any feature size (so the CPU's
# emulated plan counts the device's launches).
TRAIN_GPU_CHUNK_PAIRS = 147_456
# ... and never more than this share of the device's free memory (a small or busy GPU).
TRAIN_GPU_MEMORY_SHARE = 1 / 32
# With light nodes (see `block_scores`), the heads' intermediates of the first chunks are kept
# for backward up to about this many bytes; the later chunks' are recomputed.
TRAIN_KEEP_BYTES = 1024 * 2**20
# On a GPU the heads' intermediates are kept up to this share of the free memory instead: a
# recomputed chunk costs its forward again (on the H200, keeping all three chunks of a batch of
# 128 took SGR fp32 from 0.082 s to 0.068 s for 0.9 GiB more; a quarter of an 80 GB card's
# memory keeps every chunk of a paper-size batch).
TRAIN_GPU_KEEP_SHARE = 1 / 4
# Float32 (G, P, m)-sized intermediates the SGR/SAF heads keep for backward, per node (an
# estimate from the layers of `train_graph_reasoning`; it sets where recomputing starts).
HEAD_KEPT_PER_NODE = 8
# Float32 (n_img, n_cap, L, d)-sized intermediates a chunk without light nodes (bf16, i2t, scalar
# similarities) keeps for backward when it is not recomputed (an estimate, as above).
CHUNK_KEPT_PER_WORD = 4
# A training step's selected pairs are scored again in this many groups of similar caption
# length on the CPU: at the paper's batch, 4 groups cut their padded words from about 3.3x their
# words to 1.5x.
PAIR_GROUPS = 4


def chunk_bytes(device: torch.device, embed_size: int) -> int:
    """Bytes of one train-mode chunk's (images x captions x words x d) float32 block on `device`:
    under the GPU plan (`sgraf.kernels.plan`) `TRAIN_GPU_CHUNK_PAIRS` (image, word) pairs, at most
    `TRAIN_GPU_MEMORY_SHARE` of its free memory; else `TRAIN_CHUNK_BYTES`."""
    if not plan.gpu_plan(device):
        return TRAIN_CHUNK_BYTES
    block_bytes = TRAIN_GPU_CHUNK_PAIRS * 4 * embed_size     # float32 (pairs, d)
    return max(1, min(block_bytes, int(plan.free_memory(device) * TRAIN_GPU_MEMORY_SHARE)))


def keep_bytes(device: torch.device) -> int:
    """Bytes of the heads' intermediates kept for backward before chunks are recomputed:
    `TRAIN_GPU_KEEP_SHARE` of the free memory under the GPU plan, else `TRAIN_KEEP_BYTES`."""
    if not plan.gpu_plan(device):
        return TRAIN_KEEP_BYTES
    return int(plan.free_memory(device) * TRAIN_GPU_KEEP_SHARE)


def caption_chunks(lengths: torch.Tensor, n_img: int, embed_size: int, device: torch.device,
                   captions_per_chunk: int | None = None) -> list[torch.Tensor]:
    """Caption indices of each train-mode chunk: captions sorted by length, so that a chunk is
    padded only to its own longest caption, then cut by `captions_per_chunk` or by the budget
    of `chunk_bytes(device, embed_size)` for `n_img` images."""
    sorted_lengths, order = torch.sort(lengths.cpu(), stable=True)
    sorted_lengths = sorted_lengths.tolist()
    if captions_per_chunk is not None:
        if not isinstance(captions_per_chunk, int) or captions_per_chunk < 1:
            raise InputError(f"train_chunk must be a positive number of captions, got {captions_per_chunk!r}")
        return list(torch.split(order, captions_per_chunk))
    budget_words = max(1, chunk_bytes(device, embed_size) // (4 * n_img * embed_size))
    chunks, start = [], 0
    for end in range(1, len(order) + 1):
        # sorted ascending: the chunk [start, end) is padded to sorted_lengths[end - 1]
        if end - start > 1 and (end - start) * sorted_lengths[end - 1] > budget_words:
            chunks.append(order[start:end - 1])
            start = end - 1
    chunks.append(order[start:])
    if len(chunks) == 1:   # one chunk: keep the given order (sorting would only reorder sums);
        return [order.sort().values]   # 0..n-1, made from the host lengths like the other chunks
    return chunks


def block_scores(sim: Any, heads: tuple[str, ...], chunks: list[torch.Tensor], recompute: bool,
                 img_embs: torch.Tensor, img_glo: torch.Tensor | None, words: torch.Tensor,
                 word_mask: torch.Tensor, cap_glo: torch.Tensor | None, host_lengths: torch.Tensor,
                 centres: torch.Tensor | None, directions: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Train-mode scores {head: (n_img, n_cap)} of a batch's embeddings, the captions in `chunks`.

    The per-pair part of training, which draws no random numbers and advances no BatchNorm but
    SAF's (whose running statistics it applies once, in caption order): the global vectors and
    a place model's words' `directions` come computed once for the batch.

    Args:
        sim: the model's similarity encoder (`train_nodes`, `train_head_scores`, ...).
        chunks: `caption_chunks` of the batch.
        recompute: whether chunks may be recomputed in backward (activation checkpointing).
        host_lengths: (n_cap,) caption lengths on the CPU (they cut the chunks' widths).
    """
    # With light nodes (`local_nodes` keeps no word x feature tensor), only the heads can need
    # recomputing: their intermediates are kept for the first chunks, up to `keep_bytes`, and
    # recomputed in backward for the rest. Otherwise every chunk is recomputed whole, except, under
    # the GPU plan, the first chunks whose word x feature intermediates fit that budget too (a
    # recomputed chunk launches its forward kernels twice).

    def head_scores(nodes, node_mask, chunk_offset):
        scores, saf_stats = sim.train_head_scores(nodes, node_mask, heads, chunk_offset)
        return [scores[head] for head in heads], saf_stats

    def place_offset(places, chunk_directions):
        return None if places is None else sim.place_term.term(places, chunk_directions)

    def chunk_scores(regions, img_glo, chunk_words, chunk_mask, chunk_glo, chunk_centres, chunk_directions, gram,
                     relevance):
        nodes, node_mask, places = sim.train_nodes(regions, chunk_words, chunk_mask, img_glo, chunk_glo,
                                                   chunk_centres, gram=gram, relevance=relevance)
        return head_scores(nodes, node_mask, place_offset(places, chunk_directions))

    light = sim.light_train_nodes(words)
    kept_bytes, budget = 0, keep_bytes(words.device)
    keep_whole = plan.gpu_plan(words.device)

    columns: dict[str, list[torch.Tensor]] = {head: [] for head in heads}
    means, variances = [], []
    # the regions' Gram matrices (the contexts' norms, `train_nodes`) once for every chunk:
    # one matmul forward and back instead of one per chunk
    gram = (img_embs @ img_embs.transpose(1, 2)
            if sim.use_local and sim.supports_fast() and len(chunks) > 1 else None)
    order = torch.cat(chunks).to(words.device, non_blocking=True)   # a host tensor: no wait for the device
    # the captions' tensors with autograd gathered once in chunk order and split: in backward one
    # concatenation and one scatter, where a gather per chunk scattered each chunk's gradient into
    # a whole zero tensor and added it to the others' (three passes over the words per chunk)
    sizes = [len(index) for index in chunks]
    word_parts, mask_parts = words[order].split(sizes), word_mask[order].split(sizes)
    glo_parts = None if cap_glo is None else cap_glo[order].split(sizes)
    direction_parts = None if directions is None else directions[order].split(sizes)
    widths = [int(host_lengths[index].max()) for index in chunks]
    cut_words = [part[:, :n_words].contiguous() for part, n_words in zip(word_parts, widths)]
    # every chunk's `regions @ words^T` in one matmul, where the Gram matrices are shared too
    relevances = _relevances(img_embs, cut_words) if gram is not None else [None] * len(chunks)
    for part, index in enumerate(chunks):
        n_words, chunk_words = widths[part], cut_words[part]
        chunk_mask = mask_parts[part][:, :n_words]
        chunk_glo = None if glo_parts is None else glo_parts[part]
        chunk_directions = None if direction_parts is None else direction_parts[part][:, :n_words]
        args = (img_embs, img_glo, chunk_words, chunk_mask, chunk_glo, centres, chunk_directions, gram,
                relevances[part])
        if recompute and light:
            nodes, node_mask, places = sim.train_nodes(img_embs, chunk_words, chunk_mask, img_glo, chunk_glo,
                                                       centres, gram=gram, relevance=relevances[part])
            chunk_offset = place_offset(places, chunk_directions)
            kept_bytes += nodes.numel() * nodes.element_size() * HEAD_KEPT_PER_NODE  # nodes: (n_img, n, P, m)
            if kept_bytes <= budget:
                blocks, saf_stats = head_scores(nodes, node_mask, chunk_offset)
            else:
                blocks, saf_stats = torch.utils.checkpoint.checkpoint(head_scores, nodes, node_mask, chunk_offset,
                                                                      use_reentrant=False)
        elif recompute:
            # (n_img, n, L, d) float32-sized intermediates kept for backward (an estimate)
            kept_bytes += img_embs.size(0) * chunk_words.numel() * 4 * CHUNK_KEPT_PER_WORD
            if keep_whole and kept_bytes <= budget:
                blocks, saf_stats = chunk_scores(*args)
            else:
                blocks, saf_stats = torch.utils.checkpoint.checkpoint(chunk_scores, *args, use_reentrant=False)
        else:
            blocks, saf_stats = chunk_scores(*args)
        for head, block in zip(heads, blocks):
            columns[head].append(block)                                       # (n_img, chunk)
        if saf_stats is not None:
            means.append(saf_stats[0])
            variances.append(saf_stats[1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    if means:
        sim.SAF_module.update_running_stats(torch.cat(means)[inverse], torch.cat(variances)[inverse])
    return {head: torch.cat(cols, dim=1)[:, inverse] for head, cols in columns.items()}


def _relevances(regions: torch.Tensor, chunk_words: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's `regions @ words^T`, (n_img, K, n_cap * L), from one matmul over the words of
    every chunk: in backward one matmul gives the regions' gradient of them all, where one per
    chunk gave one gradient each, added into the regions' one at a time."""
    dim = regions.shape[-1]
    flat = torch.cat([words.reshape(-1, dim) for words in chunk_words])
    return list((regions @ flat.t()).split([words.shape[0] * words.shape[1] for words in chunk_words], dim=2))


def pair_scores(sim: Any, heads: tuple[str, ...], regions: torch.Tensor, img_glo: torch.Tensor | None,
                words: torch.Tensor, word_mask: torch.Tensor, cap_glo: torch.Tensor | None,
                centres: torch.Tensor | None, directions: torch.Tensor | None, host_lengths: torch.Tensor | None,
                rows: torch.Tensor, cols: torch.Tensor, bound: int) -> dict[str, torch.Tensor]:
    """Train-mode scores {head: (P,)} of the aligned pairs (image rows[p], caption cols[p]), with
    autograd, from a batch's embeddings (`SGRAF.train_scores`).

    Off the GPU plan, with the lengths on the CPU, the pairs are scored in `PAIR_GROUPS` groups of
    similar caption length, each padded to its own longest caption (a batch's longest caption is
    about three times its mean); under the GPU plan in one group as wide as the batch (the pairs'
    lengths would be a read from the device).

    Compiled (`sgraf.kernels.compiled.train_enabled`), the pairs are padded with pair (0, 0) to
    `bound`, the hardest-negative loss's bound on the pairs it reads (`sgraf.model.loss.max_pairs`,
    fixed for a batch size; their scores are dropped), and each group's width is rounded up
    (`bucket_width`): fixed shapes, so a run compiles a handful of graphs."""
    compile_pairs = compiled.train_enabled()
    n_pairs = rows.numel()
    if compile_pairs:
        # the loss's bound, a multiple of the groups' number (groups of one size: one graph per width)
        size = -(-max(n_pairs, bound) // PAIR_GROUPS) * PAIR_GROUPS
        rows, cols = compiled.pad_to(rows, size), compiled.pad_to(cols, size)
    group_scores = compiled.compiled(_pair_group_scores) if compile_pairs else _pair_group_scores

    def group(rows: torch.Tensor, cols: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        def cut(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if not compile_pairs:
                return tensor[:, :width]
            return compiled.pad_to(tensor[:, :width], compiled.bucket_width(width), 1)
        return group_scores(sim, heads, regions, img_glo, cut(words), cut(word_mask), cap_glo,
                            centres, cut(directions), rows, cols)

    if host_lengths is None or plan.gpu_plan(words.device) or n_pairs < 2:
        scores = group(rows, cols, words.size(1))
        return {head: block[:n_pairs] for head, block in scores.items()}
    sorted_lengths, order = torch.sort(host_lengths[cols.cpu()], stable=True)
    n_groups = min(PAIR_GROUPS, len(order))
    parts = []
    for part, part_lengths in zip(order.tensor_split(n_groups), sorted_lengths.tensor_split(n_groups)):
        # the group's longest caption (sorted ascending)
        parts.append(group(rows[part], cols[part], int(part_lengths[-1])))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    inverse = inverse[:n_pairs].to(words.device)
    return {head: torch.cat([part[head] for part in parts])[inverse] for head in heads}


def _pair_group_scores(sim: Any, heads: tuple[str, ...], regions: torch.Tensor,
                       img_glo: torch.Tensor | None, words: torch.Tensor, word_mask: torch.Tensor,
                       cap_glo: torch.Tensor | None, centres: torch.Tensor | None, directions: torch.Tensor | None,
                       rows: torch.Tensor, cols: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train-mode scores {head: (P,)} of the aligned pairs (image rows[p], caption cols[p]), with
    autograd, padded to the words' width (`pair_scores`). A function of its arguments only,
    weights included, so that `sgraf.kernels.compiled` compiles it once per shape for any model
    and set of weights."""
    def take(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if tensor is None else gather_rows(tensor, index)

    nodes, node_mask, places = sim.train_nodes(
        take(regions, rows), take(words, cols), word_mask[cols], take(img_glo, rows), take(cap_glo, cols),
        take(centres, rows), aligned=True)
    offset = None if places is None else sim.place_term.term(places, take(directions, cols))
    scores, _ = sim.train_head_scores(nodes, node_mask, heads, offset)        # {head: (1, P)}
    return {head: block.view(-1) for head, block in scores.items()}


def gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[index]` along the first dimension, an index that repeats rows (the pairs' images
    and captions). On the CPU plan by `index_select`, whose gradient `index_add_` sums the
    repeated rows in a fixed order: the gradient of `tensor[index]` (`index_put_` accumulating)
    sums them in whatever order its threads reach them, so two runs of the same step on two
    threads gave gradients apart by rounding (29 of 30 backward passes of one gather differed
    from the first). Under the GPU plan as `tensor[index]` (CUDA's `index_put_` sorts its
    indices; `index_add_` would add them atomically, in no fixed order)."""
    return tensor[index] if plan.gpu_plan(tensor.device) else tensor.index_select(0, index)
