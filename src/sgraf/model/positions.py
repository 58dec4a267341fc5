"""Where each region lies: position terms of the image encoder (issue 21; not in the paper).

SGRAF, like SCAN, treats an image as an unordered set of region features: swap two objects and
the set barely changes, so "a red square left of a blue circle" and "a blue circle left of a red
square" score alike. These modules give the image encoder each region's box, normalised to
[0, 1] of its picture ((n_img, K, 4): x1, y1, x2, y2; `sgraf.data.boxes`):

- `BoxEmbedding` ('box'): an MLP of the box's geometry added to the region's embedding, the
  absolute position term of PFAN (Wang et al. 2019).
- `RegionRelation` ('relation'): one light self-attention layer over the regions whose logits
  carry a learned bias from each pair's relative geometry (offsets of centres, log ratios of
  sizes), added residually: each region's feature then says what lies left, right, above or
  below it, so the relation lives between two regions rather than in absolute places.

Both are permutation-equivariant: permuting regions together with their boxes permutes the
region embeddings. A score is then unchanged but for the authors' visual self-attention
(`VisualSelfAttention`), whose BatchNorm keeps running statistics per region slot: a trained
model, with or without positions, scores a permuted image differently (up to about 0.02 for tiny
models; the authors' model too: to that BatchNorm their regions are an ordered list).
"""

from __future__ import annotations

import math

import torch
from torch import nn

BOX_FEATURES = 7        # x1, y1, x2, y2, width, height, area
BOX_HIDDEN = 64         # hidden units of the box MLP
PAIR_FEATURES = 6       # dx, dy, |dx|, |dy| of centres, log width and height ratios
PAIR_HIDDEN = 32        # hidden units of the pairwise geometry MLP
RELATION_HEADS = 4
PLACE_GAIN = 30.0        # the place term's directions D are 30 x a linear map: they learn 30x faster
OBJECTNESS_GAIN = 10.0   # and each word's objectness logit 10 x one: it learns which words are objects 10x faster
_WEIGHT_FLOOR = 1e-6     # no word before (or after) a word: its side weighs nothing
_SIZE_FLOOR = 1e-3      # a zero-width box (a point) still has a finite log size ratio


def check_normalised_boxes(boxes: torch.Tensor, where: str = "boxes", first_row: int = 0) -> None:
    """InputError naming the image and the region of the first box of (n, K, 4) `boxes` that is
    not finite, has x2 < x1 or y2 < y1, or lies outside [0, 1] (pixel boxes, not divided by the
    picture's size); the one rule of `SGRAF.score` and `Matcher`. Reads the device once."""
    from sgraf.errors import InputError

    x1, y1, x2, y2 = boxes.unbind(-1)
    problems = ((~torch.isfinite(boxes).all(dim=-1), "is not finite"),
                ((x2 < x1) | (y2 < y1), "has x2 < x1 or y2 < y1"),
                ((boxes < 0).any(dim=-1) | (boxes > 1).any(dim=-1), "lies outside [0, 1]"))
    bad = torch.stack([problem for problem, _ in problems])               # (3, n, K)
    if not bool(bad.any()):
        return
    for problem, (_, what) in zip(bad, problems):
        if bool(problem.any()):
            image, region = (int(v) for v in problem.nonzero()[0])
            box = ", ".join(f"{v:.4g}" for v in boxes[image, region].tolist())
            raise InputError(f"{where}: the box of image {first_row + image}, region {region} [{box}] {what}; "
                             "expected x1 <= x2, y1 <= y2 normalised to [0, 1] of the picture")


def box_geometry(boxes: torch.Tensor) -> torch.Tensor:
    """(n, K, 4) normalised x1, y1, x2, y2 -> (n, K, 7): the box, its width, height and area."""
    width = boxes[..., 2] - boxes[..., 0]
    height = boxes[..., 3] - boxes[..., 1]
    return torch.cat([boxes, width.unsqueeze(-1), height.unsqueeze(-1), (width * height).unsqueeze(-1)], dim=-1)


