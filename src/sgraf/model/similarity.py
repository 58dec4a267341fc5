"""Eq. 1-5: similarity representations of the global and word-attended local alignments.

For a block of n_img images and n_cap captions everything is computed at once; captions of
different lengths are handled with a (n_cap, L) word mask. Padded words must be zero (the
text encoder's output is), which keeps them out of the word-wise normalisation of Eq. 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgraf import torch_compat
from sgraf.errors import InputError
from sgraf.kernels import attention
from sgraf.kernels import nodes as nodes_kernels
from sgraf.kernels import words as words_kernels
from sgraf.kernels.cpu import fast_linear, train_linear
from sgraf.model.encoders import TextSelfAttention, VisualSelfAttention
from sgraf.model.norms import EPS, FLOAT32_TINY, cosine, l2norm, l2norm_, squared_difference
from sgraf.model.positions import PlaceTerm


def compute_dtype(device: torch.device) -> torch.dtype:
    """The matmul dtype autocast would use on `device` now (float32 outside autocast)."""
    if torch_compat.autocast_enabled(device.type):
        return torch_compat.autocast_dtype(device.type)
    return torch.float32


def local_nodes(attn: torch.Tensor, regions: torch.Tensor, words: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
    """Eq. 1 for the word nodes from normalised attention: `l2norm(W (A R - T)^2 + b)`, with autograd.

    Args:
        attn: (n_img, n_cap, L, K) attention rows already divided by their context's norm.
        regions: (n_img, K, d); words: (n_cap, L, d) shared by every image, or (n_img, 1, L, d)
            with one caption per image (aligned pairs); weight: (m, d); bias: (m,).

    Returns:
        (n_img, n_cap, L, m) nodes. In float32 outside autocast, and under bf16 or fp16 autocast,
        `W (A R - T)^2 + b` comes from `sgraf.kernels.nodes.light_nodes` (keeping no (word x
        feature) tensor for backward); otherwise from plain autograd, as written here.
    """
    light = nodes_kernels.light_nodes(attn, regions, words, weight, bias)
    if light is not None:
        return l2norm(light)
    n_img, n_cap, n_words, n_regions = attn.shape
    context = (attn.reshape(n_img, n_cap * n_words, n_regions) @ regions).view(n_img, n_cap, n_words, -1)
    return l2norm(train_linear(squared_difference(context, words if words.dim() == 4 else words.unsqueeze(0)),
                               weight, bias))


def attend_regions(regions: torch.Tensor, words: torch.Tensor, smooth: float) -> torch.Tensor:
    """Text-to-image attention (SCAN): for each word, the attended image context (Eq. 3-4).

    Args:
        regions: (n_img, K, d) region embeddings.
        words: (n_cap, L, d) word embeddings, zero beyond each caption's length.
        smooth: softmax temperature lambda (9).

    Returns:
        (n_img, n_cap, L, d) l2-normalised contexts `a_j`.
    """
    n_img, n_regions, dim = regions.shape
    n_cap, n_words, _ = words.shape
    attn = region_attention(regions, words, smooth)                     # (n_img, n_cap, L, K)
    context = attn.reshape(n_img, n_cap * n_words, n_regions) @ regions  # (n_img, n_cap * L, d)
    return l2norm_(context).view(n_img, n_cap, n_words, dim)


def region_attention(regions: torch.Tensor, words: torch.Tensor, smooth: float) -> torch.Tensor:
    """SCAN's text-to-image attention weights (Eq. 3): (n_img, K, d), (n_cap, L, d) ->
    (n_img, n_cap, L, K), each word's softmax over the regions."""
    n_img, n_regions, dim = regions.shape
    n_cap, n_words, _ = words.shape
    # (n_img, K, n_cap * L): every region against every word of the block, one matmul
    relevance = regions @ words.reshape(n_cap * n_words, dim).t()
    relevance = F.leaky_relu(relevance, 0.1).view(n_img, n_regions, n_cap, n_words)
    # each region's row normalised across the caption's words; padded words are 0 here
    relevance = l2norm(relevance, dim=3)
    return (relevance * smooth).permute(0, 2, 3, 1).softmax(dim=3)


