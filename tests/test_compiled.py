"""The compiled scoring path (`sgraf.kernels.compiled`): held to the eager one by the numerics
budgets, one graph per caption-width bucket, nothing recompiled for the same shapes or other
weights, no graph breaks. Compiling costs seconds, so one tiny joint model (both heads in one
graph) is compiled once for the module."""

from __future__ import annotations

import os

import pytest
import torch

from model_helpers import random_batch, random_model
from numerics import REORDERED, assert_close
from sgraf.errors import InputError
from sgraf.kernels import compiled
from sgraf.model import sgraf as sgraf_model

# captions of every length from 1 to 14 words in buckets of 4: widths round up to 8 and 16
LENGTHS = [1 + (5 * i) % 14 for i in range(28)]
BATCH = 4
# a chunk budget for the tiny model (d = 16, float32) that cuts chunks of 4 captions at width 8
# and of 2 at width 16: some chunks are slices of their block as they are, others padded
CHUNK_BYTES = 8 * 4 * 8 * 16 * 4


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.fixture(scope="module")
def compiled_scores():
    """(model, inputs, eager scores, compiled scores, graphs compiled by the first and the second call)."""
    import torch._dynamo
    import torch._inductor.config

    # one thread: Inductor's kernels are then serial (OpenMP teams spinning on a loaded 2-core
    # machine made tiny compiled chunks 50x slower), and no pool of compiler processes
    torch.set_num_threads(1)
    chunk_bytes, sgraf_model.EVAL_CHUNK_BYTES = sgraf_model.EVAL_CHUNK_BYTES, CHUNK_BYTES
    model = random_model(3, module="joint")
    inputs = random_batch(model, 10, LENGTHS)
    eager = model.score(*inputs, batch_size=BATCH)
    before, breaks = _graphs(), _breaks()
    try:
        with compiled.compiling(), torch._inductor.config.patch(compile_threads=1):
            first = model.score(*inputs, batch_size=BATCH)
            after_first = _graphs()
            second = model.score(*inputs, batch_size=BATCH)
    except Exception as error:   # no C compiler, or Inductor cannot build here
        if os.environ.get("CI", "").lower() == "true":
            raise
        sgraf_model.EVAL_CHUNK_BYTES = chunk_bytes
        pytest.skip(f"torch.compile (Inductor) does not run on this machine: {type(error).__name__}: {error}")
    yield {"model": model, "inputs": inputs, "eager": eager, "first": first, "second": second,
           "first_graphs": after_first - before, "second_graphs": _graphs() - after_first,
           "breaks": _breaks() - breaks}
    sgraf_model.EVAL_CHUNK_BYTES = chunk_bytes


def _widths() -> set[int]:
    ordered = sorted(LENGTHS, reverse=True)
    return {compiled.bucket_width(max(ordered[i:i + BATCH])) for i in range(0, len(ordered), BATCH)}


@pytest.mark.numeric
def test_compiled_scores_match_eager_within_the_reordered_budget(compiled_scores):
    assert_close(compiled_scores["first"], compiled_scores["eager"], REORDERED, what="compiled scores")
    assert torch.equal(compiled_scores["first"], compiled_scores["second"])


def test_a_split_compiles_one_graph_per_width_bucket_and_the_same_shapes_nothing(compiled_scores):
    assert _widths() == {8, 16}
    model = compiled_scores["model"]
    assert [model.compiled_chunk_shape(width, torch.float32) for width in (8, 16)] == [(8, 4), (8, 2)]
    assert compiled_scores["first_graphs"] == len(_widths())
    assert compiled_scores["second_graphs"] == 0
    assert compiled_scores["breaks"] == 0


@pytest.mark.numeric
def test_other_weights_and_other_block_sizes_reuse_the_compiled_graphs(compiled_scores):
    other = random_model(4, module="joint")                    # same sizes, other weights
    images, captions, lengths = compiled_scores["inputs"]
    # fewer images and captions, the same widths: chunks are padded to the same grid
    inputs = images[:3], captions[:13], lengths[:13]
    torch.set_num_threads(1)    # the threads the graphs were compiled for (see the fixture)
    eager = other.score(*inputs, batch_size=BATCH)
    before = _graphs()
    with compiled.compiling():
        scores = other.score(*inputs, batch_size=BATCH)
    assert _graphs() == before
    assert_close(scores, eager, REORDERED, what="compiled scores, other weights")


def test_eager_is_the_default_and_the_setting_is_checked(monkeypatch):
    monkeypatch.delenv("SGRAF_COMPILE", raising=False)
    assert compiled.mode() == "off" and not compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "on")
    assert compiled.mode() == "eval"
    with compiled.compiling("off"):
        assert not compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "fast")
    with pytest.raises(InputError, match="SGRAF_COMPILE must be one of"):
        compiled.mode()
    assert [compiled.bucket_width(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert [compiled.padded_count(n) for n in (1, 2, 3, 200)] == [1, 2, 4, 256]


def test_worker_threads_meeting_a_new_shape_compile_it_once(compiled_scores, monkeypatch):
    import torch._inductor.config

    from sgraf.model import blocks

    monkeypatch.setattr(blocks, "thread_mode", lambda *args, **kwargs: "blocks")   # a block per core
    torch.set_num_threads(2)
    model = random_model(5, module="sgr")          # one head: graphs of its own
    inputs = compiled_scores["inputs"]
    eager = model.score(*inputs, batch_size=BATCH)
    before = _graphs()
    with compiled.compiling(), torch._inductor.config.patch(compile_threads=1):
        scores = model.score(*inputs, batch_size=BATCH)
    assert _graphs() - before == len(_widths())
    assert_close(scores, eager, REORDERED, what="compiled scores, two worker threads")
