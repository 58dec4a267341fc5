"""SAF's attention filtration of an eval scoring block (`sgraf.kernels.filtration`): the eager
route held to the model's `AttentionFiltration` (Eq. 9, BatchNorm in eval mode), the Triton
kernel held to the eager route through Triton's interpreter (on a GPU in tests/test_gpu.py), and
the kernel compiled for an H100. Its route choice is tested with the other kernels'
(tests/test_fused_routes.py)."""

from __future__ import annotations

import pytest
import torch

from hopper import compile_tiles, spills
from interpreted import TESTS, interpreted, needs_triton
from numerics import REORDERED, assert_close, largest
from sgraf.kernels import filtration, plan
from sgraf.model.filtration import AttentionFiltration

pytestmark = pytest.mark.numeric


def folded_batch_norm(saf: AttentionFiltration) -> tuple[torch.Tensor, torch.Tensor]:
    """The eval BatchNorm as `scale * logit + shift` (as `SGRAF.fast_head_scores` folds it)."""
    bn = saf.bn
    scale = (bn.running_var + bn.eps).rsqrt() * bn.weight
    return scale, bn.bias - bn.running_mean * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_route_is_the_models_attention_filtration(dtype):
    """Against `AttentionFiltration` in eval mode, in float64, with BatchNorm statistics and
    affine parameters away from their defaults and a third of the captions a node shorter."""
    nodes, node_mask, *_ = filtration.probe(torch.device("cpu"), dtype, 24, block=(3, 7, 9))
    torch.manual_seed(0)
    saf = AttentionFiltration(24).double().eval()
    with torch.no_grad():
        for tensor in (saf.attn_sim_w.weight, saf.attn_sim_w.bias, saf.bn.weight, saf.bn.bias, saf.bn.running_mean):
            tensor.copy_(torch.randn_like(tensor))
        saf.bn.running_var.fill_(2.5)
        expected = saf(nodes.double(), node_mask)
        scale, shift = (t.float() for t in folded_batch_norm(saf))
        pooled = filtration.filtered(nodes, node_mask, saf.attn_sim_w.weight.float(), saf.attn_sim_w.bias.float(),
                                     scale, shift, "eager")
    assert pooled.dtype == torch.float32 and pooled.shape == (3, 7, 24)
    assert_close(pooled, expected, REORDERED, scale=largest(expected))


def test_the_kernel_takes_pairs_of_at_most_64_x_256_values_and_sizes_its_tiles_by_them():
    assert filtration.applies("fused", 14, 256) and filtration.applies("fused 8x4x1", 64, 256)
    assert filtration.applies("fused", 33, 200)                          # padded to 64 x 256
    assert not filtration.applies("fused", 65, 256) and not filtration.applies("fused", 14, 2048)
    assert not filtration.applies("eager", 14, 256)
    assert filtration.launch((4, 4, 1), 16, 256) == (4, 4, 1)          # a tile's own size
    assert filtration.launch((8, 4, 2), 32, 256) == (4, 4, 2)          # twice the values: half the pairs
    assert filtration.launch((4, 4, 1), 64, 256) == (1, 8, 1)          # four times: a pair, 8 warps
    assert filtration.launch((2, 8, 1), 16, 32) == (2, 8, 1)


def test_the_cpu_takes_the_eager_route_without_measuring(tuning_cache):
    assert filtration.measure_filter_route("cpu", torch.bfloat16, 256) == "eager"
    with plan.emulate_gpu():
        assert filtration.filter_route("cpu", torch.float32, 256) == "eager"
    assert not tuning_cache.exists()