def attend_words(regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                 smooth: float) -> torch.Tensor:
    """Image-to-text attention (SCAN i2t): for each region, the attended text context.

    Args:
        regions: (n_img, K, d).
        words: (n_cap, L, d), zero beyond each length.
        word_mask: (n_cap, L) bool.
        smooth: softmax temperature.

    Returns:
        (n_img, n_cap, K, d) l2-normalised contexts, one per region.
    """
    n_img, n_regions, dim = regions.shape
    n_cap, n_words, _ = words.shape
    relevance = regions @ words.reshape(n_cap * n_words, dim).t()      # (n_img, K, n_cap * L)
    relevance = F.leaky_relu(relevance, 0.1).view(n_img, n_regions, n_cap, n_words)
    # padded words are all-zero columns: give them a harmless value so the norm's gradient stays
    # finite (they are masked out of the softmax below)
    relevance = relevance.masked_fill(~word_mask[None, None], 1.0)
    relevance = l2norm(relevance, dim=1)                                # each word across regions
    logits = (relevance * smooth).permute(0, 2, 1, 3)                  # (n_img, n_cap, K, L)
    attn = logits.masked_fill(~word_mask[None, :, None, :], float("-inf")).softmax(dim=3)
    context = attn.reshape(n_img, n_cap, n_regions, n_words) @ words.unsqueeze(0)  # (n_img, n_cap, K, d)
    return l2norm_(context)


