"""How the Triton kernels' routes are chosen (`sgraf.kernels.fused_routes`): the variable that
forces one, and the probe, in which a tile that fails to build or computes something else is
never chosen. Each test runs for the word nodes' kernel (`sgraf.kernels.words`), the reasoning
steps' (`graph_steps`), the attention's (`attention`) and SAF's filtration's (`filtration`)."""

from __future__ import annotations

import json

import pytest
import torch

from sgraf.errors import InputError
from sgraf.kernels import attention, filtration, fused_routes, graph_steps, words
from sgraf.kernels.fused_routes import FusedRoutes
from sgraf.precision import tf32

# module, its route functions with small sizes, its forcing variable, its stored choice's name,
# and the function its fused route calls
KERNELS = {
    "word nodes": (words, lambda: words.word_route("cpu", torch.bfloat16, 24, 16),
                   lambda: words.measure_word_route("cpu", torch.bfloat16, 24, 16),
                   "SGRAF_WORD_ROUTE", "word nodes route", "_fused"),
    "reasoning steps": (graph_steps, lambda: graph_steps.step_route("cpu", torch.bfloat16, 16, 2),
                        lambda: graph_steps.measure_step_route("cpu", torch.bfloat16, 16, 2),
                        "SGRAF_STEP_ROUTE", "sgr step route", "reason"),
    "attention": (attention, lambda: attention.attention_route("cpu", torch.bfloat16),
                  lambda: attention.measure_attention_route("cpu", torch.bfloat16),
                  "SGRAF_ATTENTION_ROUTE", "attention route", "_fused"),
    "attention filtration": (filtration, lambda: filtration.filter_route("cpu", torch.bfloat16, 24),
                             lambda: filtration.measure_filter_route("cpu", torch.bfloat16, 24),
                             "SGRAF_FILTER_ROUTE", "saf filter route", "_fused"),
}


def test_the_routes_a_probe_times_and_the_tile_a_route_names():
    routes = FusedRoutes("SGRAF_TEST_ROUTE", "test", ((64, 32, 8, 2), (32, 64, 4, 1)))
    assert routes.measured == ("eager", "fused 64x32x8x2", "fused 32x64x4x1")
    assert routes.tile("fused") == (64, 32, 8, 2) and routes.tile("fused 32x64x4x1") == (32, 64, 4, 1)
    assert words.MEASURED == words.ROUTE.measured and len(graph_steps.MEASURED) == 1 + len(graph_steps.TILES)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_forced_route_must_be_known_and_possible_here(kernel, tuning_cache, monkeypatch):
    module, route, measure, variable, _, _ = KERNELS[kernel]
    monkeypatch.setenv(variable, "Eager")
    assert route() == "eager" and measure() == "eager"
    monkeypatch.setenv(variable, "fused")
    with pytest.raises(InputError, match=f"{variable}=fused needs a CUDA device with Triton installed; this is cpu"):
        route()
    monkeypatch.setattr(module, "fusable", lambda device: True)      # as on a GPU with Triton
    assert route() == "fused" and measure() == "fused"
    monkeypatch.setenv(variable, "triton")
    with pytest.raises(InputError, match=f"{variable} must be auto \\(the measured choice\\) or one of eager, "
                                         "fused, got 'triton'"):
        measure()
    assert not tuning_cache.exists()                                 # a forced route measures nothing


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_route_that_fails_to_build_is_never_chosen(kernel, tuning_cache, monkeypatch):
    """On a device where the kernel does not compile, the probe times it as never finishing, and
    the choice is stored for the next process to read without measuring."""
    module, route, measure, _, name, fused = KERNELS[kernel]
    monkeypatch.setattr(module, "fusable", lambda device: True)
    monkeypatch.setattr(module, fused, lambda *args: (_ for _ in ()).throw(RuntimeError("no sm_90 here")))
    assert measure() == "eager"
    stored = json.loads(tuning_cache.read_text())
    entry = next(value for key, value in stored.items() if name in key)
    assert entry["choice"] == "eager" and len(entry["seconds"]) == 1 + len(module.TILES)
    assert entry["seconds"][json.dumps("eager")] < float("inf")
    assert all(entry["seconds"][json.dumps(r)] == float("inf") for r in module.MEASURED[1:])
    assert route() == "eager"


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_fault_of_the_device_in_a_probe_is_raised_not_timed(kernel, tuning_cache, monkeypatch):
    """An illegal memory access leaves the device's context unusable: timed as a failed tile, it
    had let the process go on to fail far from its cause at the next CUDA call."""
    module, route, measure, _, _, fused = KERNELS[kernel]
    monkeypatch.setattr(module, "fusable", lambda device: True)
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(module, fused, lambda *args: (_ for _ in ()).throw(fault))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure()
    assert fused_routes.device_fault(fault) and not fused_routes.device_fault(RuntimeError("out of resource: "
                                                                                          "shared memory"))


def test_float32_word_nodes_never_time_the_tile_past_a_hoppers_shared_memory():
    assert "fused 64x64x8x3" in words.ROUTE.measured and "fused 64x64x8x3" not in words.FLOAT32_ROUTE.measured
    assert words._route(torch.float32) is words.FLOAT32_ROUTE and words._route(torch.bfloat16) is words.ROUTE