FUSED_CHECK = r"""
import json, torch
from sgraf.kernels import filtration
results = {}
# every tile on nodes and features not powers of two (9 of 24: padded to 16 x 32) and pairs past a
# tile's (3 x 5 = 15); then the default tile in both dtypes on 14 nodes of 256 (the paper's), on 33
# (padded to 64: a pair per program, 8 warps), and on nodes that are a strided view
cases = [(torch.float32, 24, (3, 5, 9), filtration.MEASURED[1:])] + [
    (dtype, 256, (2, 5, 14), ["fused"]) for dtype in (torch.float32, torch.bfloat16)] + [
    (torch.bfloat16, 256, (1, 3, 33), ["fused", "fused 8x4x1"])]
for dtype, dim, block, routes in cases:
    inputs = filtration.probe(torch.device("cpu"), dtype, dim, seed=block[2], block=block)
    eager = filtration.filtered(*inputs, route="eager")
    for route in routes:
        fused = filtration.filtered(*inputs, route=route)
        results[f"{dtype}, {dim}, {block}, {route}"] = {
            "finite": bool(torch.isfinite(fused).all()), "shape": list(fused.shape), "expected": [*block[:2], dim],
            "max_diff": float((fused - eager).abs().max()), "largest": float(eager.abs().max())}
nodes, *rest = filtration.probe(torch.device("cpu"), torch.float32, 32, seed=1, block=(2, 4, 7))
wide = torch.zeros(2, 4, 7, 48)
wide[..., 8:40] = nodes
view = wide[..., 8:40]                                   # the last dim contiguous, the others strided
fused, eager = filtration.filtered(view, *rest, route="fused"), filtration.filtered(nodes, *rest, route="eager")
results["strided"] = {"finite": bool(torch.isfinite(fused).all()), "shape": list(fused.shape), "expected": [2, 4, 32],
                      "max_diff": float((fused - eager).abs().max()), "largest": float(eager.abs().max())}
print(json.dumps(results))
"""


@needs_triton
def test_the_fused_kernel_gives_the_eager_route_through_tritons_interpreter():
    """Every tile, float32 and bf16 nodes: after the load the kernel works in float32 as the eager
    route does, so the two agree to the summation order (the interpreter runs each program in
    Python: the cases are few and small)."""
    results = interpreted(FUSED_CHECK)
    assert len(results) == len(filtration.TILES) + 5
    for case, result in results.items():
        assert result["finite"] and result["max_diff"] <= 1e-6 * result["largest"], (case, result)
        assert result["shape"] == result["expected"], (case, result)


GOLDEN_THROUGH_FUSED = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from model_helpers import DATA, golden_model
from sgraf.kernels import filtration
filtration.fusable = lambda device: True          # the interpreter stands in for a device
kernel, calls = filtration._fused, []
filtration._fused = lambda *args: calls.append(1) or kernel(*args)
os.environ["SGRAF_FILTER_ROUTE"] = "fused"
entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)["SAF"]
scores = golden_model(entry, "SAF").score(entry["images"], entry["captions"], entry["lengths"])
print(json.dumps({"SAF": float((scores - entry["sims"]).abs().max()), "kernel_calls": len(calls)}))
"""


@needs_triton
def test_the_golden_scores_through_the_fused_filtration():
    """The model's scorer with SAF's filtration from the kernel (Triton's interpreter on the CPU)
    gives the authors' golden scores, as the eager route does (tests/test_model_golden.py)."""
    results = interpreted(GOLDEN_THROUGH_FUSED, TESTS)
    assert results["kernel_calls"] > 0, results            # the scorer took the kernel
    assert results["SAF"] <= 1e-6, results


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_tile_compiles_for_an_h100_without_spilling_registers(dtype):
    """In bf16 each tile for pairs of 16 nodes of 256 features (the paper's captions), and each
    tile as `launch` adjusts it for 64 nodes (the largest the kernel takes; the tiles come down to
    two); in float32 the first tile (the same code but for the load): `ptxas -v` for sm_90
    reports no register spills."""
    pointers = {"nodes": f"*{dtype}", "mask": "*u8", "weight": "*fp32", "bias": "*fp32", "scale": "*fp32",
                "shift": "*fp32", "out": "*fp32"}
    values = dict(DIM=256, EPSILON=filtration.EPS)
    tiles = filtration.TILES if dtype == "bf16" else filtration.TILES[:1]
    cases = sorted({(nodes, filtration.launch(tile, nodes, 256)) for tile in tiles
                    for nodes in ((16, 64) if dtype == "bf16" else (16,))})
    assert len(cases) == (len(filtration.TILES) + 2 if dtype == "bf16" else 1)

    def launch(case: tuple[int, tuple[int, int, int]]) -> tuple[dict, int, int]:
        nodes, (pairs, warps, stages) = case
        return {"NODES": nodes, "PAIRS": pairs}, warps, stages

    built = compile_tiles(filtration._kernel(), values, pointers, cases, launch)
    for case, (_, report) in zip(cases, built):
        spilled = spills(report)
        assert spilled and spilled == [0] * len(spilled), (case, report)