def pair_geometry(boxes: torch.Tensor) -> torch.Tensor:
    """(n, K, 4) normalised boxes -> (n, K, K, 6): region j relative to region i at [i, j].

    dx, dy of the centres (positive: j right of / below i), their magnitudes, and the log
    ratios of widths and heights.
    """
    centre = (boxes[..., :2] + boxes[..., 2:]) / 2                        # (n, K, 2)
    size = (boxes[..., 2:] - boxes[..., :2]).clamp_min(_SIZE_FLOOR)       # (n, K, 2)
    offset = centre.unsqueeze(1) - centre.unsqueeze(2)                    # (n, K, K, 2): j - i
    ratio = size.log().unsqueeze(1) - size.log().unsqueeze(2)             # (n, K, K, 2)
    return torch.cat([offset, offset.abs(), ratio], dim=-1)


class BoxEmbedding(nn.Module):
    """An MLP of each region's box geometry, in the joint space: (n, K, 4) -> (n, K, d)."""

    def __init__(self, embed_size: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(BOX_FEATURES, BOX_HIDDEN), nn.ReLU(), nn.Linear(BOX_HIDDEN, embed_size))

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        return self.mlp(box_geometry(boxes))


def box_centres(boxes: torch.Tensor) -> torch.Tensor:
    """(..., 4) normalised x1, y1, x2, y2 -> (..., 2) centres x, y."""
    return (boxes[..., :2] + boxes[..., 2:]) / 2


