"""The word nodes of a scoring block (`sgraf.kernels.words`): the eager route held to the
paper's formula, the fused Triton kernel held to the eager route (on the CPU through Triton's
interpreter, where Triton is installed; on a GPU in tests/test_gpu.py), and the route choice."""

from __future__ import annotations

import pytest
import torch

from hopper import HOPPER_SHARED_BYTES, compile_tiles, shared_bytes, spills
from interpreted import TESTS, interpreted, needs_triton
from numerics import REORDERED, assert_close, largest
from sgraf.kernels import fused_routes, plan, words

pytestmark = pytest.mark.numeric


def reference(attn, regions, words_, weight, bias, n_cap):
    """Eq. 1-2 in float64, one (image, word) at a time in spirit: l2norm(W (a - t)^2 + b)."""
    contexts = attn.double().transpose(1, 2) @ regions.double()            # (n_img, rows, d)
    local = (contexts - words_.double()).square() @ weight.double().t() + bias.double()
    local = local / (local.norm(dim=-1, keepdim=True) + words.EPS)
    return local.view(attn.size(0), n_cap, -1, weight.size(0))


def test_the_eager_route_computes_the_word_nodes_into_a_strided_slice():
    attn, regions, words_, weight, bias, out = words.probe(torch.device("cpu"), torch.float32, 24, 16)
    assert not out.is_contiguous()                        # the word slice of a node tensor
    before = out._base.clone() if out._base is not None else None
    words.word_nodes(attn, regions, words_, weight, bias, out, "eager")
    expected = reference(attn, regions, words_, weight, bias, out.size(1))
    assert_close(out, expected, REORDERED, scale=largest(expected))
    if before is not None:                                # the global nodes in front are untouched
        assert torch.equal(out._base[:, :, 0].nan_to_num(), before[:, :, 0].nan_to_num())


