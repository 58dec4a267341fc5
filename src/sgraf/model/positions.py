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
region embeddings and leaves every score unchanged.
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
_SIZE_FLOOR = 1e-3      # a zero-width box (a point) still has a finite log size ratio


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
