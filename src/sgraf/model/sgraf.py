"""The SGRAF network: encoders, similarity representations and the SGR / SAF / AVE heads.

Sub-module names (`img_enc`, `txt_enc`, `sim_enc` and their children) follow the authors'
three state dicts, so an official checkpoint maps onto this module by key prefix alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sgraf.config import ModelConfig
from sgraf.errors import InputError, check_positive_int
from sgraf.kernels import (attention, compiled, edges, eval_chunks, filtration, graph_steps, plan, train_chunks,
                           tuning)
from sgraf.kernels import words as words_kernels
from sgraf.kernels.cpu import fast_linear
from sgraf.model import blocks
from sgraf.model.encoders import ImageEncoder, TextEncoder
from sgraf.model.filtration import AttentionFiltration, average_scores
from sgraf.model.loss import max_pairs
from sgraf.model.positions import PlaceTerm, check_normalised_boxes
from sgraf.model.reasoning import GraphReasoning, graph_reasoning, train_graph_reasoning
from sgraf.model.similarity import SimilarityRepresentation, compute_dtype, region_attention
from sgraf.precision import current_precision

logger = logging.getLogger(__name__)

HEADS = ("sgr", "saf")

# The probe's block: images x captions of this many tokens (about Flickr30K's mean length).
EVAL_PROBE_BLOCK = (16, 64, 16)


class SimilarityEncoder(SimilarityRepresentation):
    """Similarity nodes (Eq. 1-5) followed by the configured aggregation head(s) and score FC."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.embed_size, config.sim_dim, config.num_regions, alignments=config.alignments,
                         similarity=config.similarity, attention=config.attention,
                         smooth=config.lambda_softmax, dropout=config.dropout,
                         place_sharpness=config.place_sharpness)
        self.module = config.module
        node_dim = self.node_dim
        if config.module in ("sgr", "joint"):
            self.SGR_module = nn.ModuleList(GraphReasoning(node_dim) for _ in range(config.sgr_step))
        if config.module in ("saf", "joint"):
            self.SAF_module = AttentionFiltration(node_dim)
        if config.similarity == "vector":
            self.sim_eval_w = nn.Linear(node_dim, 1)       # the SGR/SAF/AVE score FC (authors' name)
        if config.module == "joint":
            self.saf_eval_w = nn.Linear(node_dim, 1)       # the SAF head's own score FC
        if config.positions == "place":
            self.place_term = PlaceTerm(config.embed_size, penalty=config.place_penalty)

    def place_offset(self, regions: torch.Tensor, centres: torch.Tensor, words: torch.Tensor,
                     word_mask: torch.Tensor) -> torch.Tensor:
        """The place term (n_img, n_cap) of a place model, from the t2i attention of Eq. 3 in
        float32 (the eval fast path takes it from its own attention instead)."""
        attn = region_attention(regions.float(), words.float(), self.place_smooth)
        return self.place_term(attn, centres, words, word_mask)                # attn: (n_img, n_cap, L, K)

    def head_scores(self, nodes: torch.Tensor, node_mask: torch.Tensor, heads: Sequence[str],
                    offset: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Scores (n_img, n_cap) of each requested head from (n_img, n_cap, P, m) nodes; `offset`
        (n_img, n_cap), the place term, is added to each head's logit before the sigmoid."""
        scores = {}
        for head in heads:
            if head == "ave":
                scores[head] = average_scores(nodes, node_mask, getattr(self, "sim_eval_w", None))
            elif head == "sgr":
                pooled = graph_reasoning(self.SGR_module, nodes, node_mask, has_global=self.use_global,
                                         fast=not self.training)
                scores[head] = _score(self.sim_eval_w(pooled).squeeze(2), offset)
            else:
                pooled = self.SAF_module(nodes, node_mask)
                layer = self.saf_eval_w if self.module == "joint" else self.sim_eval_w
                scores[head] = _score(layer(pooled).squeeze(2), offset)
        return scores

    def train_head_scores(self, nodes: torch.Tensor, node_mask: torch.Tensor, heads: Sequence[str],
                          offset: torch.Tensor | None = None
                          ) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """Train-mode `head_scores` as a pure function (safe to recompute in backward).

        Returns:
            scores {head: (n_img, n_cap)}, and SAF's per-caption BatchNorm (means, unbiased
            variances) for `AttentionFiltration.update_running_stats`, or None without SAF.
        """
        scores, saf_stats = {}, None
        for head in heads:
            if head == "ave":
                scores[head] = average_scores(nodes, node_mask, getattr(self, "sim_eval_w", None))
            elif head == "sgr":
                pooled = train_graph_reasoning(self.SGR_module, nodes, node_mask, has_global=self.use_global)
                scores[head] = _score(self.sim_eval_w(pooled).squeeze(2), offset)
            else:
                pooled, means, variances = self.SAF_module.train_filter(nodes, node_mask)
                saf_stats = (means, variances)
                layer = self.saf_eval_w if self.module == "joint" else self.sim_eval_w
                scores[head] = _score(layer(pooled).squeeze(2), offset)
        return scores, saf_stats

    def fast_head_scores(self, nodes: torch.Tensor, node_mask: torch.Tensor, heads: Sequence[str],
                         low: torch.dtype, folded: list[tuple[torch.Tensor, ...]] | None = None,
                         offset: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Eval-only `head_scores` (autocast off, no autograd): nodes in `low` -> float32 scores.

        SGR's node-wise matmuls run in `low`; SAF, AVE, the score FC and the sigmoid in float32.
        `folded` is `graph_steps.fold_steps(self.SGR_module, low)` when the caller has it (else folded here).
        """
        scores = {}
        for head in heads:
            if head == "ave":
                scores[head] = average_scores(nodes.float(), node_mask, getattr(self, "sim_eval_w", None))
                continue
            if head == "sgr":
                if folded is None:
                    folded = graph_steps.fold_steps(self.SGR_module, low)
                pooled = graph_steps.fast_graph_reasoning(folded, nodes.to(low), node_mask, self.use_global)
                layer = self.sim_eval_w
            else:
                saf = self.SAF_module
                bn = saf.bn
                # eval BatchNorm folded into the filter: beta = sigmoid(scale * (W_f s + b_f) + shift)
                scale = (bn.running_var + bn.eps).rsqrt() * (bn.weight if bn.affine else 1.0)
                shift = (bn.bias if bn.affine else 0.0) - bn.running_mean * scale
                route = filtration.filter_route(nodes.device, nodes.dtype, nodes.size(3))
                pooled = filtration.filtered(nodes, node_mask, saf.attn_sim_w.weight, saf.attn_sim_w.bias,
                                             scale.float(), shift.float(), route)
                layer = self.saf_eval_w if self.module == "joint" and head == "saf" else self.sim_eval_w
            scores[head] = _score(fast_linear(pooled, layer.weight, layer.bias).squeeze(2), offset)
        return scores


def _score(logits: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """sigmoid(logits [+ offset]): a head's score from its FC's (n_img, n_cap) output."""
    return torch.sigmoid(logits if offset is None else logits + offset)


def init_weights(model: nn.Module) -> None:
    """The authors' initialisation, in one place.

    Linear: uniform(-r, r) with r = sqrt(6 / (in + out)) (Xavier-uniform), bias 0; BatchNorm:
    weight 1, bias 0; word embedding uniform(-0.1, 0.1); GRU: PyTorch's default.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm1d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.uniform_(module.weight, -0.1, 0.1)


class SGRAF(nn.Module):
    """Similarity Graph Reasoning and Attention Filtration (Diao et al., AAAI 2021).

    Attributes:
        config: the `ModelConfig` it was built from.
        vocab: the vocabulary (set by the checkpoint loader) or None.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab: Any = None
        self.img_enc = ImageEncoder(config.img_dim, config.embed_size, config.img_norm, config.positions)
        self.txt_enc = TextEncoder(config.vocab_size, config.word_dim, config.embed_size, config.num_layers,
                                   config.bi_gru, config.txt_norm, config.dropout)
        self.sim_enc = SimilarityEncoder(config)
        # train-mode scoring: captions per chunk (None: from the device's memory budget) and whether
        # chunks' intermediates may be recomputed in backward instead of kept (activation
        # checkpointing; with light nodes only beyond a budget: `sgraf.kernels.train_chunks`)
        self.train_chunk: int | None = None
        self.train_checkpoint = True
        # the self-attention global vectors (n_img, d), (n_cap, d) of the last train-mode scoring
        self.train_global_vectors: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        # the eval fast path's weight-only constants by matmul dtype while `frozen_weights` is active
        self._eval_constants: dict[torch.dtype, dict[str, Any]] | None = None
        # the chunk budget under measurement while `tune_eval` runs
        self._probe_chunk_bytes: int | None = None
        init_weights(self)
        if self.has_places:
            self.sim_enc.place_term.reset_parameters()

    @property
    def has_places(self) -> bool:
        """Whether image embeddings carry each region's centre in their last two channels and the
        similarity stage adds the place term (`ModelConfig.positions` 'place')."""
        return self.config.positions == "place"

    def split_places(self, img_embs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoded images -> (region embeddings (n_img, K, d), centres (n_img, K, 2) or None).

        A place model's region embeddings are copied out contiguous: as a view with a row stride
        of d + 2 its matmuls took other kernels than the box model's on some processors (AVX-512
        ones), so a new place model, whose term is zero, scored 1 ulp off the same box model."""
        if not self.has_places:
            return img_embs, None
        return img_embs[..., :-2].contiguous(), img_embs[..., -2:]

    @property
    def needs_boxes(self) -> bool:
        """Whether the image encoder reads each region's box (`ModelConfig.positions` not 'none')."""
        return self.config.positions != "none"

    @property
    def heads(self) -> tuple[str, ...]:
        """Score heads: ('sgr', 'saf') for a joint model, else the one module."""
        return HEADS if self.config.module == "joint" else (self.config.module,)

    # ------------------------------------------------------------------ inputs
    def validate_inputs(self, images: torch.Tensor, captions: torch.Tensor, lengths: Any) -> torch.Tensor:
        """Check a batch before any work; raise `InputError` (a ValueError) naming the problem.

        Returns:
            the lengths as an int64 tensor on the captions' device.
        """
        cfg = self.config
        if not isinstance(images, torch.Tensor) or not images.is_floating_point() or images.dim() != 3:
            raise InputError(f"images must be a float tensor (n_img, K={cfg.num_regions}, img_dim={cfg.img_dim}), "
                             f"got {_describe(images)}")
        if images.size(1) != cfg.num_regions:
            raise InputError(f"images have {images.size(1)} regions per image, the model expects "
                             f"K={cfg.num_regions} (shape {tuple(images.shape)})")
        if images.size(2) != cfg.img_dim:
            raise InputError(f"image feature dimension is {images.size(2)}, the model expects "
                             f"img_dim={cfg.img_dim} (shape {tuple(images.shape)})")
        if images.size(0) == 0:
            raise InputError("images is empty (0 images)")
        if not bool(torch.isfinite(images).all()):
            bad = (~torch.isfinite(images)).flatten(1).any(dim=1).nonzero().flatten()[:5].tolist()
            raise InputError(f"image features contain NaN or inf (images {bad})")
        if not isinstance(captions, torch.Tensor) or captions.dim() != 2 or captions.is_floating_point() \
                or captions.dtype == torch.bool or captions.is_complex():
            raise InputError(f"captions must be an integer tensor (n_cap, L) of token ids, got {_describe(captions)}")
        if captions.size(0) == 0:
            raise InputError("captions is empty (0 captions)")
        lengths = _as_lengths(lengths, captions.device)
        if lengths.numel() != captions.size(0):
            raise InputError(f"lengths has {lengths.numel()} entries but there are {captions.size(0)} captions")
        if bool((lengths < 1).any()):
            index = int((lengths < 1).nonzero()[0])
            raise InputError(f"caption lengths must be positive; caption {index} has length {int(lengths[index])}")
        if bool((lengths > captions.size(1)).any()):
            index = int((lengths > captions.size(1)).nonzero()[0])
            raise InputError(f"caption {index} has length {int(lengths[index])}, longer than the padded "
                             f"captions tensor (L={captions.size(1)})")
        positions = torch.arange(captions.size(1), device=captions.device)
        used = captions[:, : int(lengths.max())][positions[: int(lengths.max())] < lengths.unsqueeze(1)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cfg.vocab_size):
            bad = int(used.max()) if int(used.max()) >= cfg.vocab_size else int(used.min())
            raise InputError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        return lengths

    # ------------------------------------------------------------------ encoders
    def encode_images(self, images: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """(n_img, K, img_dim) region features -> (n_img, K, d) region embeddings.

        `boxes`: (n_img, K, 4) x1, y1, x2, y2 normalised to [0, 1], on the images' device; read
        only by a model with positions (`needs_boxes`), which raises ValueError without them.
        Only the type and shape are checked here (`validate_inputs` checks a whole batch).
        """
        if not isinstance(images, torch.Tensor) or images.dim() != 3 or images.size(-1) != self.config.img_dim:
            raise InputError(f"images must be a float tensor (n_img, K, img_dim={self.config.img_dim}), "
                             f"got {_describe(images)}")
        if not self.needs_boxes:
            return self.img_enc(images)
        return self.img_enc(images, self.check_boxes(images, boxes))

    def check_boxes(self, images: torch.Tensor, boxes: Any) -> torch.Tensor:
        """The boxes of `images` for a model with positions; `InputError` (a ValueError) naming
        the problem when they are missing, of the wrong shape or not finite."""
        if boxes is None:
            raise InputError(f"this model (positions={self.config.positions!r}) needs each region's box "
                             "(n_img, K, 4), normalised to [0, 1]; got none")
        if not isinstance(boxes, torch.Tensor) or not boxes.is_floating_point() \
                or tuple(boxes.shape) != (*images.shape[:2], 4):
            raise InputError(f"boxes must be a float tensor of shape {(*images.shape[:2], 4)} (one x1, y1, x2, y2 "
                             f"per region), got {_describe(boxes)}")
        return boxes

    def encode_captions(self, captions: torch.Tensor, lengths: Any) -> torch.Tensor:
        """(n_cap, L) ids, lengths in any order -> (n_cap, max(lengths), d), zero beyond each length.

        Lengths stay where they are given: on the CPU (where the GRU's packing reads them) they
        are read without waiting for the device. Only the type and the lengths are checked here
        (`validate_inputs` checks a whole batch, the word ids too)."""
        lengths = _as_lengths(lengths, None)
        if not isinstance(captions, torch.Tensor) or captions.dim() != 2 or len(lengths) != captions.size(0) \
                or int(lengths.max()) > captions.size(1):
            raise InputError(f"captions must be an int tensor (n_cap, L) with n_cap lengths of at most L, got "
                             f"{_describe(captions)} and lengths {_describe(lengths)}")
        return self.txt_enc(captions[:, : int(lengths.max())], lengths)

    # ------------------------------------------------------------------ similarity
    def similarity_heads(self, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: Any,
                         img_glo: torch.Tensor | None = None, cap_glo: torch.Tensor | None = None,
                         gram: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Scores (n_img, n_cap) of every head of the model, from embeddings, for a whole block.

        Args:
            img_glo: optional eval-mode global vectors of these images, from `image_globals`
                under the same precision; a scorer computes them once per split instead of once
                per block. Ignored in training.
            cap_glo: the same for the captions, from `caption_globals`.
            gram: optional `region_grams(img_embs)`, for a scorer that scores the same images
                against many caption blocks. Ignored in training.
        """
        host_lengths = _host_lengths(lengths)
        words, word_mask, lengths = _masked_words(cap_embs, lengths)
        img_embs, centres = self.split_places(img_embs)
        if not self.training and not torch.is_grad_enabled() and self.sim_enc.supports_fast() \
                and img_embs.dtype != torch.float64 and words.dtype != torch.float64:
            return self._eval_similarity_heads(img_embs, words, word_mask, lengths, img_glo, cap_glo, gram,
                                               host_lengths, centres)
        if self.training:
            return self._train_similarity_heads(img_embs, words, word_mask, lengths, host_lengths, centres)
        offset = None if centres is None else self.sim_enc.place_offset(img_embs, centres, words, word_mask)
        nodes, node_mask = self.sim_enc(img_embs, words, word_mask)                       # (n_img, n_cap, P, m)
        return self.sim_enc.head_scores(nodes, node_mask, self.heads, offset)

    @contextlib.contextmanager
    def frozen_weights(self) -> Iterator[None]:
        """Within this context the eval fast path prepares its weight-only constants (the folded
        SGR weights, the similarity layers in the matmul dtype) once per precision instead of on
        every call. The weights must not change inside it; the scorer enters it for one split."""
        outer = self._eval_constants is not None
        if not outer:
            self._eval_constants = {}
        try:
            yield
        finally:
            if not outer:
                self._eval_constants = None

    def eval_constants(self, low: torch.dtype) -> dict[str, Any]:
        """The eval fast path's weight-only constants in `low` (cached inside `frozen_weights`)."""
        cache = self._eval_constants
        if cache is not None and low in cache:
            return cache[low]
        # weight-only math in float32 whatever autocast the caller is under (then cast to `low`)
        with torch.no_grad(), torch.autocast(next(self.parameters()).device.type, enabled=False):
            folded = graph_steps.fold_steps(self.sim_enc.SGR_module, low) if "sgr" in self.heads else None
            constants = {"layers": self.sim_enc.cast_layers(low), "folded": folded}
        if cache is not None:
            cache[low] = constants
        return constants

    def size_key(self) -> str:
        """What the speed of scoring depends on in the configuration, for measured choices."""
        cfg = self.config
        return f"{cfg.module}|d={cfg.embed_size}|m={cfg.sim_dim}|K={cfg.num_regions}|steps={cfg.sgr_step}"

    def eval_chunk_bytes(self, low: torch.dtype) -> int:
        """The CPU chunk budget for `low` (`sgraf.kernels.eval_chunks.chunk_budget`): inside
        `frozen_weights`, the budget a scorer measured for its way of scoring (`tune_eval`); else
        the choice measured for this machine by a plain call, or the default."""
        measured = self._probe_chunk_bytes
        if measured is None and self._eval_constants is not None:
            measured = self._eval_constants.get(low, {}).get("chunk_bytes")
        return eval_chunks.chunk_budget(low, self.size_key(), measured)

    @torch.no_grad()
    def tune_eval(self, device: torch.device, timer: Callable[[Callable[[], None]], float] | None = None,
                  label: str = "") -> int:
        """Measure this machine's eval choices for the current precision once (stored, see
        `sgraf.kernels.tuning`): SGR's edge route on this device (`sgraf.kernels.edges`); on a CUDA
        device with Triton, SGR's reasoning steps' route (`sgraf.kernels.graph_steps`) and the word
        nodes' route (`sgraf.kernels.words`); on the CPU, the chunk budget (about a second at the
        paper's size), which it returns; inside `frozen_weights` the model then uses that budget
        until the context ends.

        Scorers of whole splits call this before scoring; a single `similarity` call uses the
        stored choices or the defaults without measuring. Call in eval mode, under the autocast
        context the scoring will run in.

        Args:
            timer: seconds per block to score `probe_block()`'s block the way the caller will
                score (e.g. one block per core at once, so that the cores share the caches as
                they will); default: the best of 3 calls on this thread.
            label: names the caller's way of scoring in the stored choice (with `timer`).
        """
        low = compute_dtype(device)
        if "sgr" in self.heads and self.sim_enc.supports_fast():
            edges.measure_edge_route(device, low, self.sim_enc.node_dim)
            graph_steps.measure_step_route(device, low, self.sim_enc.node_dim, len(self.sim_enc.SGR_module))
        if self.sim_enc.supports_fast() and self.sim_enc.use_local:
            layer = self.sim_enc.sim_tranloc_w
            words_kernels.measure_word_route(device, low, layer.in_features, layer.out_features)
            attention.measure_attention_route(device, low)
        if "saf" in self.heads and self.sim_enc.supports_fast():
            filtration.measure_filter_route(device, low, self.sim_enc.node_dim)
        if plan.gpu_plan(device) or not self.sim_enc.supports_fast() or eval_chunks.EVAL_CHUNK_BYTES is not None:
            return self.eval_chunk_bytes(low)
        blocks: list[Callable[[], None]] = []      # the synthetic block, made at the first measurement only

        def measure(budget: int) -> float:
            if not blocks:
                blocks.append(self.probe_block())
            self._probe_chunk_bytes = budget
            try:
                return timer(blocks[0]) if timer else tuning.best_time(blocks[0])
            finally:
                self._probe_chunk_bytes = None

        chosen = eval_chunks.choose_budget(low, self.size_key(), measure, label)
        if self._eval_constants is not None:
            self.eval_constants(low)["chunk_bytes"] = chosen
        return chosen

    def probe_block(self) -> Callable[[], None]:
        """A function that scores a synthetic `EVAL_PROBE_BLOCK` (images x captions x tokens) in
        eval mode without autograd, at the precision of the autocast context it is called in, as
        a split scorer does (global vectors and Gram matrices given): for timing probes."""
        n_img, n_cap, n_words = EVAL_PROBE_BLOCK
        cfg = self.config
        generator = torch.Generator().manual_seed(0)
        lengths = torch.full((n_cap,), n_words)
        device = next(self.parameters()).device
        with torch.autocast(device.type, enabled=False):   # float32 inputs, as a scorer passes them
            regions = F.normalize(torch.randn(n_img, cfg.num_regions, cfg.embed_size, generator=generator), dim=-1)
            words = F.normalize(torch.randn(n_cap, n_words, cfg.embed_size, generator=generator), dim=-1)
            # random stand-ins for what a scorer computes once per split or image block (their
            # values do not change the time; the model's own methods stay uncalled)
            img_glo = F.normalize(torch.randn(n_img, cfg.embed_size, generator=generator), dim=-1)
            cap_glo = F.normalize(torch.randn(n_cap, cfg.embed_size, generator=generator), dim=-1)
            gram = torch.bmm(regions, regions.transpose(1, 2))
            regions, words, img_glo, cap_glo, gram, lengths = (
                t.to(device) for t in (regions, words, img_glo, cap_glo, gram, lengths))

        def score_block() -> None:
            was_training = self.training
            self.eval()
            try:
                # eager: a compiled probe would compile a graph per candidate chunk size
                with torch.no_grad(), self.frozen_weights(), compiled.compiling("off"):
                    self.similarity(regions, words, lengths, img_glo=img_glo, cap_glo=cap_glo, gram=gram)
            finally:
                self.train(was_training)

        return score_block

    def _eval_similarity_heads(self, img_embs: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                               lengths: torch.Tensor, img_glo: torch.Tensor | None,
                               cap_glo: torch.Tensor | None, gram: torch.Tensor | None,
                               host_lengths: torch.Tensor | None = None, centres: torch.Tensor | None = None
                               ) -> dict[str, torch.Tensor]:
        """Eval fast path: explicit precision instead of autocast (see `fast_forward`), in the
        chunks of `sgraf.kernels.eval_chunks` (cache-sized on the CPU); the global vectors (or
        given), the global nodes, the Gram matrices (or given) and the casts to the matmul dtype
        done once for the block. `host_lengths`, the lengths on the CPU when the caller has them
        there, size the chunks without waiting for the device. `centres` (n_img, K, 2), a place
        model's: each chunk takes its places from its own attention, and the words' directions
        are computed once for the block."""
        sim = self.sim_enc
        device = words.device
        low = compute_dtype(device)
        with torch.autocast(device.type, enabled=False):
            constants = self.eval_constants(low)
            # computed once for the block, not per chunk; with them, fast_forward reads the
            # embeddings only in the matmul dtype
            glo_nodes = None
            if sim.use_global:
                img_glo = sim.eval_image_globals(img_embs, low) if img_glo is None else img_glo.float()
                cap_glo = sim.eval_caption_globals(words, word_mask, low) if cap_glo is None else cap_glo.float()
                glo_nodes = sim.global_nodes(img_glo, cap_glo, low, constants["layers"])  # (n_img, n_cap, m)
            if sim.use_local and gram is None:
                gram = sim.region_gram(img_embs)
            directions = None if centres is None else sim.place_term.word_directions(words.float(), word_mask)
            return eval_chunks.score_chunks(sim, self.heads, img_embs.to(low), words.to(low), word_mask,
                                            lengths if host_lengths is None else host_lengths, glo_nodes, gram,
                                            constants, self.eval_chunk_bytes(low), centres, directions)

    @torch.no_grad()
    def region_grams(self, img_embs: torch.Tensor) -> torch.Tensor | None:
        """(n_img, K, K) float32 Gram matrices of region embeddings for `similarity(..., gram=...)`,
        or None for models whose eval path does not use them."""
        if not (self.sim_enc.supports_fast() and self.sim_enc.use_local) or img_embs.dtype == torch.float64:
            return None
        img_embs = self.split_places(img_embs)[0]
        with torch.autocast(img_embs.device.type, enabled=False):  # float32 whatever the precision
            return self.sim_enc.region_gram(img_embs)

    @torch.no_grad()
    def image_globals(self, img_embs: torch.Tensor) -> torch.Tensor | None:
        """Eval-mode global vectors (n_img, d) float32 of region embeddings, at the current
        autocast precision, for `similarity(..., img_glo=...)`; None without a global node or
        for float64 embeddings (which take the plain path)."""
        if not self.sim_enc.supports_fast() or img_embs.dtype == torch.float64:
            return None
        return self.sim_enc.eval_image_globals(self.split_places(img_embs)[0], compute_dtype(img_embs.device))

    @torch.no_grad()
    def caption_globals(self, cap_embs: torch.Tensor, lengths: Any) -> torch.Tensor | None:
        """Eval-mode global vectors (n_cap, d) float32 of word embeddings (see `image_globals`)."""
        if not self.sim_enc.supports_fast() or cap_embs.dtype == torch.float64:
            return None
        words, word_mask, _ = _masked_words(cap_embs, lengths)
        return self.sim_enc.eval_caption_globals(words, word_mask, compute_dtype(cap_embs.device))

    def train_chunks(self, n_img: int, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Caption indices of each train-mode chunk against `n_img` images: `train_chunk` captions
        each, or cut by the memory budget of the model's device
        (`sgraf.kernels.train_chunks.caption_chunks`)."""
        return train_chunks.caption_chunks(lengths, n_img, self.config.embed_size, next(self.parameters()).device,
                                           self.train_chunk)

    def _train_similarity_heads(self, img_embs: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                                lengths: torch.Tensor, host_lengths: torch.Tensor | None = None,
                                centres: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Train-mode scores, the captions in chunks; each chunk recomputed in backward.

        A place model (`centres`) adds to each chunk the place term of the places its own
        attention reads (`train_nodes`), with the words' directions computed once for the batch.

        The chunks are cut from the lengths on the CPU (`host_lengths` when the caller has them
        there, as the training loop does: no wait for the device; else one copy).

        Only the BatchNorm-free, RNG-free part runs per chunk (`train_nodes` and the heads); the
        global vectors (VisualSA's BatchNorm, the dropouts) are computed once, before. SAF's
        per-caption BatchNorm running statistics are applied once, after, in caption order.
        """
        img_glo, cap_glo, directions = self._train_batch_vectors(img_embs, words, word_mask, centres)
        return self._train_block_scores(img_embs, img_glo, words, word_mask, cap_glo, lengths, host_lengths, centres,
                                        directions)

    def _train_batch_vectors(self, regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                             centres: torch.Tensor | None
                             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """A train-mode batch's per-image and per-caption vectors, computed once: the global
        vectors (n_img, d), (n_cap, d) (VisualSA's BatchNorm advanced, dropout drawn; kept in
        `train_global_vectors` for an auxiliary loss, sgraf.training's global_loss_weight), and
        for a place model the words' directions (n_cap, L, 2), else None."""
        sim = self.sim_enc
        img_glo, cap_glo = sim.global_vectors(regions, words, word_mask)
        self.train_global_vectors = (img_glo, cap_glo)
        directions = None if centres is None else sim.place_term.word_directions(words.float(), word_mask)
        return img_glo, cap_glo, directions

    def _train_block_scores(self, img_embs: torch.Tensor, img_glo: torch.Tensor | None, words: torch.Tensor,
                            word_mask: torch.Tensor, cap_glo: torch.Tensor | None, lengths: torch.Tensor,
                            host_lengths: torch.Tensor | None, centres: torch.Tensor | None,
                            directions: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`_train_similarity_heads` after the global vectors and the words' directions: the
        per-pair part, in `train_chunks` (`sgraf.kernels.train_chunks.block_scores`), recomputed in
        backward where `train_checkpoint` allows."""
        host_lengths = lengths.cpu() if host_lengths is None else host_lengths
        return train_chunks.block_scores(self.sim_enc, self.heads, self.train_chunks(img_embs.size(0), host_lengths),
                                         self.train_checkpoint and torch.is_grad_enabled(), img_embs, img_glo,
                                         words, word_mask, cap_glo, host_lengths, centres, directions)

    def similarity(self, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: Any,
                   head: str | None = None, img_glo: torch.Tensor | None = None,
                   cap_glo: torch.Tensor | None = None, gram: torch.Tensor | None = None) -> torch.Tensor:
        """(n_img, K, d) and (n_cap, L, d) embeddings -> (n_img, n_cap) scores.

        Args:
            head: 'sgr' or 'saf' for one head of a joint model; None gives the model's score
                (for a joint model, the mean of its two heads).
            img_glo: optional precomputed image global vectors (see `similarity_heads`).
            cap_glo: optional precomputed caption global vectors.
            gram: optional precomputed Gram matrices.
        """
        if head is not None and head not in self.heads:
            raise InputError(f"head {head!r} is not one of this model's heads {self.heads}")
        scores = self.similarity_heads(img_embs, cap_embs, lengths, img_glo, cap_glo, gram)
        if head is not None:
            return scores[head]
        return sum(scores.values()) / len(scores)

    def forward(self, images: torch.Tensor, captions: torch.Tensor, lengths: Any,
                boxes: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Training path: (n_img, n_cap) scores, or `{'sgr': ..., 'saf': ...}` for a joint model.
        `boxes` as in `encode_images`."""
        scores = self.similarity_heads(self.encode_images(images, boxes), self.encode_captions(captions, lengths),
                                       lengths)
        return scores if self.config.module == "joint" else scores[self.config.module]

    @property
    def pair_training(self) -> bool:
        """Whether `train_scores` serves this model: one head that couples no pairs (SGR or
        AVE; SAF's training BatchNorm takes its statistics over all the images of a caption, so
        every pair reaches its loss) on vector nodes with text-to-image attention."""
        return self.heads in (("sgr",), ("ave",)) and self.sim_enc.supports_fast()

    def train_scores(self, images: torch.Tensor, captions: torch.Tensor, lengths: Any,
                     boxes: torch.Tensor | None = None) -> TrainScores:
        """The train-mode score matrix without autograd, and any of its pairs again with it.

        The encoders and the global vectors run once, with autograd (dropout drawn once,
        VisualSA's BatchNorm advanced once, as in `forward`); the (n_img, n_cap) scores are then
        computed without autograd. `TrainScores.pairs(rows, cols)` scores chosen pairs again from
        the same embeddings, with autograd, as aligned pairs. A loss that reads a few pairs of the
        matrix (hardest negatives) thus needs a backward pass through those pairs only
        (`sgraf.training.pairs`). Needs `pair_training`.

        Args as in `forward`.
        """
        self._check_pair_training()
        return self.train_scores_from(self.encode_images(images, boxes), self.encode_captions(captions, lengths),
                                      lengths)

    def _check_pair_training(self) -> None:
        if not (self.training and self.pair_training):
            raise InputError(f"train_scores needs a model in train mode whose head couples no pairs "
                             f"(sgr or ave, vector nodes, t2i attention), got heads {self.heads}")

    def train_scores_from(self, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: Any) -> TrainScores:
        """`train_scores` from encoded images (n_img, K, d) and captions (n_cap, L, d), e.g. every
        process's images against this process's captions (`sgraf.training.global_batch`)."""
        self._check_pair_training()
        host_lengths = _host_lengths(lengths)
        words, word_mask, lengths = _masked_words(cap_embs, lengths)
        regions, centres = self.split_places(img_embs)
        img_glo, cap_glo, directions = self._train_batch_vectors(regions, words, word_mask, centres)
        embeddings = (regions, img_glo, words, word_mask, cap_glo, centres, directions)
        with torch.no_grad():
            detached = [None if t is None else t.detach() for t in embeddings]
            values = self._train_block_scores(*detached[:5], lengths, host_lengths, *detached[5:])
        return TrainScores(values, lambda rows, cols: self._pair_scores(*embeddings, host_lengths, rows, cols))

    def _pair_scores(self, regions: torch.Tensor, img_glo: torch.Tensor | None, words: torch.Tensor,
                     word_mask: torch.Tensor, cap_glo: torch.Tensor | None, centres: torch.Tensor | None,
                     directions: torch.Tensor | None, host_lengths: torch.Tensor | None, rows: torch.Tensor,
                     cols: torch.Tensor) -> dict[str, torch.Tensor]:
        """Train-mode scores (P,) of the aligned pairs (image rows[p], caption cols[p]), with
        autograd, from a batch's embeddings (see `train_scores`;
        `sgraf.kernels.train_chunks.pair_scores`, compiled padded to the loss's `max_pairs`)."""
        return train_chunks.pair_scores(self.sim_enc, self.heads, regions, img_glo, words, word_mask, cap_glo,
                                        centres, directions, host_lengths, rows, cols,
                                        max_pairs(regions.size(0), words.size(0)))

    @torch.no_grad()
    def score(self, images: torch.Tensor, captions: torch.Tensor, lengths: Any,
              batch_size: int = 128, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """Validated eval-mode (n_img, n_cap) float32 score matrix (region features, token ids),
        on the images' device, at the precision of the autocast context it is called in.
        `boxes` as in `encode_images` (ignored by a model without positions).

        Scored by the block scorer every entry point shares (`sgraf.model.blocks`): captions in
        buckets of `batch_size` sorted by length (each padded to its own longest caption), the
        weight folds, global vectors and Gram matrices computed once per call.
        """
        batch_size = check_positive_int(batch_size, "batch_size")
        images, captions, boxes = (torch.tensor(value) if isinstance(value, np.ndarray) else value   # NumPy too
                                   for value in (images, captions, boxes))
        other = sorted({str(t.dtype).replace("torch.", "") for t in self.parameters()   # float64: the golden checks
                        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64)})
        if other:       # it had failed deep in PyTorch ("mat1 and mat2 must have the same dtype")
            raise InputError(f"the model has {', '.join(other)} weights; sgraf computes from float32 weights, in low "
                             "precision under autocast: model.float(), then sgraf.Matcher(model, precision='bf16') "
                             "or a torch.autocast context")
        lengths = self.validate_inputs(images, captions, lengths)
        if self.needs_boxes:
            check_normalised_boxes(self.check_boxes(images, boxes))
        precision = current_precision(images.device)
        encoded = blocks.encode(self, images, captions, lengths, batch_size, precision, boxes=boxes)
        return blocks.score_encoded([self], [encoded], precision).to(images.device)


class TrainScores:
    """`SGRAF.train_scores`' answer.

    Attributes:
        values: {head: (n_img, n_cap) train-mode scores}, without autograd.
        columns: the columns of `values` whose pairs `pairs` scores (all of them on one
            process; this process's captions among the global batch's on several).
        copies: how many processes share the batch (the backward's gradients are averaged over
            them, `sgraf.training.global_batch.average_gradients`).
    """

    def __init__(self, values: dict[str, torch.Tensor],
                 pairs: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
                 columns: slice = slice(None), copies: int = 1) -> None:
        self.values = values
        self._pairs = pairs
        self.columns = columns
        self.copies = copies

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> dict[str, torch.Tensor]:
        """{head: (P,) scores} of the pairs (rows[p], cols[p]), with autograd: the same values
        as `values[head][rows, columns][:, cols]` up to float rounding."""
        return self._pairs(rows, cols)


def _host_lengths(lengths: Any) -> torch.Tensor | None:
    """`lengths` if they are a tensor on the CPU (read without waiting for a device), else None."""
    return lengths if isinstance(lengths, torch.Tensor) and lengths.device.type == "cpu" else None


def _masked_words(cap_embs: torch.Tensor, lengths: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Word embeddings trimmed to the longest caption and zeroed beyond each length.

    Lengths given on the CPU size the trim there and are copied to the embeddings' device
    without a host synchronisation (the block scorer keeps its buckets' lengths on the CPU).

    Returns:
        words (n_cap, L, d), word_mask (n_cap, L) bool, lengths (n_cap,) int64 on the
        embeddings' device.
    """
    lengths = _as_lengths(lengths, None)   # a tensor stays where it is, a sequence goes to the CPU
    n_words = int(lengths.max())
    lengths = lengths.to(cap_embs.device, non_blocking=True)
    if n_words > cap_embs.size(1):
        raise InputError(f"a caption length ({n_words}) exceeds the word embeddings' length {cap_embs.size(1)}")
    word_mask = torch.arange(n_words, device=cap_embs.device) < lengths.unsqueeze(1)    # (n_cap, L)
    words = cap_embs[:, :n_words] * word_mask.unsqueeze(2).to(cap_embs.dtype)
    return words, word_mask, lengths


def _as_lengths(lengths: Any, device: torch.device | str | None) -> torch.Tensor:
    """Lengths as a 1-D int64 tensor on `device` (None: a tensor stays where it is, anything
    else goes to the CPU); InputError if they are not whole numbers."""
    try:
        tensor = torch.as_tensor(lengths, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"lengths must be a 1-D sequence of integers: {error}") from None
    if tensor.dim() != 1 or tensor.is_floating_point() or tensor.dtype == torch.bool or tensor.is_complex():
        raise InputError(f"lengths must be a 1-D sequence of integers, got {_describe(tensor)}")
    return tensor.long()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