FUSED_CHECK = r"""
import json, sys, torch
from sgraf.kernels import words
dtype = getattr(torch, sys.argv[1])
results = {}
# features not a multiple of the kernel's 32, rows past one tile of 64 (117 and 70 rows)
for dim, width, block in [(48, 16, (2, 9, 13)), (64, 24, (3, 70, 1))]:   # widths: a tile, part of one
    attn, regions, wrds, weight, bias, out = words.probe(torch.device("cpu"), dtype, dim, width, seed=dim, block=block)
    eager = torch.full_like(out, float("nan"))
    words.word_nodes(attn, regions, wrds, weight, bias, eager, "eager")
    for route in ("fused 32x64x4x2", "fused"):   # another of the probe's tiles, then the default one
        out._base.fill_(float("nan"))
        out._base[:, :, 0].fill_(7.0)
        words.word_nodes(attn, regions, wrds, weight, bias, out, route)
        if route != "fused":
            other = out.clone()
    contexts = attn.double().transpose(1, 2) @ regions.double()
    local = (contexts - wrds.double()).square() @ weight.double().t() + bias.double()
    exact = (local / (local.norm(dim=-1, keepdim=True) + words.EPS)).view(out.shape)
    results[f"{dim}x{width}"] = {
        "written": bool(torch.isfinite(out).all()), "front_kept": bool((out._base[:, :, 0] == 7.0).all()),
        "max_diff": float((out.float() - eager.float()).abs().max()), "largest": float(eager.float().abs().max()),
        "fused_error": float((out.double() - exact).abs().max()),
        "eager_error": float((eager.double() - exact).abs().max()),
        "tiles_apart": float((other.float() - out.float()).abs().max())}
# the global nodes (the attention left out): captions past a tile of 64 rows, features not a
# multiple of 32, a width of part of a tile
generator = torch.Generator().manual_seed(3)
img_glo, cap_glo = torch.randn(3, 48, generator=generator) * 0.1, torch.randn(70, 48, generator=generator) * 0.1
weight, bias = (torch.randn(24, 48, generator=generator) * 48 ** -0.5).to(dtype), (torch.randn(24) * 0.01).to(dtype)
eager = words.global_nodes(img_glo, cap_glo, weight, bias, "eager")
fused, other = (words.global_nodes(img_glo, cap_glo, weight, bias, route) for route in ("fused", "fused 32x64x4x2"))
local = (img_glo.double()[:, None] - cap_glo.double()[None]).square() @ weight.double().t() + bias.double()
exact = local / (local.norm(dim=-1, keepdim=True) + words.EPS)
results["global"] = {
    "shape": list(fused.shape), "dtype": str(fused.dtype), "written": bool(torch.isfinite(fused).all()),
    "max_diff": float((fused.float() - eager.float()).abs().max()), "largest": float(eager.float().abs().max()),
    "fused_error": float((fused.double() - exact).abs().max()),
    "eager_error": float((eager.double() - exact).abs().max()),
    "tiles_apart": float((other.float() - fused.float()).abs().max())}
print(json.dumps(results))
"""


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_kernel_gives_the_eager_route_through_tritons_interpreter(dtype):
    results = interpreted(FUSED_CHECK, dtype)
    agreement = fused_routes.AGREEMENT[getattr(torch, dtype)]     # what the route's probe asks of it
    assert all(case["max_diff"] <= agreement * case["largest"] for case in results.values()), results
    glob = results.pop("global")
    assert glob["shape"] == [3, 70, 24] and glob["dtype"] == f"torch.{dtype}" and glob["written"], glob
    if dtype == "float32":
        assert glob["max_diff"] <= 1e-5 * glob["largest"] and glob["tiles_apart"] <= 1e-5 * glob["largest"], glob
    else:    # as the word nodes below: the interpreter truncates where a GPU rounds
        assert glob["fused_error"] <= glob["eager_error"] + 2 * 2 ** -8 * glob["largest"], glob
        assert glob["tiles_apart"] <= 2 ** -8 * glob["largest"], glob
    for case in results.values():
        assert case["written"] and case["front_kept"], results
        if dtype == "float32":   # the same values up to the accumulation order, whatever the tile
            assert case["max_diff"] <= 1e-5 and case["tiles_apart"] <= 1e-5, results
        else:
            # Triton's interpreter truncates float32 to bf16 where a GPU rounds to nearest (494 of
            # 1,024 uniform values differ from PyTorch's rounding), so here bf16 is held to the
            # eager route's error from float64 plus a truncation's two units in the last place of
            # the largest node; tests/test_gpu.py holds the device's rounding to the eager route
            assert case["fused_error"] <= case["eager_error"] + 2 * 2 ** -8 * case["largest"], results
            assert case["tiles_apart"] <= 2 ** -8 * case["largest"], results


GOLDEN_THROUGH_FUSED = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from model_helpers import DATA, golden_model
from sgraf.kernels import words
words.fusable = lambda device: True          # the interpreter stands in for a device
kernel, calls = words._fused, []
words._fused = lambda attn, *args: calls.append(attn is None) or kernel(attn, *args)
results = {}
for module in ("SGR", "SAF"):
    entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)[module]
    model = golden_model(entry, module)
    os.environ["SGRAF_WORD_ROUTE"] = "fused"
    scores = model.score(entry["images"], entry["captions"], entry["lengths"])
    results[module] = float((scores - entry["sims"]).abs().max())
