"""The text-to-image attention of a scoring block (`sgraf.kernels.attention`): the eager route
held to SCAN's formula in float64, the fused Triton kernel held to the eager route (on the CPU
through Triton's interpreter; on a GPU in tests/test_gpu.py), the golden scores through it, and
its compilation for an H100."""

from __future__ import annotations

import pytest
import torch

from hopper import compile_tiles, spills
from interpreted import TESTS, interpreted, needs_triton
from numerics import REORDERED, assert_close, largest
from sgraf.kernels import attention, plan

pytestmark = pytest.mark.numeric


def reference(relevance: torch.Tensor, gram: torch.Tensor, n_words: int, smooth: float) -> torch.Tensor:
    """SCAN's attention in float64, one caption at a time: LeakyReLU, the l2 norm over the
    caption's words, the softmax over the regions at lambda, each word's column divided by the
    norm of its attended context (from the Gram matrix) plus eps."""
    n_img, n_regions, n_rows = relevance.shape
    columns = []
    for start in range(0, n_rows, n_words):
        r = torch.nn.functional.leaky_relu(relevance[:, :, start:start + n_words].double(), 0.1)
        r = r / (r.norm(dim=2, keepdim=True) + attention.EPS)
        attn = (r * smooth).softmax(dim=1)                                        # (n_img, K, L)
        norm = torch.einsum("ikl,ikm,iml->il", attn, gram.double(), attn).sqrt()  # |attn_j^T R|
        columns.append(attn / (norm.unsqueeze(1) + attention.EPS))
    return torch.cat(columns, dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_route_is_scans_attention_scaled_by_its_contexts_norm(dtype):
    relevance, gram, n_words = attention.probe(torch.device("cpu"), dtype)
    expected = reference(relevance, gram, n_words, 9.0)
    attn = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, "eager")
    assert attn.dtype == torch.float32 and attn.shape == relevance.shape
    assert_close(attn, expected, REORDERED, scale=largest(expected))
    seen = []
    again = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, "fused",
                                       read=lambda logits, weights: seen.append(weights.clone()))
    assert torch.equal(again, attn)         # a reader takes the eager route, whatever the route asked
    unscaled = seen[0].view(3, 36, 5, n_words)
    assert torch.allclose(unscaled.sum(dim=1), torch.ones(3, 5, n_words))   # the softmax, before scaling


def test_the_kernel_applies_to_captions_of_at_most_128_words():
    assert attention.applies("fused", 13) and attention.applies("fused 64x4x1", 128)
    assert not attention.applies("fused", 129) and not attention.applies("eager", 13)


def test_the_cpu_takes_the_eager_route_without_measuring(tuning_cache):
    assert attention.measure_attention_route("cpu", torch.bfloat16) == "eager"
    with plan.emulate_gpu():
        assert attention.attention_route("cpu", torch.float32) == "eager"
    assert not tuning_cache.exists()


FUSED_CHECK = r"""
import json, sys, torch
from sgraf.kernels import attention
results = {}
# every tile on words not a power of two (6: padded to 8) and captions past a tile's (21); then the
# default tile on 13 words (16), in both dtypes, and on a caption wider than a tile of 64 columns
# (70 words: one caption per program, 128 wide)
cases = [(torch.float32, (2, 21, 6), attention.MEASURED[1:])] + [
    (dtype, (1, 11, 13), ["fused"]) for dtype in (torch.float32, torch.bfloat16)] + [
    (torch.bfloat16, (1, 3, 70), ["fused 64x4x1"])]
for dtype, block, routes in cases:
    relevance, gram, n_words = attention.probe(torch.device("cpu"), dtype, seed=block[1], block=block)
    eager = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, "eager")
    for route in routes:
        fused = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, route)
        results[f"{dtype}, {block}, {route}"] = {
            "finite": bool(torch.isfinite(fused).all()),
            "max_diff": float((fused - eager).abs().max()), "largest": float(eager.abs().max())}
print(json.dumps(results))
"""


@needs_triton
def test_the_fused_kernel_gives_the_eager_route_through_tritons_interpreter():
    """Every tile, float32 and bf16 relevance: after the load the kernel works in float32 as the
    eager route does, so the two agree to the summation order (Triton's interpreter runs each
    program in Python: the cases are few and small)."""
    results = interpreted(FUSED_CHECK)
    assert len(results) == len(attention.TILES) + 3
    for case, result in results.items():
        assert result["finite"] and result["max_diff"] <= 1e-5 * result["largest"], (case, result)


GOLDEN_THROUGH_FUSED = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from model_helpers import DATA, golden_model
from sgraf.kernels import attention
attention.fusable = lambda device: True          # the interpreter stands in for a device
kernel, calls = attention._fused, []
attention._fused = lambda *args: calls.append(args[2]) or kernel(*args)
os.environ["SGRAF_ATTENTION_ROUTE"] = "fused"
entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)["SGR"]   # SAF's attention is the same
scores = golden_model(entry, "SGR").score(entry["images"], entry["captions"], entry["lengths"])
results = {"SGR": float((scores - entry["sims"]).abs().max()), "kernel_calls": len(calls)}
print(json.dumps(results))
"""


@needs_triton
def test_the_golden_scores_through_the_fused_attention():
    """The model's scorer with the attention from the kernel (Triton's interpreter on the CPU)
    gives the authors' golden scores, as the eager route does (tests/test_model_golden.py)."""
    results = interpreted(GOLDEN_THROUGH_FUSED, TESTS)
    assert results.pop("kernel_calls") > 0, results            # the scorer took the kernel
    for module, difference in results.items():
        assert difference <= 1e-6, (module, difference)


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_fused_attention_compiles_for_hopper_without_spilling(dtype):
    """No GPU needed: Triton compiles the kernel for sm_90 at the paper's sizes (36 regions,
    captions of 13 words padded to 16) with each tile the probe may pick, and the `ptxas -v`
    Triton runs reports no register spills."""
    pointers = {"relevance": f"*{dtype}", "gram": "*fp32", "out": "*fp32"}
    values = dict(n_regions=36, REGIONS=64, WORDS=16, EPSILON=attention.EPS)
    built = compile_tiles(attention._kernel(), values, pointers, attention.TILES,
                          lambda tile: ({"CAPTIONS": tile[0] // 16}, *tile[1:]))
    for tile, (_, report) in zip(attention.TILES, built):
        spilled = spills(report)
        assert spilled and spilled == [0] * len(spilled), (tile, report)
