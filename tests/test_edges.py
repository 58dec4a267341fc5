"""SGR's eval edge step (`sgraf.kernels.edges`): both routes held to the paper's math, the
golden scores through each, and the route measured once per device and dtype."""

from __future__ import annotations

import json

import pytest
import torch

from model_helpers import DATA, golden_model, random_batch, random_model
from numerics import AUTHORS, REORDERED, assert_close, largest
from sgraf.errors import InputError
from sgraf.kernels import edges, plan, tuning
from sgraf.kernels.launches import LaunchCounter

pytestmark = pytest.mark.numeric


def graphs_of_a_block(n_img=3, lengths=(5, 2, 7, 7), dim=24, n_queries=None, seed=0):
    """Queries, key nodes, the additive key mask of captions of `lengths` (+ a global node)."""
    generator = torch.Generator().manual_seed(seed)
    n_cap, n_nodes = len(lengths), max(lengths) + 1
    nodes = torch.nn.functional.normalize(torch.randn(n_img * n_cap, n_nodes, dim, generator=generator), dim=-1)
    queries = torch.randn(n_img * n_cap, n_queries or n_nodes, dim, generator=generator)
    valid = torch.arange(n_nodes) <= torch.tensor(lengths)[:, None]
    blocked = torch.zeros(n_cap, n_nodes).masked_fill_(~valid, float("-inf"))
    return queries, nodes, blocked, valid


def reference(queries, nodes, valid, n_img):
    """`softmax_row(q k^T)` over the valid keys, then `E N`, in float64, one graph at a time."""
    out = []
    n_cap = valid.size(0)
    for graph in range(nodes.size(0)):
        keys = nodes[graph].double()[valid[graph % n_cap]]
        out.append((queries[graph].double() @ keys.t()).softmax(dim=1) @ keys)
    return torch.stack(out)


@pytest.mark.parametrize("route", edges.ROUTES)
@pytest.mark.parametrize("n_queries", [None, 1])     # every node, or the global node only (the last step)
def test_each_route_computes_the_masked_edge_softmax_and_aggregation(route, n_queries):
    queries, nodes, blocked, valid = graphs_of_a_block(n_queries=n_queries)
    expected = reference(queries, nodes, valid, 3)
    got = edges.edge_aggregate(queries, nodes, blocked, 3, route)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert_close(got, expected, REORDERED, scale=largest(expected))
    # captions of one length: no mask at all
    queries, nodes, blocked, valid = graphs_of_a_block(lengths=(4, 4), n_queries=n_queries, seed=1)
    assert_close(edges.edge_aggregate(queries, nodes, None, 3, route), reference(queries, nodes, valid, 3),
                 REORDERED, scale=1.0)


@pytest.mark.parametrize("route", edges.ROUTES)
def test_each_route_in_bf16_stays_within_bf16_rounding(route):
    queries, nodes, blocked, valid = graphs_of_a_block(seed=2)
    expected = reference(queries.bfloat16(), nodes.bfloat16(), valid, 3)
    got = edges.edge_aggregate(queries.bfloat16(), nodes.bfloat16(), blocked.bfloat16(), 3, route)
    assert got.dtype == torch.bfloat16
    # the probabilities are rounded to bf16 before the aggregation and the result once more:
    # a few bf16 ulps (2^-8) of the nodes' unit scale
    assert (got.double() - expected).abs().max() <= 4 * 2**-8


@pytest.mark.parametrize("route", edges.ROUTES)
@pytest.mark.parametrize("module", ["SGR"])
def test_the_golden_scores_come_out_of_each_route(monkeypatch, route, module):
    monkeypatch.setenv("SGRAF_EDGE_ROUTE", route)
    entry = torch.load(DATA / "golden_small.pt", weights_only=True)[module]
    model = golden_model(entry, module)
    assert_close(model.score(entry["images"], entry["captions"], entry["lengths"]), entry["sims"], AUTHORS)


