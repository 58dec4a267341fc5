"""Sec. 3.1: image and text encoders and the self-attention global vectors.

Sub-module attribute names follow the authors' state dicts (`fc`, `embed`, `cap_rnn`,
`embedding_local`, ...), so their checkpoints load by a prefix change only.
"""

from __future__ import annotations

import torch
from torch import nn

from sgraf.kernels import gru, plan
from sgraf.kernels.cpu import TrainLinear
from sgraf.kernels.packing import Packing
from sgraf.model.norms import l2norm
from sgraf.model.positions import BoxEmbedding, RegionRelation, box_centres
from sgraf.precision import rnn_like_matmul


class ImageEncoder(nn.Module):
    """FC from region features to the joint space, then l2-normalised per region.

    With `positions` other than 'none' (`sgraf.model.positions`; not in the paper) the regions'
    boxes enter before the normalisation: 'box' adds an embedding of each box to its region,
    'relation' also mixes the regions by self-attention with a pairwise geometry bias.
    """

    def __init__(self, img_dim: int, embed_size: int, normalize: bool = True, positions: str = "none") -> None:
        super().__init__()
        self.fc = TrainLinear(img_dim, embed_size)
        self.normalize = normalize
        self.positions = positions
        if positions != "none":
            self.box_embed = BoxEmbedding(embed_size)
        if positions == "relation":
            self.relation = RegionRelation(embed_size)

    def forward(self, images: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """(n_img, K, img_dim), boxes (n_img, K, 4) in [0, 1] or None -> (n_img, K, d)."""
        regions = self.fc(images)
        if self.positions != "none":
            if boxes is None:
                raise ValueError(f"this model (positions={self.positions!r}) needs each region's box; got none")
            boxes = boxes.to(regions.dtype)
            regions = regions + self.box_embed(boxes)
            if self.positions == "relation":
                regions = self.relation(regions, boxes)
        regions = l2norm(regions) if self.normalize else regions
        if self.positions == "place":
            regions = torch.cat([regions, box_centres(boxes)], dim=-1)
        return regions


class TextEncoder(nn.Module):
    """Word embedding -> dropout -> bi-GRU, halves averaged, l2-normalised per word."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, num_layers: int,
                 bi_gru: bool = True, normalize: bool = True, dropout: float = 0.4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.dropout = nn.Dropout(dropout)
        self.cap_rnn = nn.GRU(word_dim, embed_size, num_layers, batch_first=True, bidirectional=bi_gru)
        self.bi_gru = bi_gru
        self.normalize = normalize

    def forward(self, captions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(n_cap, L) ids, (n_cap,) lengths in any order -> (n_cap, max(lengths), d), zero-padded."""
        words = self.dropout(self.embed(captions))
        packing = Packing(lengths, words.device)   # pack_padded_sequence's order, one gather
        packed = packing.pack(words)
        if torch.is_grad_enabled() and gru.supports(self.cap_rnn, packed.data):
            # training on the CPU: the weight gradients in one matmul each (sgraf.kernels.gru)
            out = gru.packed_gru(self.cap_rnn, packed.data, packing.batch_sizes.tolist())
        else:
            with rnn_like_matmul(words.device):   # cuDNN would run it in TF32 by default
                out = self.cap_rnn(packed)[0].data
        states = packing.unpack(out)               # (n_cap, max_len, d or 2d), zero-padded
        if self.bi_gru:
            half = states.size(2) // 2
            states = (states[:, :, :half] + states[:, :, half:]) / 2
        return l2norm(states) if self.normalize else states


class VisualSelfAttention(nn.Module):
    """Global image vector: regions weighted by attention to their mean (appendix figure).

    The local branch's BatchNorm1d has the K region slots as channels, as in the authors' code.
    """

    def __init__(self, embed_size: int, num_regions: int, dropout: float = 0.4) -> None:
        super().__init__()
        self.embedding_local = nn.Sequential(TrainLinear(embed_size, embed_size), nn.BatchNorm1d(num_regions),
                                             nn.Tanh(), nn.Dropout(dropout))
        self.embedding_global = nn.Sequential(TrainLinear(embed_size, embed_size), nn.BatchNorm1d(embed_size),
                                              nn.Tanh(), nn.Dropout(dropout))
        self.embedding_common = nn.Sequential(nn.Linear(embed_size, 1))

    def forward(self, regions: torch.Tensor) -> torch.Tensor:
        """(n_img, K, d) -> (n_img, d)."""
        local = self.embedding_local(regions)                          # (n_img, K, d)
        glob = self.embedding_global(regions.mean(dim=1))              # (n_img, d)
        weights = self.embedding_common(local * glob.unsqueeze(1)).squeeze(2).softmax(dim=1)  # (n_img, K)
        return l2norm((weights.unsqueeze(2) * regions).sum(dim=1))


class TextSelfAttention(nn.Module):
    """Global text vector: words weighted by attention to their mean, without BatchNorm."""

    def __init__(self, embed_size: int, dropout: float = 0.4) -> None:
        super().__init__()
        self.embedding_local = nn.Sequential(TrainLinear(embed_size, embed_size), nn.Tanh(), nn.Dropout(dropout))
        self.embedding_global = nn.Sequential(TrainLinear(embed_size, embed_size), nn.Tanh(), nn.Dropout(dropout))
        self.embedding_common = nn.Sequential(nn.Linear(embed_size, 1))

    def forward(self, words: torch.Tensor, word_mask: torch.Tensor) -> torch.Tensor:
        """(n_cap, L, d) zero-padded words, (n_cap, L) bool mask -> (n_cap, d).

        On the CPU plan the local branch's layer and tanh run over the caption's words only, not
        the padding (a Flickr30K-like batch of 128 is padded to 44 words: 1,733 of 5,632 rows),
        and its dropout over the whole (n_cap, L, d) block as before: the same random numbers
        drawn, the same values where words are, up to the matmul's summation order (the padding's
        rows are masked before the softmax). Under the GPU plan the whole block, without the
        device wait of a boolean index."""
        lengths = word_mask.sum(dim=1, keepdim=True).to(words.dtype)   # (n_cap, 1)
        if plan.gpu_plan(words.device) or bool(word_mask.all()):
            local = self.embedding_local(words)                         # (n_cap, L, d)
        else:
            layer, tanh, dropout = self.embedding_local
            projected = tanh(layer(words[word_mask]))                   # (n_words, d)
            local = dropout(projected.new_zeros(*word_mask.shape, projected.size(-1)).index_put((word_mask,),
                                                                                              projected))
        glob = self.embedding_global(words.sum(dim=1) / lengths)        # (n_cap, d)
        logits = self.embedding_common(local * glob.unsqueeze(1)).squeeze(2)
        weights = logits.masked_fill(~word_mask, float("-inf")).softmax(dim=1)  # (n_cap, L)
        return l2norm((weights.unsqueeze(2) * words).sum(dim=1))