class SimilarityRepresentation(nn.Module):
    """Global and local similarity nodes of every (image, caption) pair (Eq. 1-5).

    Produces the graph nodes `N = [s_g, s_1, ..., s_P]` (global first), where the local nodes
    are words (t2i attention) or regions (i2t attention), and the mask of valid nodes.
    """

    def __init__(self, embed_size: int, sim_dim: int, num_regions: int, *, alignments: str = "both",
                 similarity: str = "vector", attention: str = "t2i", smooth: float = 9.0,
                 dropout: float = 0.4, place_sharpness: float = 1.0) -> None:
        super().__init__()
        self.alignments = alignments
        self.similarity = similarity
        self.attention = attention
        self.smooth = smooth
        # a place model, scoring, reads each word's place from this attention at temperature
        # smooth x it (ModelConfig.place_sharpness); training reads it from the nodes' attention
        self.place_sharpness = place_sharpness
        self.use_global = alignments in ("both", "global")
        self.use_local = alignments in ("both", "local")
        if self.use_global:
            self.v_global_w = VisualSelfAttention(embed_size, num_regions, dropout)
            self.t_global_w = TextSelfAttention(embed_size, dropout)
        if similarity == "vector":
            if self.use_local:
                self.sim_tranloc_w = nn.Linear(embed_size, sim_dim)
            if self.use_global:
                self.sim_tranglo_w = nn.Linear(embed_size, sim_dim)

    @property
    def place_smooth(self) -> float:
        """The temperature a place model reads its places at when scoring: lambda x place_sharpness."""
        return self.smooth * self.place_sharpness

    @property
    def node_dim(self) -> int:
        """Size of one similarity node: m for vectors (Eq. 1), 1 for cosine scalars."""
        if self.similarity == "scalar":
            return 1
        layer = self.sim_tranloc_w if self.use_local else self.sim_tranglo_w
        return layer.out_features

    def _vector(self, x: torch.Tensor, y: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        # Eq. 1: s(x, y) = l2norm(W |x - y|^2)
        if self.similarity == "scalar":
            return cosine(x, y).unsqueeze(-1)
        return l2norm(layer(squared_difference(x, y)))

    def forward(self, regions: torch.Tensor, words: torch.Tensor,
                word_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Similarity nodes of a block.

        Args:
            regions: (n_img, K, d) region embeddings.
            words: (n_cap, L, d) word embeddings, zero beyond each length.
            word_mask: (n_cap, L) bool.

        Returns:
            nodes (n_img, n_cap, P, m) and node_mask (n_cap, P) bool, P = [1 +] (L or K).
        """
        n_cap = words.size(0)
        nodes, masks = [], []
        if self.use_global:
            img_glo = self.v_global_w(regions)                     # (n_img, d)
            cap_glo = self.t_global_w(words, word_mask)            # (n_cap, d)
            sim_glo = self._vector(img_glo.unsqueeze(1), cap_glo.unsqueeze(0), getattr(self, "sim_tranglo_w", None))
            nodes.append(sim_glo.unsqueeze(2))                     # (n_img, n_cap, 1, m)
            masks.append(word_mask.new_ones(n_cap, 1))
        if self.use_local:
            layer = getattr(self, "sim_tranloc_w", None)
            if self.attention == "t2i":
                context = attend_regions(regions, words, self.smooth)          # (n_img, n_cap, L, d)
                nodes.append(self._vector(context, words.unsqueeze(0), layer))  # (n_img, n_cap, L, m)
                masks.append(word_mask)
            else:
                context = attend_words(regions, words, word_mask, self.smooth)  # (n_img, n_cap, K, d)
                nodes.append(self._vector(context, regions.unsqueeze(1), layer))
                masks.append(word_mask.new_ones(n_cap, regions.size(1)))
        node_mask = torch.cat(masks, dim=1)
        return torch.cat(nodes, dim=2), node_mask

    def global_vectors(self, regions: torch.Tensor, words: torch.Tensor,
                       word_mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The self-attention global vectors (n_img, d) and (n_cap, d), or (None, None).

        In training mode this advances VisualSA's BatchNorm running statistics: call it once per
        forward, outside any recomputed (checkpointed) region.
        """
        if not self.use_global:
            return None, None
        return self.v_global_w(regions), self.t_global_w(words, word_mask)

    def light_train_nodes(self, words: torch.Tensor) -> bool:
        """Whether `train_nodes` keeps no (word x feature) tensor for backward (`local_nodes`:
        float32 outside autocast, or bf16/fp16 autocast; without word nodes, global alignments
        only, nothing of that size to keep)."""
        if not (self.similarity == "vector" and self.attention == "t2i"):
            return False
        if self.use_local and torch_compat.autocast_enabled(words.device.type):
            return nodes_kernels.light_dtype(words.device.type, words, self.sim_tranloc_w.weight) is not None
        return words.dtype == torch.float32

    def train_nodes(self, regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                    img_glo: torch.Tensor | None, cap_glo: torch.Tensor | None, centres: torch.Tensor | None = None,
                    aligned: bool = False, gram: torch.Tensor | None = None,
                    relevance: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`forward` from precomputed global vectors; pure, so safe to recompute in backward.

        For vector nodes with text-to-image attention, the local contexts are normalised before
        they are formed: `a_j / |a_j| = (attn_j / |a_j|) R`, with `|a_j|^2 = attn_j (R R^T)
        attn_j^T` from each image's (K, K) Gram matrix. Same values up to rounding, and one
        (n_img, n_cap, L, d) tensor fewer to compute and keep for backward.

        Args:
            regions: (n_img, K, d); words: (n_cap, L, d), zero beyond each length;
            word_mask: (n_cap, L) bool; img_glo: (n_img, d), cap_glo: (n_cap, d) or None.
            centres: (n_img, K, 2) the regions' centres, for a place model (needs local
                alignments with text-to-image attention).
            aligned: score P aligned pairs instead of a grid: image p against caption p only,
                every argument's first dimension P (vector nodes, text-to-image attention).
                The same math; the block is then one row of P pairs.
            gram: the regions' Gram matrices `regions @ regions^T` (n_img, K, K), when the
                caller scores several chunks of captions against the same regions (computed
                here otherwise).
            relevance: `regions @ words^T` as (n_img, K, n_cap * L), when the caller has
                computed it for several chunks at once (vector nodes, text-to-image, a grid).

        Returns:
            nodes (n_img, n_cap, P, m) and node_mask (n_cap, P) bool, global node first, and
            with `centres` the float32 places (n_img, n_cap, L, 2) each word reads
            (`sgraf.model.positions.PlaceTerm.places`: from the attention of the nodes, in
            float32), else None. Aligned: nodes (1, P, P', m), node_mask (P, P'), places
            (1, P, L, 2).
        """
        if aligned and not self.supports_fast():
            raise InputError("aligned pairs need vector similarities with text-to-image attention")
        n_img, n_regions, dim = regions.shape
        n_cap, n_words, _ = words.shape
        # aligned pairs are scored as n_img = P images of one caption each (the words' own)
        cap_axis = 1 if aligned else 0
        nodes, masks, places = [], [], None
        if self.use_global:
            layer = getattr(self, "sim_tranglo_w", None)
            if self.similarity == "vector":
                square = squared_difference(img_glo.unsqueeze(1), cap_glo.unsqueeze(cap_axis))
                nodes.append(l2norm(train_linear(square, layer.weight, layer.bias)).unsqueeze(2))
            else:
                nodes.append(self._vector(img_glo.unsqueeze(1), cap_glo.unsqueeze(0), layer).unsqueeze(2))
            masks.append(word_mask.new_ones(n_cap, 1))
        if self.use_local and self.similarity == "vector" and self.attention == "t2i":
            if aligned:   # (P, K, L): each image's regions against its own caption's words
                relevance, n_cap = torch.bmm(regions, words.transpose(1, 2)), 1
            elif relevance is None:   # (n_img, K, n_cap * L): every region against every word of the block
                relevance = regions @ words.reshape(n_cap * n_words, dim).t()
            relevance = F.leaky_relu(relevance, 0.1).view(n_img, n_regions, n_cap, n_words)
            relevance = l2norm(relevance, dim=3)                       # each region across the words
            attn = (relevance * self.smooth).permute(0, 2, 3, 1).softmax(dim=3)          # (n_img, n_cap, L, K)
            if centres is not None:   # the place each word reads: its attention over the centres
                places = PlaceTerm.places(attn.float(), centres.float())
            attn = attn.reshape(n_img, n_cap * n_words, n_regions)
            if gram is None:
                gram = regions @ regions.transpose(1, 2)                                  # (n_img, K, K)
            sq_norm = ((attn @ gram) * attn).sum(dim=2, keepdim=True)                    # |a_j|^2
            # the authors' l2norm: a_j / (|a_j| + eps). Clamped at float32's smallest normal number
            # rather than 0: the same bits (its root, 1e-19, is far below half an ulp of eps; in a
            # float16 tensor it rounds to 0, the old clamp), and where an image's regions are all
            # zero the gradient is 0, not the root's NaN at 0
            attn = attn / (sq_norm.clamp(min=FLOAT32_TINY).sqrt() + EPS)
            attn = attn.view(n_img, n_cap, n_words, n_regions)
            nodes.append(local_nodes(attn, regions, words.unsqueeze(1) if aligned else words,
                                     self.sim_tranloc_w.weight, self.sim_tranloc_w.bias))
            masks.append(word_mask)
        elif self.use_local:
            layer = getattr(self, "sim_tranloc_w", None)
            if centres is not None:   # a second attention, in float32, for the places
                places = PlaceTerm.places(region_attention(regions.float(), words.float(), self.smooth),
                                          centres.float())
            if self.attention == "t2i":
                context = attend_regions(regions, words, self.smooth)          # (n_img, n_cap, L, d)
                nodes.append(self._vector(context, words.unsqueeze(0), layer))
                masks.append(word_mask)
            else:
                context = attend_words(regions, words, word_mask, self.smooth)  # (n_img, n_cap, K, d)
                nodes.append(self._vector(context, regions.unsqueeze(1), layer))
                masks.append(word_mask.new_ones(n_cap, n_regions))
        if aligned:   # (P, 1, ...): P images of one caption each -> one row of P pairs, as the heads read a block
            return (torch.cat(nodes, dim=2).transpose(0, 1), torch.cat(masks, dim=1),
                    None if places is None else places.transpose(0, 1))
        return torch.cat(nodes, dim=2), torch.cat(masks, dim=1), places

    def supports_fast(self) -> bool:
        """Whether `fast_forward` covers this configuration (vector nodes, text-to-image)."""
        return self.similarity == "vector" and self.attention == "t2i"

    def eval_image_globals(self, regions: torch.Tensor, low: torch.dtype) -> torch.Tensor | None:
        """Eval-only VisualSA global vectors: (n_img, K, d) -> float32 (n_img, d), matmuls in `low`.

        None without a global alignment. Call without autograd; the result depends on the
        image only, so a scorer may compute it once per image (see `global_nodes`).
        """
        if not self.use_global:
            return None
        with torch.autocast(regions.device.type, dtype=low, enabled=low != torch.float32):
            return self.v_global_w(regions.float()).float()

    def eval_caption_globals(self, words: torch.Tensor, word_mask: torch.Tensor, low: torch.dtype) -> torch.Tensor | None:
        """Eval-only TextSA global vectors: (n_cap, L, d), (n_cap, L) -> float32 (n_cap, d) or None."""
        if not self.use_global:
            return None
        with torch.autocast(words.device.type, dtype=low, enabled=low != torch.float32):
            return self.t_global_w(words.float(), word_mask).float()

    @staticmethod
    def region_gram(regions: torch.Tensor) -> torch.Tensor:
        """(n_img, K, d) -> float32 (n_img, K, K) Gram matrices `R R^T` (for `fast_forward`)."""
        regions = regions.float()
        return torch.bmm(regions, regions.transpose(1, 2))

    def cast_layers(self, low: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The weights and biases of the similarity layers in `low`, for `fast_forward(layers=)`."""
        return {name: (layer.weight.to(low), layer.bias.to(low))
                for name in ("sim_tranglo_w", "sim_tranloc_w") if (layer := getattr(self, name, None)) is not None}

    def global_nodes(self, img_glo: torch.Tensor, cap_glo: torch.Tensor, low: torch.dtype,
                     layers: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Eval-only global similarity nodes `l2norm(W_g (g_i - h_c)^2 + b)` (Eq. 1) in `low`.

        Args:
            img_glo, cap_glo: (n_img, d) and (n_cap, d) float32 global vectors.
            layers: `cast_layers(low)`, or None to cast the weights here.

        Returns:
            (n_img, n_cap, m) in `low`.
        """
        weight, bias = (layers or self.cast_layers(low))["sim_tranglo_w"]
        # by the word nodes' route on this device: the same chain, the attention left out
        route = words_kernels.word_route(img_glo.device, low, weight.size(1), weight.size(0))
        return words_kernels.global_nodes(img_glo, cap_glo, weight, bias, route)

    def fast_forward(self, regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
                     low: torch.dtype, glo_nodes: torch.Tensor | None = None, gram: torch.Tensor | None = None,
                     layers: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                     centres: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Eval-only `forward` with fewer passes over memory and explicit precision.

        Call with autocast disabled and without autograd. The large matmuls (attention,
        contexts, `W_loc`) run in `low` (float32 or bfloat16); the squared differences and the
        l2 norms are computed in float32 and the nodes are stored in `low`, the dtype the
        reasoning matmuls read them in.

        Args:
            regions: (n_img, K, d); words: (n_cap, L, d), zero beyond each length; float32, or
                already in `low` when `glo_nodes` and `gram` are given (they are the only
                float32 uses).
            word_mask: (n_cap, L) bool.
            low: the matmul dtype.
            glo_nodes: `global_nodes` of these pairs (a scorer computes them for a whole block),
                or None to compute them here.
            gram: `region_gram(regions)`, or None to compute it here.
            layers: `cast_layers(low)`, or None to cast the weights here.
            centres: (n_img, K, 2) the regions' centres, for a place model (needs local
                alignments): the place each word reads is then taken from this attention.

        Returns:
            nodes (n_img, n_cap, P, m) in `low`, global node first, node_mask (n_cap, P), and
            with `centres` the float32 places (n_img, n_cap, L, 2) each word reads
            (`sgraf.model.positions.PlaceTerm.places`), else None.
        """
        n_img, n_regions, dim = regions.shape
        n_cap, n_words, _ = words.shape
        if layers is None:
            layers = self.cast_layers(low)
        n_nodes = int(self.use_global) + (n_words if self.use_local else 0)
        nodes = regions.new_empty(n_img, n_cap, n_nodes, self.node_dim, dtype=low)  # (n_img, n_cap, P, m)
        masks, places = [], None
        if self.use_global:
            if glo_nodes is None:
                glo_nodes = self.global_nodes(self.eval_image_globals(regions.float(), low),
                                              self.eval_caption_globals(words.float(), word_mask, low), low, layers)
            nodes[:, :, 0] = glo_nodes
            masks.append(word_mask.new_ones(n_cap, 1))
        if self.use_local:
            if gram is None:
                gram = self.region_gram(regions)                                  # (n_img, K, K)
            r_low, w_low = regions.to(low).contiguous(), words.to(low).contiguous()
            # (n_img * K, n_cap * L): every region against every word of the block, one matmul
            relevance = fast_linear(r_low.view(n_img * n_regions, dim), w_low.view(n_cap * n_words, dim))
            found = []

            def read_places(logits: torch.Tensor, attn: torch.Tensor) -> None:
                """The place each word reads: its attention (at `place_sharpness`) over the centres."""
                sharp = attn if self.place_sharpness == 1.0 else (logits * self.place_sharpness).softmax(dim=1)
                found.append(torch.bmm(sharp.transpose(1, 2), centres.float()).view(n_img, n_cap, n_words, 2))

            # (n_img, K, n_cap * L) float32, each (caption, word) column scaled by 1 / (|a_j| + eps)
            # from the regions' Gram matrix, so the contexts come out of the word nodes' matmul
            # normalised, without another pass over (n_img, n_cap, L, d)
            route = attention.attention_route(regions.device, low)
            attn = attention.scaled_attention(relevance.view(n_img, n_regions, n_cap * n_words), gram, n_words,
                                              self.smooth, route, None if centres is None else read_places)
            places = found[0] if found else None
            # l2norm(W_loc (a_j / |a_j| - t_j)^2 + b) into the word nodes, by this device's route
            route = words_kernels.word_route(regions.device, low, dim, self.node_dim)
            words_kernels.word_nodes(attn, r_low, w_low.view(n_cap * n_words, dim), *layers["sim_tranloc_w"],
                                     out=nodes[:, :, n_nodes - n_words:], route=route)
            masks.append(word_mask)
        return nodes, torch.cat(masks, dim=1), places