def test_the_sdpa_route_takes_an_attention_output_of_any_layout(monkeypatch):
    """CUDA's fp32 attention kernels return their output with the heads' dimension outermost in
    memory (seen on an H100: a `.view` of it failed); the route must accept that layout."""
    attention = torch.nn.functional.scaled_dot_product_attention

    def heads_outermost(*args, **kwargs):
        out = attention(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)    # same values, the kernels' strides

    queries, nodes, blocked, valid = graphs_of_a_block()
    monkeypatch.setattr(edges.F, "scaled_dot_product_attention", heads_outermost)
    got = edges.edge_aggregate(queries, nodes, blocked, 3, "sdpa")
    assert_close(got, reference(queries, nodes, valid, 3), REORDERED, scale=largest(got))


def test_the_routes_give_the_same_scores_at_either_precision(monkeypatch):
    from sgraf.precision import autocast

    model = random_model(5, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 6, [6, 3, 11, 3, 8, 1], pad_to=13, seed=3)
    scores = {}
    for route in edges.ROUTES:
        monkeypatch.setenv("SGRAF_EDGE_ROUTE", route)
        scores[route, "fp32"] = model.score(images, captions, lengths)
        with autocast("bf16"):
            scores[route, "bf16"] = model.score(images, captions, lengths)
    assert_close(scores["sdpa", "fp32"], scores["layout", "fp32"], REORDERED)
    # bf16: each route rounds its probabilities once to bf16; the scores (sigmoids near 0.5)
    # differ by a bf16 rounding of the node values at most
    assert (scores["sdpa", "bf16"] - scores["layout", "bf16"]).abs().max() <= 2**-8


def test_the_route_is_measured_once_per_dtype_stored_and_then_only_read(tuning_cache):
    # asking never measures
    assert edges.edge_route("cpu", torch.float32, 32) == "layout" and not tuning_cache.exists()
    chosen = {dtype: edges.measure_edge_route("cpu", dtype, 32) for dtype in (torch.float32, torch.bfloat16)}
    stored = json.loads(tuning_cache.read_text())
    for dtype, route in chosen.items():
        entry = stored[f"{tuning.machine_key()}|sgr edge route|{dtype}|m=32"]
        seconds = {r: entry["seconds"][json.dumps(r)] for r in edges.ROUTES}
        fastest = min(seconds.values())
        assert route == entry["choice"] == ("layout" if seconds["layout"] <= fastest * (1 + tuning.KEEP_DEFAULT)
                                            else "sdpa")
    tuning.forget()
    before = tuning_cache.read_text()
    assert edges.edge_route("cpu", torch.float32, 32) == chosen[torch.float32]          # read back
    assert edges.measure_edge_route("cpu", torch.bfloat16, 32) == chosen[torch.bfloat16]  # not measured again
    assert tuning_cache.read_text() == before


def test_a_scorer_of_a_large_split_measures_the_route_before_scoring(tuning_cache, monkeypatch):
    from sgraf.model import blocks

    monkeypatch.setattr(blocks, "TUNE_MIN_PAIRS", 20)
    model = random_model(5, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 5, [6, 3, 11, 3, 8], pad_to=13, seed=3)
    model.score(images, captions, lengths)
    assert any("sgr edge route|torch.float32|m=" in key for key in json.loads(tuning_cache.read_text()))
    saf = random_model(5, module="saf", num_regions=7)
    tuning.forget()
    tuning_cache.unlink()
    saf.score(images, captions, lengths)              # no reasoning, nothing to measure
    assert not any("sgr edge route" in key for key in json.loads(tuning_cache.read_text()))


def test_a_forced_route_must_be_known_and_counting_takes_the_default_unmeasured(tuning_cache, monkeypatch):
    monkeypatch.setenv("SGRAF_EDGE_ROUTE", "flash")
    with pytest.raises(InputError, match=r"SGRAF_EDGE_ROUTE must be auto \(the measured choice\) or one of layout, "
                                         r"sdpa, got 'flash'"):
        edges.edge_route("cpu", torch.float32, 32)
    monkeypatch.delenv("SGRAF_EDGE_ROUTE")
    with plan.emulate_gpu():
        assert edges.measure_edge_route("cpu", torch.float32, 32) == "layout"
    assert not tuning_cache.exists()


def test_the_sdpa_route_is_one_operation_per_step():
    queries, nodes, blocked, _ = graphs_of_a_block()
    counts = {}
    for route in edges.ROUTES:
        with LaunchCounter() as counter:
            edges.edge_aggregate(queries, nodes, blocked, 3, route)
        counts[route] = counter.launches
    assert counts["sdpa"] < counts["layout"], counts
