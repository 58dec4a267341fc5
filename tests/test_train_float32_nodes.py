"""The float32 word nodes of training (`sgraf.kernels.nodes._LocalNodes`), computed image tile by
image tile (`plan.FLOAT32_TILE_BYTES`): the values and gradients of the plain equation, whatever
the tiles, for a grid of images x captions and for aligned pairs."""

from __future__ import annotations

import pytest
import torch

from sgraf.kernels import nodes as nodes_kernels
from sgraf.kernels import plan
from sgraf.model import similarity

NAMES = ["nodes", "attn", "regions", "words", "weight", "bias"]


def _inputs(aligned: bool, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(0)
    n_img, n_cap, n_words, n_regions, dim, out = 5, 4, 6, 7, 16, 8
    attn = torch.randn(n_img, 1 if aligned else n_cap, n_words, n_regions, generator=generator).softmax(-1)
    regions = torch.randn(n_img, n_regions, dim, generator=generator)
    words = torch.randn(*((n_img, 1) if aligned else (n_cap,)), n_words, dim, generator=generator)
    weight = torch.randn(out, dim, generator=generator) / dim ** 0.5
    bias = torch.randn(out, generator=generator)
    return [t.to(dtype).requires_grad_() for t in (attn, regions, words, weight, bias)]


def _results(aligned: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The nodes before their l2 norm, then the gradients of all five inputs, for one upstream gradient."""
    inputs = _inputs(aligned, dtype)
    out = nodes_kernels.light_nodes(*inputs)
    if out is None:   # float64: the plain equation, through autograd
        attn, regions, words, weight, bias = inputs
        n_img, n_cap, n_words, n_regions = attn.shape
        context = (attn.reshape(n_img, n_cap * n_words, n_regions) @ regions).view(n_img, n_cap, n_words, -1)
        out = torch.nn.functional.linear(
            similarity.squared_difference(context, words if aligned else words.unsqueeze(0)), weight, bias)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in inputs]


@pytest.mark.parametrize("aligned", [False, True], ids=["grid", "aligned"])
@pytest.mark.parametrize("per_tile", [None, 1, 2], ids=["whole", "per-image", "two-images"])
def test_the_float32_nodes_give_the_equations_values_and_gradients_whatever_the_tiles(aligned, per_tile,
                                                                                        monkeypatch):
    attn, regions = _inputs(aligned)[:2]
    if per_tile is not None:   # bytes of one image's float32 differences, times the images per tile
        monkeypatch.setattr(plan, "FLOAT32_TILE_BYTES", per_tile * attn[0].numel() // attn.size(-1) * 16 * 4)
    assert len(nodes_kernels._float32_tiles(attn, regions)) == {None: 1, 1: 5, 2: 3}[per_tile]
    light = _results(aligned)
    reference = _results(aligned, torch.float64)   # the equation through autograd, in float64
    for name, a, b in zip(NAMES, light, reference):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


def test_tiles_change_the_float32_nodes_by_rounding_only(monkeypatch):
    whole = _results(False)
    monkeypatch.setattr(plan, "FLOAT32_TILE_BYTES", 1)
    assert len(nodes_kernels._float32_tiles(*_inputs(False)[:2])) == 5
    tiled = _results(False)
    for name, a, b in zip(NAMES, whole, tiled):
        # each image's own values are computed alike; the sums over the images (the weight's
        # and the words' gradients) add the tiles' sums: a few ulps of their largest value
        if name in ("nodes", "attn", "regions", "bias"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()), msg=name)
