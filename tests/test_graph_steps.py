"""SGR's reasoning steps of a scoring block (`sgraf.kernels.graph_steps`): the fused Triton
kernel held to the eager steps (on the CPU through Triton's interpreter, where Triton is
installed; on a GPU in tests/test_gpu.py), and the route choice."""

from __future__ import annotations

import pytest
import torch

from hopper import compile_tiles, spills
from interpreted import TESTS, interpreted, needs_triton
from sgraf.kernels import fused_routes, graph_steps, plan

pytestmark = pytest.mark.numeric

FUSED_CHECK = r"""
import json, torch
from sgraf.kernels import graph_steps as gs
results = {}
# (width, steps, (images, captions, nodes)): graphs of a power of two and not, several graphs per
# tile and a tile's last graphs missing, one graph wider than the default tile's 64 rows / 2, and
# node widths of a tile, two, and less than one (24: padded to 32, as the golden model's 8 to 16)
for dtype in (torch.float32, torch.bfloat16):
    for dim, steps, block in [(32, 3, (2, 5, 6)), (64, 2, (3, 7, 14)), (24, 3, (1, 3, 33)), (64, 1, (2, 9, 16))]:
        folded, graphs, blocked, n_cap = gs.probe(torch.device("cpu"), dtype, dim, steps, seed=dim, block=block)
        n_img = graphs.size(0) // n_cap
        before = graphs.clone()
        eager = gs.eager_steps(folded, graphs, blocked, n_img, True).double()[:, 0]
        exact = gs.eager_steps([tuple(t.double() for t in f) for f in folded], graphs.double(), blocked.double(),
                               n_img, True)[:, 0]
        fused = gs.reason(folded, graphs, blocked, n_cap, "fused").double()
        other = gs.reason(folded, graphs, blocked, n_cap, "fused 32x32x4x1").double()
        unmasked = gs.reason(folded, graphs, None, n_cap, "fused").double()
        results.setdefault(str(dtype).removeprefix("torch."), []).append({
            "case": [dim, steps, block], "finite": bool(torch.isfinite(fused).all()),
            "input_kept": bool(torch.equal(graphs, before)),
            "largest": float(exact.abs().max()), "apart": float((fused - eager).abs().max()),
            "fused_error": float((fused - exact).abs().max()), "eager_error": float((eager - exact).abs().max()),
            "tiles_apart": float((other - fused).abs().max()), "mask_effect": float((unmasked - fused).abs().max())})
print(json.dumps(results))
"""


@needs_triton
def test_the_fused_steps_give_the_eager_steps_through_tritons_interpreter():
    results = interpreted(FUSED_CHECK)
    assert sorted(results) == ["bfloat16", "float32"] and all(len(cases) == 4 for cases in results.values())
    for dtype, cases in results.items():
        for case in cases:
            assert case["finite"] and case["input_kept"], case
            assert case["mask_effect"] > 1e-3, case          # the caption's key mask is applied
            if dtype == "float32":   # the same values up to the accumulation order, whatever the tile
                assert case["apart"] <= 1e-6 * case["largest"] and case["tiles_apart"] <= 1e-6, case
            else:
                # what the route's probe asks of it
                assert case["apart"] <= fused_routes.AGREEMENT[torch.bfloat16] * case["largest"], case
                # rounded where the eager steps round (to nearest even on the bits: the interpreter
                # truncates its casts), so no further from float64 than one bf16 unit of the
                # largest value past the eager steps' own error
                assert case["fused_error"] <= case["eager_error"] + 2 ** -8 * case["largest"], case
                assert case["tiles_apart"] <= 2 ** -8 * case["largest"], case


GOLDEN_THROUGH_FUSED = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from model_helpers import DATA, golden_model
from sgraf.kernels import graph_steps
from sgraf.precision import autocast
graph_steps.fusable = lambda device: True    # the interpreter stands in for a device
kernel, calls = graph_steps.reason, []
graph_steps.reason = lambda *args: calls.append(args[1].shape) or kernel(*args)
entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)["SGR"]
model = golden_model(entry, "SGR")
scores = {}
for route in ("eager", "fused"):
    os.environ["SGRAF_STEP_ROUTE"] = route
    with autocast("bf16", "cpu"):
        scores[route] = model.score(entry["images"], entry["captions"], entry["lengths"])
print(json.dumps({"kernel_calls": len(calls), "apart": float((scores["fused"] - scores["eager"]).abs().max()),
                  "fused_from_golden": float((scores["fused"] - entry["sims"]).abs().max()),
                  "eager_from_golden": float((scores["eager"] - entry["sims"]).abs().max())}))
