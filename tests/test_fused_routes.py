"""How the Triton kernels' routes are chosen (`sgraf.kernels.fused_routes`): the variable that
forces one, and the probe, in which a tile that fails to build is never chosen. Each test runs
for the word nodes' kernel (`sgraf.kernels.words`), the reasoning steps' (`graph_steps`) and the
attention's (`attention`)."""

from __future__ import annotations

import json

import pytest
import torch

from sgraf.errors import InputError
from sgraf.kernels import attention, graph_steps, words
from sgraf.kernels.fused_routes import FusedRoutes

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
    with pytest.raises(InputError, match=f"{variable} must be one of eager, fused, got 'triton'"):
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