class PlaceTerm(nn.Module):
    """The place term of the similarity stage ('place'): the offset between the places two words
    read, scored against the relation word between them.

    Where a word's object lies: SCAN's text-to-image attention (Eq. 3, the attention its
    similarity node reads) weighs the regions, and the word reads the place
    p_t = sum_r attn_{t,r} c_r, with c_r region r's centre in [0, 1]^2 of the picture.

    What the sentence says of places: each word r gives a direction D_r (a linear map of its
    contextual embedding, 2-d) and each word t an objectness o_t in (0, 1) (a sigmoid of one).
    A relation word compares what comes after it with what comes before it, as English spatial
    phrases read ("X left of Y", "X is under Y"):

        term = sum_r D_r . (P_after(r) - P_before(r)),
        P_before(r) = sum_{t < r} o_t p_t / sum_{t < r} o_t   (and P_after over t > r).

    "left" learns D = (+a, 0): the term is high when what follows "left of" lies right of what
    precedes it, on any picture and for any pair of objects. Being linear in the places, the term
    is sum_u e_u . (p_u - 1/2) with per-word weights e = (A - B)^T D of the caption alone
    (`word_directions`), so it costs one (K x 2) product per word and pair. The term is added to
    every head's logit before the sigmoid. D starts at zero: a new model scores exactly as the
    same model without the term; D is scaled by `PLACE_GAIN` so that it learns at the speed of the
    rest of the model, and the objectness logits by `OBJECTNESS_GAIN`, so that the places of the
    objects soon outweigh those of "a", "of" or "the" (whose attention spreads over the picture).

    As a penalty (`penalty`, `ModelConfig.place_penalty`) the term's value is min(term, 0): a
    stated relation lowers a caption where it is false and raises none where it holds, so it no
    longer lifts "a red square left of a blue circle" on the picture whose square is green. Its
    gradient stays the signed term's (straight-through), so the relation words still learn from
    the pairs where their relation holds (with min(term, 0) in training too they barely learnt).
    """

    def __init__(self, embed_size: int, penalty: bool = False) -> None:
        super().__init__()
        self.relation = nn.Linear(embed_size, 2)      # D_r
        self.objectness = nn.Linear(embed_size, 1)    # o_t before the sigmoid
        self.penalty = penalty

    def reset_parameters(self) -> None:
        """The model's initialisation: D = 0 (no term) and objectness 1/2 for every word."""
        for layer in (self.relation, self.objectness):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def word_directions(self, words: torch.Tensor, word_mask: torch.Tensor) -> torch.Tensor:
        """(n_cap, L, d) contextual words, (n_cap, L) mask -> (n_cap, L, 2) weights e_u of the
        words' places: e = (A - B)^T D, zero for padded words."""
        mask = word_mask.to(words.dtype)
        relation = self.relation(words).mul(PLACE_GAIN) * mask.unsqueeze(2)              # (n_cap, L, 2) D_r
        weight = torch.sigmoid(self.objectness(words).mul(OBJECTNESS_GAIN)).squeeze(2) * mask  # (n_cap, L) o_t
        order = torch.arange(words.size(1), device=words.device)
        before = (order.unsqueeze(1) > order.unsqueeze(0)).to(words.dtype)                # [r, t]: t before r
        weight = weight.unsqueeze(1)                                                     # (n_cap, 1, L_t)
        b = weight * before
        a = weight * before.t()                                                          # [r, u]: u after r
        b = b / (b.sum(dim=2, keepdim=True) + _WEIGHT_FLOOR)
        a = a / (a.sum(dim=2, keepdim=True) + _WEIGHT_FLOOR)
        return (a - b).transpose(1, 2) @ relation                                        # (n_cap, L_u, 2)

    @staticmethod
    def places(attn: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, L, K) each word's attention over the regions (`similarity.region_attention`),
        (n_img, K, 2) centres -> (n_img, n_cap, L, 2) the place each word reads."""
        n_img, n_cap, n_words, n_regions = attn.shape
        return (attn.reshape(n_img, n_cap * n_words, n_regions) @ centres).view(n_img, n_cap, n_words, 2)

    def forward(self, attn: torch.Tensor, centres: torch.Tensor, words: torch.Tensor,
                word_mask: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, L, K) attention, (n_img, K, 2) centres, (n_cap, L, d) words (zero beyond
        each length), (n_cap, L) mask -> (n_img, n_cap) float32 logits, computed in float32."""
        words = words.float()
        return self.term(self.places(attn.float(), centres.float()), self.word_directions(words, word_mask))

    def term(self, places: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, L, 2) places, (n_cap, L, 2) `word_directions` -> (n_img, n_cap) the term
        added to the logits: the signed `logits`, or as a penalty their value min(term, 0) with
        the signed term's gradient."""
        term = self.logits(places, directions.float())
        return term - term.clamp_min(0).detach() if self.penalty else term

    def value_shares(self, shares: torch.Tensor) -> torch.Tensor:
        """(..., L) `word_shares` -> each word's share of the term's value: as they are, or as a
        penalty zero where they sum to more than 0 (the term adds nothing there)."""
        if not self.penalty:
            return shares
        return shares * (shares.sum(dim=-1, keepdim=True) <= 0).to(shares.dtype)

    @staticmethod
    def word_shares(places: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, L, 2) places, (n_cap, L, 2) `word_directions` -> (n_img, n_cap, L) each
        word's share e_u . (p_u - 1/2) of the term."""
        return ((places - 0.5) * directions.unsqueeze(0)).sum(dim=3)

    @staticmethod
    def logits(places: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """(n_img, n_cap, L, 2) places, (n_cap, L, 2) `word_directions` -> (n_img, n_cap) terms."""
        return PlaceTerm.word_shares(places, directions).sum(dim=2)


class RegionRelation(nn.Module):
    """Self-attention over regions with a learned bias from pairwise geometry, added residually.

    logits[h, i, j] = q_h(r_i) . k_h(r_j) / sqrt(d_h) + g_h(geometry of j relative to i), where
    g is a small MLP; out_i = r_i + W_o [sum_j softmax_j(logits[h, i, :]) v_h(r_j)]_h.
    """

    def __init__(self, embed_size: int, heads: int = RELATION_HEADS) -> None:
        super().__init__()
        if embed_size % heads:
            heads = 1
        self.heads = heads
        self.qkv = nn.Linear(embed_size, 3 * embed_size)
        self.out = nn.Linear(embed_size, embed_size)
        self.geometry = nn.Sequential(nn.Linear(PAIR_FEATURES, PAIR_HIDDEN), nn.ReLU(), nn.Linear(PAIR_HIDDEN, heads))

    def forward(self, regions: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """(n, K, d) regions, (n, K, 4) boxes -> (n, K, d)."""
        n, k, d = regions.shape
        head_dim = d // self.heads
        q, key, v = self.qkv(regions).view(n, k, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)  # (n, H, K, dh)
        bias = self.geometry(pair_geometry(boxes).to(regions.dtype)).permute(0, 3, 1, 2)          # (n, H, K, K)
        logits = q @ key.transpose(-1, -2) / math.sqrt(head_dim) + bias
        mixed = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, k, d)                    # (n, K, d)
        return regions + self.out(mixed)