# stand-ins for each kernel that run quickly and give the wrong values (the shapes are right)
WRONG = {
    "word nodes": lambda attn, regions, words_, weight, bias, out, tile: out.fill_(0.25),
    "reasoning steps": lambda folded, graphs, blocked, n_cap, route: torch.ones(graphs.size(0), graphs.size(2)),
    "attention": lambda relevance, gram, n_words, smooth, tile: torch.ones_like(relevance, dtype=torch.float32),
    "attention filtration": lambda nodes, node_mask, *args: torch.ones(nodes.shape[:2] + nodes.shape[3:]),
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_route_whose_values_are_not_the_eager_routes_is_never_chosen(kernel, tuning_cache, monkeypatch, caplog):
    """A kernel that builds and runs but computes something else on this device (a fault the
    interpreter's tests cannot see) is refused by the probe, with a warning that says by how much."""
    module, route, measure, _, name, fused = KERNELS[kernel]
    monkeypatch.setattr(module, "fusable", lambda device: True)
    monkeypatch.setattr(module, fused, WRONG[kernel])
    with caplog.at_level("WARNING", logger="sgraf.kernels.fused_routes"):
        assert measure() == "eager"
    entry = next(value for key, value in json.loads(tuning_cache.read_text()).items() if name in key)
    assert entry["choice"] == "eager" and entry["seconds"][json.dumps("eager")] < float("inf")
    assert all(entry["seconds"][json.dumps(r)] == float("inf") for r in module.MEASURED[1:])
    refusals = [message for message in (r.getMessage() for r in caplog.records)
                if "of the largest apart from the eager route's" in message]
    assert len(refusals) == len(module.TILES), caplog.text
    assert f"(at most {fused_routes.AGREEMENT[torch.bfloat16]:.3g} allowed); it is never chosen" in refusals[0]
    assert route() == "eager"


def test_the_difference_a_probe_holds_a_route_to():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    assert fused_routes.relative_difference(ref + 0.5, ref) == 0.125            # 0.5 of the largest, 4
    pair = (ref, torch.full((3,), 8.0))
    assert fused_routes.relative_difference((ref, pair[1] - 1), pair) == 0.125   # over both tensors
    nan = ref.clone()
    nan[1, 1] = float("nan")
    for output, reference in [(nan, ref), (ref, nan), (ref[:1], ref), (ref, pair), (pair, ref), (pair[:1], pair)]:
        assert fused_routes.relative_difference(output, reference) == float("inf")
    assert fused_routes.relative_difference(torch.zeros(2), torch.zeros(2)) == 0.0


# stand-ins for each kernel that give the eager route's values
RIGHT = {
    "word nodes": lambda attn, regions, words_, weight, bias, out, tile: (
        words.word_nodes(attn, regions, words_, weight, bias, out, "eager") if attn is not None
        else out[:, :, 0].copy_(words.global_nodes(regions, words_, weight, bias, "eager"))),
    "reasoning steps": lambda folded, graphs, blocked, n_cap, route: graph_steps.eager_steps(
        folded, graphs, blocked, graphs.size(0) // n_cap, True)[:, 0].float(),
    "attention": lambda relevance, gram, n_words, smooth, tile: attention.scaled_attention(
        relevance, gram, n_words, smooth, "eager"),
    "attention filtration": lambda *args: filtration.filtered(*args[:6], route="eager"),
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_route_that_gives_the_eager_routes_values_is_timed(kernel, tuning_cache, monkeypatch, caplog):
    """The other side of the check: a kernel that agrees is timed like the eager route, and no
    warning is given. (The four kernels' interpreter tests hold each within `AGREEMENT` of its
    eager route on such inputs, in bf16 too, where the interpreter truncates where a GPU rounds.)"""
    module, _, measure, _, name, fused = KERNELS[kernel]
    monkeypatch.setattr(module, "fusable", lambda device: True)
    monkeypatch.setattr(module, fused, RIGHT[kernel])
    with caplog.at_level("WARNING", logger="sgraf.kernels.fused_routes"):
        assert measure() in module.MEASURED
    assert not caplog.records, caplog.text
    entry = next(value for key, value in json.loads(tuning_cache.read_text()).items() if name in key)
    assert sorted(entry["seconds"]) == sorted(json.dumps(r) for r in module.MEASURED)
    assert all(seconds < float("inf") for seconds in entry["seconds"].values()), entry


def test_float32_under_tf32_is_held_to_tf32s_rounding_and_stored_apart(tuning_cache, monkeypatch):
    """With CUDA's matmuls in TF32 (`sgraf evaluate --tf32`) the eager route and the kernels both
    round to 10 bits: a kernel 1e-3 off is refused in float32, timed under TF32, and the two
    choices are stored under their own names."""
    monkeypatch.setattr(attention, "fusable", lambda device: True)
    monkeypatch.setattr(attention, "_fused", lambda relevance, gram, n_words, smooth, tile: attention.scaled_attention(
        relevance, gram, n_words, smooth, "eager") * (1 + 1e-3))
    assert fused_routes.dtype_key(torch.float32) == "torch.float32"
    assert attention.measure_attention_route("cpu", torch.float32) == "eager"
    # (the flag also sets PyTorch's float32 matmul precision, CPU included: `tf32` restores both)
    with tf32(True):
        assert fused_routes.dtype_key(torch.float32) == "torch.float32|tf32"
        assert fused_routes.dtype_key(torch.bfloat16) == "torch.bfloat16"
        assert fused_routes.agreement(torch.float32) == fused_routes.AGREEMENT_TF32 > 1e-3
        attention.measure_attention_route("cpu", torch.float32)
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    stored = json.loads(tuning_cache.read_text())
    exact, rounded = (next(entry for key, entry in stored.items() if key.endswith(f"attention route|{name}"))
                      for name in ("torch.float32", "torch.float32|tf32"))
    assert all(exact["seconds"][json.dumps(r)] == float("inf") for r in attention.MEASURED[1:])
    assert all(rounded["seconds"][json.dumps(r)] < float("inf") for r in attention.MEASURED)
