"""The compiled paths (`sgraf.kernels.compiled`), scoring and the training step's pairs: held to
the eager ones by the numerics budgets, one graph per caption-width bucket, nothing recompiled for
the same shapes, other pairs or other weights, worker threads compiling a shape once, no graph
breaks. Inductor's build costs tens of seconds per graph with a cold cache, so it builds one: a
tiny joint model's scoring chunk (both heads in one graph), held to the eager scores. The graphs
are traced, guarded and counted on the "aot_eager" backend, which differs from Inductor only in
generating no code."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from model_helpers import needs_compile, random_batch, random_model, step_gradients, training_batch
from numerics import BFLOAT16_GRADIENT, GRADIENT, REORDERED, assert_close, largest
from sgraf.errors import InputError
from sgraf.model.loss import max_pairs
from sgraf.kernels import compiled, plan
from sgraf.kernels import eval_chunks
from sgraf.training import pairs
from sgraf.training.config import preset

pytestmark = needs_compile

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
def inductor_scores():
    """The joint model's captions of one width bucket scored eager and by Inductor, twice, with
    the graphs each compiled call added (the only Inductor build of the module: tens of seconds)."""
    import torch._inductor.config

    # one thread: Inductor's kernels are then serial (OpenMP teams spinning on a loaded 2-core
    # machine made tiny compiled chunks 50x slower), and no pool of compiler processes
    torch.set_num_threads(1)
    model = random_model(3, module="joint")
    short = [length for length in LENGTHS if length <= compiled.WIDTH_STEP]     # one bucket: one graph
    inputs = random_batch(model, 10, short)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(eval_chunks, "EVAL_CHUNK_BYTES", CHUNK_BYTES)
            eager = model.score(*inputs, batch_size=BATCH)
            graphs, breaks = [_graphs()], _breaks()
            with compiled.compiling(), torch._inductor.config.patch(compile_threads=1):
                scores = []
                for _ in range(2):
                    scores.append(model.score(*inputs, batch_size=BATCH))
                    graphs.append(_graphs())
    except Exception as error:   # no C compiler, or Inductor cannot build here
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"torch.compile (Inductor) does not run on this machine: {type(error).__name__}: {error}")
    return {"eager": eager, "scores": scores, "graphs": [b - a for a, b in zip(graphs, graphs[1:])],
            "breaks": _breaks() - breaks}


@pytest.mark.numeric
def test_inductors_scoring_chunk_matches_eager_within_the_reordered_budget(inductor_scores):
    assert_close(inductor_scores["scores"][0], inductor_scores["eager"], REORDERED, what="compiled scores")
    assert torch.equal(inductor_scores["scores"][0], inductor_scores["scores"][1])
    assert inductor_scores["graphs"] == [1, 0] and inductor_scores["breaks"] == 0


@contextlib.contextmanager
def _aot_eager():
    """`sgraf.kernels.compiled` on the "aot_eager" backend: Dynamo's tracing and guards (and for
    training AOTAutograd's joint forward and backward) as under Inductor, without generating
    code: Inductor takes tens of seconds per graph on a 2-core CPU with a cold cache (one eval
    graph above; `benchmarks/bench_train.py --compiled` builds the training graphs at the
    paper's size). Dynamo's caches are emptied on entering and leaving, so that no graph of one
    backend serves the other."""
    import torch._dynamo

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "BACKEND", "aot_eager")
        patch.setattr(compiled, "_compiled", {})
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


@pytest.fixture(scope="module")
def compiled_scores():
    """The joint model's split (two width buckets) scored eager and compiled (on "aot_eager"):
    twice; then another model's weights on fewer images and captions; then a third model by two
    worker threads. Each with its eager scores and the graphs its compiled call added."""
    from sgraf.model import blocks

    torch.set_num_threads(1)
    model, other, threaded = random_model(3, module="joint"), random_model(4, module="joint"), \
        random_model(5, module="sgr")                    # same sizes, other weights; one head: graphs of its own
    inputs = random_batch(model, 10, LENGTHS)
    images, captions, lengths = inputs
    fewer = images[:3], captions[:13], lengths[:13]      # the same widths: chunks padded to the same grid
    runs = [(model, inputs, 1), (model, inputs, 1), (other, fewer, 1), (threaded, inputs, 2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_chunks, "EVAL_CHUNK_BYTES", CHUNK_BYTES)
        patch.setattr(blocks, "thread_mode", lambda *args, **kwargs: "blocks")   # a block per core
        results, breaks = [], _breaks()
        for run_model, run_inputs, threads in runs:
            torch.set_num_threads(threads)
            results.append({"eager": run_model.score(*run_inputs, batch_size=BATCH)})
        with _aot_eager(), compiled.compiling():
            for (run_model, run_inputs, threads), result in zip(runs, results):
                torch.set_num_threads(threads)
                before = _graphs()
                result["compiled"] = run_model.score(*run_inputs, batch_size=BATCH)
                result["graphs"] = _graphs() - before
        torch.set_num_threads(1)
    return {"model": model, "runs": results, "breaks": _breaks() - breaks}


def _widths() -> set[int]:
    ordered = sorted(LENGTHS, reverse=True)
    return {compiled.bucket_width(max(ordered[i:i + BATCH])) for i in range(0, len(ordered), BATCH)}


@pytest.mark.numeric
def test_compiled_scores_match_eager_within_the_reordered_budget(compiled_scores):
    first, second = compiled_scores["runs"][:2]
    assert_close(first["compiled"], first["eager"], REORDERED, what="compiled scores")
    assert torch.equal(first["compiled"], second["compiled"])


def test_a_split_compiles_one_graph_per_width_bucket_and_the_same_shapes_nothing(compiled_scores, monkeypatch):
    assert _widths() == {8, 16}
    model = compiled_scores["model"]
    monkeypatch.setattr(eval_chunks, "EVAL_CHUNK_BYTES", CHUNK_BYTES)   # the fixture's chunk budget
    budget, embed = model.eval_chunk_bytes(torch.float32), model.config.embed_size
    shapes = [eval_chunks.compiled_chunk_shape(budget, width, embed, torch.float32) for width in (8, 16)]
    assert shapes == [(8, 4), (8, 2)]
    assert [run["graphs"] for run in compiled_scores["runs"][:2]] == [len(_widths()), 0]
    assert compiled_scores["breaks"] == 0


@pytest.mark.numeric
def test_other_weights_and_other_block_sizes_reuse_the_compiled_graphs(compiled_scores):
    other = compiled_scores["runs"][2]
    assert other["graphs"] == 0
    assert_close(other["compiled"], other["eager"], REORDERED, what="compiled scores, other weights")


def test_worker_threads_meeting_a_new_shape_compile_it_once(compiled_scores):
    threaded = compiled_scores["runs"][3]
    assert threaded["graphs"] == len(_widths())
    assert_close(threaded["compiled"], threaded["eager"], REORDERED, what="compiled scores, two worker threads")


def test_auto_is_the_default_and_the_setting_is_checked(monkeypatch):
    monkeypatch.delenv("SGRAF_COMPILE", raising=False)
    assert compiled.mode() == "auto" and not compiled.eval_enabled() and not compiled.train_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "off")
    assert compiled.mode() == "off" and not compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "on")
    assert compiled.mode() == "eval" and compiled.eval_enabled() and not compiled.train_enabled()
    with compiled.compiling("off"):
        assert not compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "train")
    assert compiled.train_enabled() and not compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "all")
    assert compiled.train_enabled() and compiled.eval_enabled()
    monkeypatch.setenv("SGRAF_COMPILE", "fast")
    with pytest.raises(InputError, match="SGRAF_COMPILE must be one of"):
        compiled.mode()
    assert [compiled.bucket_width(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert [compiled.padded_count(n) for n in (1, 2, 3, 200)] == [1, 2, 4, 256]


# a training batch whose captions all fit one width bucket (8 words): its pairs' groups share a graph
TRAIN_LENGTHS = [3, 7, 5, 2, 7, 4, 6, 3, 5, 8]
# hardest negatives and a recipe's batch that takes the pairs' backward (the batches here hold 10)
TRAIN = dict(max_violation=True, batch_size=pairs.MIN_BATCH, grad_clip=0.0)


def _train_batch(model, seed):
    return training_batch(model, TRAIN_LENGTHS, seed=seed)


def _step(model, batch, precision="fp32", **options):
    """One training step's loss, every parameter's gradient and the number of pairs its loss
    selected (nothing updated: SGD at rate 0)."""
    listing, counts = pairs.loss_and_pairs, []

    def counted(*args):
        result = listing(*args)
        counts.append(len(result[1]))
        return result

    with mock.patch.object(pairs, "loss_and_pairs", counted):
        result, grads = step_gradients(model, batch, preset("tiny").replace(precision=precision, **TRAIN, **options))
    return SimpleNamespace(loss=float(result.loss), grads=grads, pairs=counts[0])


@pytest.fixture(scope="module")
def compiled_training():
    """Eager and compiled steps of a tiny SGR model: two batches (other pairs, as many words) and
    another model's weights, with the graphs each compiled call added."""
    model, other = random_model(4, module="sgr"), random_model(5, module="sgr")
    batches = [_train_batch(model, seed) for seed in (1, 5)]     # 29 and 27 pairs selected
    eager = [_step(model, batch) for batch in batches]
    with _aot_eager():
        graphs, breaks = [_graphs()], _breaks()
        with compiled.compiling("train"):
            steps = []
            for step_model, batch in [(model, batches[0]), (model, batches[1]), (other, batches[0])]:
                steps.append(_step(step_model, batch))
                graphs.append(_graphs())
        breaks = _breaks() - breaks
    return {"eager": eager, "compiled": steps, "graphs": [b - a for a, b in zip(graphs, graphs[1:])],
            "breaks": breaks}


@pytest.mark.numeric
def test_compiled_training_pairs_take_the_eager_loss_and_gradients(compiled_training):
    for eager, step in zip(compiled_training["eager"], compiled_training["compiled"]):
        assert step.loss == eager.loss and step.pairs == eager.pairs   # the matrix is not compiled
        assert step.grads.keys() == eager.grads.keys()
        scale = largest(eager.grads)
        for name, grad in eager.grads.items():
            assert_close(step.grads[name], grad, GRADIENT, scale=scale, what=f"compiled pairs, {name}'s gradient")


def test_training_compiles_one_graph_for_a_width_bucket_and_nothing_for_other_pairs_or_weights(compiled_training):
    eager = compiled_training["eager"]
    # the two batches select different numbers of pairs: both are padded to the loss's bound
    assert eager[0].pairs != eager[1].pairs and max(e.pairs for e in eager) <= max_pairs(10, 10)
    assert compiled_training["graphs"] == [1, 0, 0]
    assert compiled_training["breaks"] == 0


@pytest.mark.parametrize("setting", ["gpu-plan", "bf16", "places"])
def test_the_gpu_plans_bf16_and_a_place_models_pairs_compile_one_graph_each(setting):
    """Under the GPU plan the pairs are one group as wide as the batch; in bf16 the weights are
    new bf16 copies at every step (`low_precision_weights`) and the word nodes' passes are fused
    too; a place model adds its place term: none compiles again at the next step, and each takes
    the eager gradients."""
    options = dict(module="sgr", positions="place") if setting == "places" else {}
    model = random_model(6, **{"module": "sgr", **options})
    batches = [_train_batch(model, seed) for seed in (1, 2)]
    precision = "bf16" if setting == "bf16" else "fp32"
    emulated = plan.emulate_gpu() if setting == "gpu-plan" else contextlib.nullcontext()
    with emulated:
        eager = [_step(model, batch, precision, **options) for batch in batches]
        with _aot_eager(), compiled.compiling("train"):
            before = _graphs()
            steps = [_step(model, batches[0], precision, **options)]
            added = _graphs() - before
            steps.append(_step(model, batches[1], precision, **options))
            assert _graphs() - before == added      # nothing compiled again at the next step
            # the pairs' graph; in bf16 also the word nodes' fused square of the matrix's pass
            # (`nodes._squares`, SGRAF_COMPILE=train)
            assert added == (1 if precision == "fp32" else 2)
    budget = GRADIENT if precision == "fp32" else BFLOAT16_GRADIENT
    for eager_step, step in zip(eager, steps):
        assert step.loss == eager_step.loss
        scale = largest(eager_step.grads)
        for name, grad in eager_step.grads.items():
            assert_close(step.grads[name], grad, budget, scale=scale, what=f"{setting} compiled pairs, {name}")