"""


@needs_triton
def test_the_golden_scores_in_bf16_through_the_fused_steps():
    """SGR's bf16 scorer with its reasoning steps in the kernel (Triton's interpreter on the CPU)
    gives the eager steps' bf16 scores of the golden data, and is no further from the authors'
    float32 scores than they are."""
    result = interpreted(GOLDEN_THROUGH_FUSED, TESTS)
    assert result["kernel_calls"] > 0, result                   # the scorer took the kernel
    assert result["apart"] <= 2**-10, result
    assert result["fused_from_golden"] <= result["eager_from_golden"] + 2**-10, result


@needs_triton
def test_a_models_folded_weights_are_stacked_for_the_kernel_once(monkeypatch):
    """The scorer's cached folded weights (`SGRAF.eval_constants`, kept for a split) reach the
    kernel stacked once, not on every block; a plain list of step weights is stacked per call
    into the same values."""
    from model_helpers import random_model

    passed = []

    class Kernel:        # stands in for the Triton kernel: keeps the weights it is launched with
        def __getitem__(self, grid):
            return lambda *args, **kwargs: passed.append(args[2:6])

    monkeypatch.setattr(graph_steps, "_kernel", Kernel)
    model = random_model(module="sgr", sgr_step=3)
    graphs = torch.randn(6, 5, model.config.sim_dim).to(torch.bfloat16)
    with model.frozen_weights():
        folded = model.eval_constants(torch.bfloat16)["folded"]
        assert isinstance(folded, graph_steps.FoldedSteps) and len(folded) == model.config.sgr_step
        for _ in range(2):
            graph_steps.reason(model.eval_constants(torch.bfloat16)["folded"], graphs, None, 3, "fused")
    graph_steps.reason(list(folded), graphs, None, 3, "fused")
    first, again, plain = passed
    assert all(a is b for a, b in zip(first, again))               # the same stacked tensors
    assert all(a is not b and torch.equal(a, b) for a, b in zip(first, plain))
    for kind, stacked in enumerate(first):
        assert stacked.is_contiguous() and torch.equal(stacked, torch.stack([step[kind] for step in folded]))


def test_the_cpu_and_float32_take_the_eager_steps_without_measuring(tuning_cache, monkeypatch):
    assert graph_steps.measure_step_route("cpu", torch.float32, 256, 3) == "eager"
    assert graph_steps.step_route("cpu", torch.bfloat16, 256, 3) == "eager"
    with plan.emulate_gpu():
        assert graph_steps.step_route("cpu", torch.float32, 256, 3) == "eager"
    monkeypatch.setattr(graph_steps, "fusable", lambda device: True)     # as on a GPU with Triton:
    assert graph_steps.measure_step_route("cpu", torch.float32, 256, 3) == "eager"   # float32 is not probed
    assert not tuning_cache.exists()                             # nothing measured, nothing stored


def test_the_kernel_applies_to_16_bit_graphs_with_a_global_node_of_at_most_64_nodes():
    bf16 = torch.bfloat16
    assert graph_steps.applies("fused", 14, True, bf16) and graph_steps.applies("fused 32x32x4x1", 64, True, bf16)
    assert not graph_steps.applies("fused", 65, True, bf16)           # captions of 64 words or more: eager
    assert not graph_steps.applies("fused", 14, False, bf16)          # the averaged read-out: eager
    assert not graph_steps.applies("fused", 14, True, torch.float32)  # float32: eager
    assert not graph_steps.applies("eager", 14, True, bf16)


@needs_triton
def test_the_fused_steps_compile_for_hopper_without_spilling():
    """No GPU needed: Triton compiles the bf16 kernel for sm_90 at the paper's sizes (256-wide
    nodes, graphs of 14 nodes padded to 16, 3 steps) with each tile the probe may pick; `ptxas -v`
    (the one Triton runs) reports no register spills, and the 64-row tiles run their products on
    wgmma."""
    pointers = {name: "*bf16" for name in ("graphs", "blocked", "bilinear", "key_term", "weight", "bias", "scratch")}
    pointers["out"] = "*fp32"
    values = dict(STEPS=3, DIM=256, DIM_TILE=256, NODES=16, HAS_MASK=True, WIDEN=False, EMULATE=False,
                  PRECISION="tf32")
    built = compile_tiles(graph_steps._kernel(), values, pointers, graph_steps.TILES,
                          lambda tile: ({"ROWS": tile[0], "CHUNK": tile[1], "GLOBALS": max(16, tile[0] // 16)},
                                        *tile[2:]))
    for (rows, chunk, warps, _), (ptx, report) in zip(graph_steps.TILES, built):
        spilled = spills(report)
        assert spilled and spilled == [0] * len(spilled), (rows, chunk, warps, report)
        if rows >= 64:   # a warp group's matmul takes 64 rows
            assert "wgmma" in ptx, (rows, chunk)


@pytest.mark.parametrize("route", ["aten", "onednn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_eager_steps_read_out_row_takes_no_weight_expanded_per_graph(route, precision, monkeypatch):
    """The last step queries one row per graph. As a (G, 1, m) slice PyTorch's matmul ran it as G
    one-row matmuls against the weight expanded over the graphs (on the CPU's aten route 245 ms
    against 1.6 ms for 1,792 graphs); as a (G, m) matrix it is one matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model_helpers import random_batch, random_model
    from sgraf.precision import autocast

    monkeypatch.setenv("SGRAF_CPU_MATMUL", route)

    class Expanded(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                Expanded.count += any(torch.is_tensor(a) and a.dim() == 3 and a.size(0) > 1 and a.stride(0) == 0
                                      for a in args)
            return func(*args, **(kwargs or {}))

    model = random_model(2, module="sgr")
    images, captions, lengths = random_batch(model, 4, [5, 3, 7, 4, 6])
    with torch.no_grad(), autocast(precision, "cpu"):
        img_embs, cap_embs = model.encode_images(images), model.encode_captions(captions, lengths)
        expected = model.similarity(img_embs, cap_embs, lengths)        # any route probe first
        with Expanded():
            scores = model.similarity(img_embs, cap_embs, lengths)
    assert Expanded.count == 0
    assert torch.equal(scores, expected)