results["calls"] = {"global nodes": sum(calls), "word nodes": len(calls) - sum(calls)}
print(json.dumps(results))
"""


@needs_triton
def test_the_golden_scores_through_the_fused_route():
    """The model's scorer with the word nodes and the global nodes from the kernel (Triton's
    interpreter on the CPU) gives the authors' golden scores, as the eager route does
    (tests/test_model_golden.py)."""
    results = interpreted(GOLDEN_THROUGH_FUSED, TESTS)
    assert all(count > 0 for count in results.pop("calls").values()), results   # both through the kernel
    for module, difference in results.items():
        assert difference <= 1e-6, (module, difference)


def test_the_cpu_takes_the_eager_route_without_measuring(tuning_cache):
    assert not words.fusable("cpu")
    assert words.measure_word_route("cpu", torch.float32, 1024, 256) == "eager"
    assert words.word_route("cpu", torch.bfloat16, 1024, 256) == "eager"
    with plan.emulate_gpu():
        assert words.word_route("cpu", torch.float32, 1024, 256) == "eager"
    assert not tuning_cache.exists()                             # nothing measured, nothing stored


@needs_triton
@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_every_float32_tile_the_probe_times_fits_a_hoppers_shared_memory(precision):
    """No GPU needed: each float32 tile the probe may time (`words.FLOAT32_ROUTE`), exact and under
    TF32, with and without the global nodes, takes at most the 232,448 bytes of shared memory an
    H100/H200 gives a block; 64x64x8x3, left out, takes more under TF32 (its launch had failed on
    the device, the probe storing an infinite time)."""
    constants = dict(DIM=1024, REGIONS=64, WIDTH=256, WIDTH_TILE=256, EPSILON=words.EPS, WIDEN=False,
                     PRECISION=precision)
    pointers = {"attn": "*fp32", **{name: "*fp32" for name in ("regions", "words", "weight", "bias", "out")}}
    kernel = words._kernel()
    for rows, features, warps, stages in words.FLOAT32_ROUTE.tiles:
        for glob in (False, True):
            taken = shared_bytes(kernel, {**constants, "ROWS": rows, "FEATURES": features, "GLOBAL": glob},
                                 pointers, warps, stages)
            assert taken <= HOPPER_SHARED_BYTES, (rows, features, warps, stages, glob, precision, taken)
    left_out = [tile for tile in words.TILES if tile not in words.FLOAT32_ROUTE.tiles]
    assert left_out == [(64, 64, 8, 3)]
    if precision == "tf32":
        rows, features, warps, stages = left_out[0]
        assert shared_bytes(kernel, {**constants, "ROWS": rows, "FEATURES": features, "GLOBAL": False},
                            pointers, warps, stages) > HOPPER_SHARED_BYTES


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_fused_kernel_compiles_for_hopper_without_spilling(dtype):
    """No GPU needed: Triton compiles the kernel for sm_90 at the paper's sizes, with each tile
    the probe may pick, and in bf16 the `ptxas -v` Triton runs reports no register spills (tiles
    of 64 rows run their products on wgmma). float32 (exact, on CUDA cores) only has to compile:
    Triton 3.9 spills a few bytes of its first tile, 3.6 none. The global nodes' variant (float32
    global vectors, no attention) with each tile too, in bf16."""
    constants = dict(DIM=1024, REGIONS=64, WIDTH=256, WIDTH_TILE=256, EPSILON=words.EPS, WIDEN=False,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")
    pointers = {"attn": "*fp32", **{name: f"*{dtype}" for name in ("regions", "words", "weight", "bias", "out")}}
    tiles = words.TILES if dtype == "bf16" else words.TILES[:1]
    variants = [(tile, False) for tile in tiles] + [(tile, True) for tile in (tiles if dtype == "bf16" else [])]
    kernel = words._kernel()
    built = compile_tiles(kernel, constants, pointers, [tile for tile, _ in variants[:len(tiles)]],
                          lambda tile: ({"ROWS": tile[0], "FEATURES": tile[1], "GLOBAL": False}, *tile[2:]))
    if dtype == "bf16":
        built += compile_tiles(kernel, {**constants, "REGIONS": 16},
                               {**pointers, "regions": "*fp32", "words": "*fp32"}, tiles,
                               lambda tile: ({"ROWS": tile[0], "FEATURES": tile[1], "GLOBAL": True}, *tile[2:]))
    for ((rows, features, warps, stages), glob), (ptx, report) in zip(variants, built):
        spilled = spills(report)
        assert spilled, report
        if dtype == "bf16":
            # the tiles that run on the tensor cores: nothing spilled (Triton 3.6 and 3.9)
            assert spilled == [0] * len(spilled), (rows, features, warps, stages, glob, report)
            if rows >= 64:   # a warp group's matmul takes 64 rows
                assert "wgmma" in ptx, (rows, features, glob)
