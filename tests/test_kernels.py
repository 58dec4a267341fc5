"""Measured choices (`sgraf.kernels.tuning`) and the CPU matmul routes (`sgraf.kernels.cpu`)."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from model_helpers import random_batch, random_model
from numerics import BFLOAT16, BFLOAT16_GRADIENT, GRADIENT, REORDERED, SAME_PATH, assert_close, largest
from sgraf.errors import InputError
from sgraf.kernels import cpu, edges, plan, tuning

pytestmark = pytest.mark.numeric


def expected_choice(seconds: dict, candidates, default=None, keep=tuning.KEEP_DEFAULT):
    """The rule of `tuning.choose`, written out: keep the default unless beaten by more than
    `keep`, else the earliest candidate within 3 % of the fastest."""
    fastest = min(seconds.values())
    default = candidates[0] if default is None else default
    if seconds[default] <= fastest * (1 + keep):
        return default
    return next(c for c in candidates if seconds[c] <= fastest * 1.03)


def test_the_default_stays_unless_clearly_beaten_and_near_equals_go_to_the_earliest(tuning_cache, monkeypatch):
    assert tuning.choose("near", ["default", "other"], {"default": 1.15, "other": 1.0}.get) == "default"
    assert tuning.choose("far", ["default", "other"], {"default": 1.3, "other": 1.0}.get) == "other"
    sizes = [4, 8, 16]
    assert tuning.choose("kept", sizes, {4: 1.0, 8: 1.1, 16: 1.0}.get, default=8) == 8
    assert tuning.choose("frugal", sizes, {4: 1.02, 8: 1.5, 16: 1.0}.get, default=8) == 4
    assert tuning.peek("never", [4, 8, 16], default=8) == 8
    monkeypatch.setenv("SGRAF_TUNE", "off")
    assert tuning.choose("off", [4, 8, 16], lambda c: pytest.fail("measured"), default=8) == 8


def test_choose_takes_the_fastest_and_stores_it_for_the_next_process(tuning_cache):
    measured = []

    def measure(candidate):
        measured.append(candidate)
        return {"a": 3.0, "b": 1.0, "c": 2.0}[candidate]

    assert tuning.choose("probe", ["a", "b", "c"], measure) == "b"
    assert tuning.choose("probe", ["a", "b", "c"], measure) == "b"
    assert measured == ["a", "b", "c"]                     # measured once
    entry = json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|probe"]
    assert entry["choice"] == "b" and entry["seconds"] == {'"a"': 3.0, '"b"': 1.0, '"c"': 2.0}
    tuning.forget()                                       # a new process: reads, does not measure
    assert tuning.choose("probe", ["a", "b", "c"], measure) == "b" and len(measured) == 3
    assert tuning.peek("probe", ["a", "b", "c"]) == "b"
    assert tuning.peek("other", ["x", "y"]) == "x"        # never measured: the default


def test_peek_reads_the_store_once_per_name_until_forget(tuning_cache, monkeypatch):
    """The scoring loop peeks at its routes and chunk size once per chunk: a name with nothing
    stored must not open and parse the store each time."""
    reads = []
    read = tuning._read
    monkeypatch.setattr(tuning, "_read", lambda: reads.append(1) or read())
    for _ in range(3):
        assert tuning.peek("unmeasured", ["x", "y"]) == "x"
    assert len(reads) == 1
    # stored meanwhile by another process: this one keeps its default until it forgets
    tuning_cache.write_text(json.dumps({f"{tuning.machine_key()}|unmeasured": {"choice": "y"}}))
    assert tuning.peek("unmeasured", ["x", "y"]) == "x" and len(reads) == 1
    tuning.forget()
    assert tuning.peek("unmeasured", ["x", "y"]) == "y" and tuning.peek("unmeasured", ["x", "y"]) == "y"
    assert len(reads) == 2
    # a choice measured in this process after a peek found nothing is the one peek gives
    assert tuning.peek("later", ["a", "b"]) == "a"
    assert tuning.choose("later", ["a", "b"], {"a": 3.0, "b": 1.0}.get) == "b"
    assert tuning.peek("later", ["a", "b"]) == "b"


def test_a_choice_another_process_stored_while_this_one_measured_wins(tuning_cache):
    def measure(candidate):    # meanwhile, a worker beside this process stored its own choice
        tuning_cache.write_text(json.dumps({f"{tuning.machine_key()}|probe": {"choice": "a"}}))
        return {"a": 3.0, "b": 1.0}[candidate]

    assert tuning.choose("probe", ["a", "b"], measure) == "a"
    assert tuning.choose("probe", ["a", "b"], measure) == "a"
    assert json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|probe"]["choice"] == "a"


def _measure_preferring(own: str, threads: int) -> object:
    """In a fresh process with the test's `threads` (part of the stored key): choose between 'a'
    and 'b' while finding its own one fastest."""
    import time

    import torch

    from sgraf.kernels import tuning

    torch.set_num_threads(threads)

    def measure(candidate):
        time.sleep(0.3)        # the two processes measure at the same time
        return 1.0 if candidate == own else 3.0

    return tuning.choose("race", ["a", "b"], measure)


def test_two_processes_measuring_at_once_agree_on_one_choice(tuning_cache):
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        choices = list(pool.map(_measure_preferring, ["a", "b"], [torch.get_num_threads()] * 2))
    assert choices[0] == choices[1] in ("a", "b")
    assert json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|race"]["choice"] == choices[0]


def test_a_stored_choice_that_is_no_longer_a_candidate_is_measured_again(tuning_cache):
    tuning_cache.write_text(json.dumps({f"{tuning.machine_key()}|probe": {"choice": "gone"}}))
    assert tuning.choose("probe", [1, 2], lambda c: 1.0 / c) == 2


def test_rounds_measure_the_candidates_in_turns_and_keep_each_ones_best(tuning_cache):
    """A load that comes and goes while probing (another process starting beside this one) must
    reach every candidate: with rounds, they are timed in turns (every other round reversed) and
    each keeps its best time. Here 'b' is truly faster but was timed in a busy moment first."""
    calls = []
    times = {"a": [1.0, 1.0, 1.0], "b": [3.0, 0.8, 0.8]}

    def measure(candidate):
        calls.append(candidate)
        return times[candidate].pop(0)

    assert tuning.choose("once", ["a", "b"], lambda c: {"a": 1.0, "b": 3.0}[c]) == "a"
    assert tuning.choose("turns", ["a", "b"], measure, rounds=3) == "b"
    assert calls == ["a", "b", "b", "a", "a", "b"]
    entry = json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|turns"]
    assert entry["seconds"] == {'"a"': 1.0, '"b"': 0.8} and entry["rule"] == "keep 0.2, near 0.03, 3 rounds"
    assert "rule" not in json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|once"]


def test_a_choice_stored_under_another_rule_is_measured_again(tuning_cache):
    """A choice made by an earlier rule (a wider `keep`, one round) does not outlive the rule."""
    key = f"{tuning.machine_key()}|probe"
    tuning_cache.write_text(json.dumps({key: {"choice": "a", "seconds": {'"a"': 1.15, '"b"': 1.0}}}))
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured")) == "a"   # the same rule
    tuning.forget()
    assert tuning.choose("probe", ["a", "b"], {"a": 1.15, "b": 1.0}.get, keep=0.1, rounds=2) == "b"
    assert json.loads(tuning_cache.read_text())[key]["rule"] == "keep 0.1, near 0.03, 2 rounds"
    tuning.forget()
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured"), keep=0.1, rounds=2) == "b"
    assert tuning.peek("probe", ["a", "b"]) == "b"


def test_the_matmul_routes_are_probed_in_rounds_with_a_narrower_margin(tuning_cache, monkeypatch):
    """oneDNN (the default) gives way to MKL when MKL is over 10 % faster in the probe (Zen 3:
    1.2-1.5x there, 1.1x over a whole step); within 10 % it stays."""
    if not cpu.ONEDNN:
        pytest.skip("oneDNN's linear is not called under this PyTorch")
    for aten_seconds, expected in ((0.85, "aten"), (0.95, "onednn")):
        tuning.forget()
        tuning_cache.unlink(missing_ok=True)
        timed = []
        monkeypatch.setattr(cpu, "_time_route", lambda route: timed.append(route) or {"onednn": 1.0}.get(
            route, aten_seconds))
        assert cpu._choose_route("matmul", "") == expected
        assert timed == ["onednn", "aten", "aten", "onednn", "onednn", "aten"]


def test_tuning_off_gives_the_default_without_measuring(tuning_cache, monkeypatch):
    monkeypatch.setenv("SGRAF_TUNE", "off")
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured")) == "a"
    assert not tuning_cache.exists()


def test_a_default_taken_while_tuning_was_off_is_not_kept_once_it_is_on(tuning_cache, monkeypatch):
    """A test (or a caller) that turns tuning off for a while must not leave its defaults behind:
    the process would then compute with other routes than another process reading the store
    (a resumed run's bits differed from the uninterrupted run's that way)."""
    tuning.choose("probe", ["a", "b"], {"a": 2.0, "b": 1.0}.get)          # stored: b
    tuning.forget()
    monkeypatch.setenv("SGRAF_TUNE", "off")
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured")) == "a"
    assert tuning.peek("probe", ["a", "b"]) == "a"
    monkeypatch.setenv("SGRAF_TUNE", "on")
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured")) == "b"
    assert tuning.peek("probe", ["a", "b"]) == "b"
    monkeypatch.setenv("SGRAF_TUNE", "off")       # off again: the defaults, whatever was chosen
    assert tuning.choose("probe", ["a", "b"], lambda c: pytest.fail("measured")) == "a"
    assert tuning.peek("probe", ["a", "b"]) == "a"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", ""])
def test_a_damaged_store_is_ignored_and_rewritten(tuning_cache, content):
    tuning_cache.write_text(content)
    assert tuning.choose("probe", ["a", "b"], {"a": 2.0, "b": 1.0}.get) == "b"
    assert json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|probe"]["choice"] == "b"


def test_an_unwritable_store_still_chooses_once_per_process(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SGRAF_CACHE_DIR", str(blocker / "sub"))   # a folder under a file: cannot exist
    tuning.forget()
    try:
        calls = []
        assert tuning.choose("probe", ["a", "b"], lambda c: calls.append(c) or {"a": 2.0, "b": 1.0}[c]) == "b"
        assert tuning.choose("probe", ["a", "b"], lambda c: calls.append(c) or 0.0) == "b" and len(calls) == 2
    finally:
        tuning.forget()
    assert list(tmp_path.iterdir()) == [blocker]                   # no temporary file left behind


def test_the_machine_key_names_processor_torch_and_threads():
    key = tuning.machine_key()
    assert tuning.cpu_model() in key and torch.__version__ in key and f"{torch.get_num_threads()} threads" in key


@pytest.mark.parametrize("route", cpu.ROUTES)
def test_both_float32_routes_compute_the_linear_layer(monkeypatch, route):
    monkeypatch.setenv("SGRAF_CPU_MATMUL", route)
    assert cpu.float32_route() == route or not cpu.ONEDNN
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=generator)
    weight, bias = torch.randn(7, 24, generator=generator), torch.randn(7, generator=generator)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert_close(cpu.fast_linear(x, weight, bias), expected, REORDERED, scale=largest(expected))
    assert_close(cpu.fast_linear(x, weight, bias, relu=True), expected.clamp(min=0), REORDERED,
                 scale=largest(expected))
    # training: forward and all three gradients
    params = [t.clone().requires_grad_() for t in (x, weight, bias)]
    reference = [t.double().clone().requires_grad_() for t in (x, weight, bias)]
    upstream = torch.randn(2, 5, 7, generator=generator)
    (cpu.train_linear(*params) * upstream).sum().backward()
    (F.linear(*reference) * upstream.double()).sum().backward()
    for got, want in zip(params, reference):
        assert_close(got.grad, want.grad, REORDERED, scale=largest(want.grad))
    # weight gradients with an input wider than the output (W_loc's) and narrower (the GRU's)
    for out_features, in_features in ((3, 6), (6, 3)):
        rows = torch.randn(9, out_features, generator=generator)
        inputs = torch.randn(9, in_features, generator=generator)
        assert_close(cpu.weight_gradient(rows, inputs), rows.double().t() @ inputs.double(), REORDERED)
    addend = torch.randn(2, 5, 7, generator=generator).reshape(10, 7)
    assert_close(cpu.linear_add(x.reshape(10, 24), weight, addend),
                 addend.double() + x.reshape(10, 24).double() @ weight.double().t(), REORDERED)


@pytest.mark.parametrize("route", cpu.ROUTES)
def test_the_encoders_linear_layers_take_the_route_to_train_and_are_nn_linear_otherwise(monkeypatch, route):
    """`TrainLinear` (the image encoder and the self-attention layers): `train_linear` while
    autograd records, `nn.Linear` itself without autograd and within `authors_kernels` (the
    authors' stand-ins); the same parameters and state-dict keys as `nn.Linear`."""
    monkeypatch.setenv("SGRAF_CPU_MATMUL", route)
    routed = []
    apply = cpu._OneDNNLinear.apply
    monkeypatch.setattr(cpu._OneDNNLinear, "apply", lambda *args: routed.append(1) or apply(*args))
    torch.manual_seed(0)
    layer, plain = cpu.TrainLinear(24, 7), torch.nn.Linear(24, 7)
    plain.load_state_dict(layer.state_dict())
    assert list(layer.state_dict()) == list(plain.state_dict()) and isinstance(layer, torch.nn.Linear)
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        assert torch.equal(layer(x), plain(x)) and not routed
    with cpu.authors_kernels():
        assert torch.equal(layer(x), plain(x)) and not routed
    out = layer(x.requires_grad_())
    assert len(routed) == (1 if route == "onednn" and cpu.ONEDNN else 0)
    assert_close(out, F.linear(x.double(), layer.weight.double(), layer.bias.double()), REORDERED)
    out.sum().backward()
    assert_close(layer.weight.grad, x.detach().double().sum(dim=(0, 1)).expand(7, 24), REORDERED)


def test_the_authors_stand_in_trains_on_pytorchs_own_matmuls(monkeypatch):
    """`authors_forward` is timed as the authors' code: none of its layers takes oneDNN's route
    (sgraf's encoders do, where it is the faster)."""
    from model_helpers import random_batch, random_model
    from sgraf.model.oracle import authors_forward

    monkeypatch.setenv("SGRAF_CPU_MATMUL", "onednn")
    routed = []
    apply = cpu._OneDNNLinear.apply
    monkeypatch.setattr(cpu._OneDNNLinear, "apply", lambda *args: routed.append(1) or apply(*args))
    model = random_model(module="saf").train()
    images, captions, lengths = random_batch(model, 3, [5, 4, 3])
    authors_forward(model, images, captions, lengths)["saf"].sum().backward()
    assert routed == []
    model.img_enc(images).sum().backward()
    assert len(routed) == (1 if cpu.ONEDNN else 0)


def test_a_forced_route_must_be_known(monkeypatch):
    monkeypatch.setenv("SGRAF_CPU_MATMUL", "mkl")
    with pytest.raises(InputError, match=r"SGRAF_CPU_MATMUL must be auto \(the measured choice\) or one of "
                                         r"onednn, aten, got 'mkl'"):
        cpu.float32_route()
    monkeypatch.setenv("SGRAF_CPU_MATMUL", " AUTO ")
    assert cpu.float32_route() in cpu.ROUTES
    monkeypatch.setenv("SGRAF_EDGE_ROUTE", "auto")
    assert edges._forced() == ""


@pytest.mark.parametrize("kind", ["matmul", "weight gradient"])
def test_each_route_is_measured_once_and_stored(tuning_cache, monkeypatch, kind):
    """The matmul route (oneDNN first) and, apart, the weight gradients' (MKL first: it reads the
    transposed operands in place) are each measured once and stored, by `tuning.choose`'s rule."""
    monkeypatch.delenv("SGRAF_CPU_MATMUL", raising=False)
    if not cpu.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN: the only route is aten")
    route_of, candidates = {"matmul": (cpu.float32_route, cpu.ROUTES),
                            "weight gradient": (cpu.weight_gradient_route, cpu.ROUTES[::-1])}[kind]
    route = route_of()
    entry = json.loads(tuning_cache.read_text())[f"{tuning.machine_key()}|cpu float32 {kind} route"]
    seconds = {r: entry["seconds"][json.dumps(r)] for r in cpu.ROUTES}
    assert route == entry["choice"] == expected_choice(seconds, candidates, keep=cpu.ROUTE_KEEP)
    assert entry["rule"] == f"keep {cpu.ROUTE_KEEP:g}, near 0.03, {cpu.ROUTE_ROUNDS} rounds"


def test_the_weight_gradient_route_defaults_to_mkl_and_is_forced_with_the_rest(monkeypatch):
    monkeypatch.setenv("SGRAF_TUNE", "off")
    # the defaults, whatever route the environment forces (scripts/numerics-matrix sets it)
    monkeypatch.delenv("SGRAF_CPU_MATMUL", raising=False)
    assert cpu.weight_gradient_route() == "aten" and cpu.float32_route() == ("onednn" if cpu.ONEDNN else "aten")
    monkeypatch.setenv("SGRAF_CPU_MATMUL", "onednn")
    assert cpu.weight_gradient_route() == cpu.float32_route() == ("onednn" if cpu.ONEDNN else "aten")


@pytest.mark.parametrize("version, available, usable", [
    ("2.11.0+cu130", True, False), ("2.12.0a0+git1234", True, False), ("2.12.1+cu130", True, True),
    ("2.13.0+cpu", True, True), ("2.13.0+cpu", False, False)])
def test_onednn_is_called_only_where_a_signal_cannot_crash_it(version, available, usable):
    assert cpu.onednn_usable(version, available, has_linear=True) is usable
    assert not cpu.onednn_usable(version, available, has_linear=False)


SIGNALLED_MATMULS = """
import signal, torch
from sgraf.kernels import cpu
received = []
signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
generator = torch.Generator().manual_seed(0)
rows, inputs = torch.randn(4096, 256, generator=generator), torch.randn(4096, 1024, generator=generator)
weight = torch.randn(256, 1024, generator=generator)
print("ready", flush=True)
for _ in range(30):
    cpu.weight_gradient(rows, inputs)
    cpu.fast_linear(inputs, weight, relu=True)
    cpu.train_linear(inputs, weight)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("done", len(received), cpu.ONEDNN, flush=True)
"""


def test_a_signal_during_the_cpu_matmuls_crashes_nothing():
    """Training turns SIGTERM and SIGINT into a stop after the step through a Python handler.
    Under PyTorch 2.11 a signal arriving during oneDNN's linear corrupted the heap (see
    `sgraf.kernels.cpu`): every route sgraf may take here, forced to oneDNN where it allows it,
    keeps computing under a SIGTERM every 10 ms."""
    env = dict(os.environ, SGRAF_CPU_MATMUL="onednn", SGRAF_TUNE="0")
    process = subprocess.Popen([sys.executable, "-c", SIGNALLED_MATMULS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().strip() == "ready"
        signals = 0
        while process.poll() is None and signals < 3000:
            process.send_signal(signal.SIGTERM)
            signals += 1
            time.sleep(0.01)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0 and out.startswith("done"), (process.returncode, err[-2000:])
    assert int(out.split()[1]) > 10            # the signals arrived while it computed


def test_eval_chunks_are_measured_per_precision_and_change_no_score(tuning_cache, monkeypatch):
    from sgraf.kernels import eval_chunks
    from sgraf.precision import autocast

    # small candidates so that the probe block really splits: 1, 2 and 4 pairs of 16 words x d=16
    pair = 16 * 16 * 4
    monkeypatch.setattr(eval_chunks, "EVAL_CHUNK_CANDIDATES", (4 * pair, pair, 2 * pair))
    model = random_model(3, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 5, [6, 3, 11, 3, 8], pad_to=13, seed=2)
    before = model.score(images, captions, lengths)
    chosen = model.tune_eval(torch.device("cpu"))
    assert chosen in eval_chunks.EVAL_CHUNK_CANDIDATES
    assert model.eval_chunk_bytes(torch.float32) == chosen
    with autocast("bf16"):
        assert model.tune_eval(torch.device("cpu")) in eval_chunks.EVAL_CHUNK_CANDIDATES
    stored = json.loads(tuning_cache.read_text())
    chunk_keys = [key for key in stored if "eval chunk bytes" in key]
    assert len(chunk_keys) == 2 and {"torch.float32", "torch.bfloat16"} == {
        dtype for key in chunk_keys for dtype in ("torch.float32", "torch.bfloat16") if f"|{dtype}|" in key}
    assert_close(model.score(images, captions, lengths), before, SAME_PATH)
    # a scorer's own way of timing (here: a timer that prefers the largest chunks), under its
    # label, holds inside frozen_weights only
    largest_fastest = lambda block: (block(), 1.0 / model.eval_chunk_bytes(torch.float32))[1]  # noqa: E731
    with model.frozen_weights():
        assert model.tune_eval(torch.device("cpu"), largest_fastest, "2 blocks at once") == 4 * pair
        assert model.eval_chunk_bytes(torch.float32) == 4 * pair
    assert model.eval_chunk_bytes(torch.float32) == chosen
    assert any(key.endswith("|2 blocks at once") for key in json.loads(tuning_cache.read_text()))
    monkeypatch.setattr(eval_chunks, "EVAL_CHUNK_BYTES", 12345)          # a fixed size wins
    assert model.tune_eval(torch.device("cpu")) == model.eval_chunk_bytes(torch.float32) == 12345


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_scorers_thread_mode_is_measured_once_per_precision(tuning_cache, precision):
    from sgraf.model import blocks

    model = random_model(2, module="saf", num_regions=7)
    torch.set_num_threads(2)     # whatever the suite's count: the choice exists with several threads
    mode = blocks.thread_mode([model], precision, torch.device("cpu"))
    assert mode in blocks.THREAD_MODES[precision]
    key = f"{tuning.machine_key()}|cpu scoring threads|{precision}|{model.size_key()}"
    entry = json.loads(tuning_cache.read_text())[key]
    seconds = {m: entry["seconds"][json.dumps(m)] for m in blocks.THREAD_MODES[precision]}
    assert entry["choice"] == mode == expected_choice(seconds, blocks.THREAD_MODES[precision])
    assert blocks.score_workers(torch.device("cpu"), precision, 9, [model]) == (
        min(torch.get_num_threads(), 9) if mode == "blocks" else 1)


def test_only_large_splits_measure_before_scoring(tuning_cache, monkeypatch):
    from sgraf import scoring
    from sgraf.model import blocks
    from test_scoring import TinyVocab, tiny_split

    model = random_model(4, vocab_size=40, img_dim=12, num_regions=6)
    torch.set_num_threads(2)     # the thread mode is measured with several threads only
    encoded = scoring.encode_split(model, tiny_split(n_img=4), TinyVocab(), batch_size=4)
    small = scoring.score_matrix([model], [encoded], image_block=2)
    stored = json.loads(tuning_cache.read_text()) if tuning_cache.exists() else {}   # (the matmul route is measured)
    assert not any("scoring threads" in key or "chunk bytes" in key for key in stored)   # 4 x 20 pairs
    monkeypatch.setattr(blocks, "TUNE_MIN_PAIRS", 80)
    measured = scoring.score_matrix([model], [encoded], image_block=2)
    stored = json.loads(tuning_cache.read_text())
    assert any("cpu scoring threads|fp32" in key for key in stored)
    assert any("eval chunk bytes" in key for key in stored)
    assert_close(measured, small, SAME_PATH)


# ------------------------------------------------------------------ packing (sgraf.kernels.packing)

def test_packing_by_index_equals_torch_packing_values_and_gradients():
    """`Packing` moves the same numbers to the same places as pack_padded_sequence /
    pad_packed_sequence (unsorted lengths, ties, a batch wider than its longest caption)."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from sgraf.kernels.packing import Packing

    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 5, batch_first=True, bidirectional=True)
    lengths = torch.tensor([3, 7, 7, 1, 5, 2])
    x = torch.randn(6, 9, 6, requires_grad=True)
    reference = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    packing = Packing(lengths, x.device)
    packed = packing.pack(x)
    for field in ("data", "batch_sizes", "sorted_indices", "unsorted_indices"):
        assert torch.equal(getattr(packed, field), getattr(reference, field)), field
    expected, _ = pad_packed_sequence(gru(reference)[0], batch_first=True)
    states = packing.unpack(gru(packed)[0].data)
    assert torch.equal(states, expected)
    grad = torch.randn_like(expected)
    assert torch.equal(*(torch.autograd.grad(out, x, grad)[0] for out in (states, expected)))


# ------------------------------------------------------------------ the training GRU (sgraf.kernels.gru)

@pytest.mark.parametrize("route", cpu.ROUTES)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_packed_gru_equals_nn_gru_in_values_and_every_gradient(bidirectional, route, monkeypatch):
    """`packed_gru` computes `nn.GRU`'s outputs and the gradients of its input, weights and
    biases (unsorted lengths, ties, a caption of one word), its matmuls by either route."""
    from sgraf.kernels.gru import packed_gru
    monkeypatch.setenv("SGRAF_CPU_MATMUL", route)
    from sgraf.kernels.packing import Packing

    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 5, batch_first=True, bidirectional=bidirectional)
    lengths = torch.tensor([3, 7, 7, 1, 5, 2])
    x = torch.randn(6, 7, 6, requires_grad=True)
    packing = Packing(lengths, x.device)
    grad = torch.randn(6, 7, 10 if bidirectional else 5)
    results = []
    for ours in (False, True):
        packed = packing.pack(x)
        out = packed_gru(gru, packed.data, packed.batch_sizes.tolist()) if ours else gru(packed)[0].data
        states = packing.unpack(out)
        inputs = [x, *gru.parameters()]
        results.append((states, torch.autograd.grad(states, inputs, grad)))
    (expected, expected_grads), (states, grads) = results
    assert_close(states, expected, REORDERED)
    scale = largest(list(expected_grads))
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, GRADIENT, scale=scale)


def test_the_text_encoder_takes_the_packed_gru_only_to_train_on_the_cpu(monkeypatch):
    """Scoring (no autograd) runs `nn.GRU` itself; a float32 training pass on the CPU runs
    `packed_gru`, with the same states (under bf16 autocast too); two layers, bf16 weights or fp16
    autocast keep `nn.GRU`."""
    from sgraf.kernels import gru as gru_kernels
    from sgraf.model.encoders import TextEncoder

    torch.manual_seed(0)
    encoder = TextEncoder(50, 8, 6, 1)
    captions, lengths = torch.randint(1, 50, (4, 6)), torch.tensor([6, 2, 4, 4])
    calls = []
    original = gru_kernels.packed_gru
    monkeypatch.setattr(gru_kernels, "packed_gru", lambda *args: calls.append(1) or original(*args))
    encoder.eval()
    with torch.no_grad():
        scored = encoder(captions, lengths)
    assert calls == []
    trained = encoder(captions, lengths)
    assert calls == [1]
    assert_close(trained, scored, REORDERED)
    data = torch.zeros(3, 8)
    assert gru_kernels.supports(encoder.cap_rnn, data)
    assert not gru_kernels.supports(torch.nn.GRU(8, 6, 2), data)
    assert not gru_kernels.supports(encoder.cap_rnn, data.bfloat16())
    with plan.emulate_gpu():
        assert not gru_kernels.supports(encoder.cap_rnn, data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gru_kernels.supports(encoder.cap_rnn, data)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not gru_kernels.supports(encoder.cap_rnn, data)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_packed_gru_under_bf16_autocast_is_as_close_to_float64_as_nn_gru_under_it(seed):
    """Under bf16 autocast `packed_gru` rounds the matmuls' operands and products to bf16, as
    autocast does, and keeps the gates and the state in float32 (`nn.GRU` under autocast rounds
    the gates to bf16 as well, and its weights again at every time step): its states and every
    gradient are within the bf16 budgets of a float64 `nn.GRU`, and its states no further from
    it than `nn.GRU`'s under autocast."""
    import copy

    from sgraf.kernels.gru import packed_gru
    from sgraf.kernels.packing import Packing

    torch.manual_seed(seed)
    gru = torch.nn.GRU(6, 5, batch_first=True, bidirectional=True)
    lengths = torch.tensor([3, 7, 7, 1, 5, 2])
    x = torch.randn(6, 7, 6, requires_grad=True)
    packing = Packing(lengths, x.device)
    grad = torch.randn(6, 7, 10)
    results = {}
    for kind in ("float64", "nn.GRU", "packed_gru"):
        module = copy.deepcopy(gru).double() if kind == "float64" else gru
        inputs = x.detach().double().requires_grad_() if kind == "float64" else x
        packed = packing.pack(inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind != "float64"):
            out = packed_gru(module, packed.data, packed.batch_sizes.tolist()) if kind == "packed_gru" \
                else module(packed)[0].data
        states = packing.unpack(out)
        assert states.dtype == (torch.float64 if kind == "float64" else torch.float32)
        grads = torch.autograd.grad(states, [inputs, *module.parameters()], grad.to(states.dtype))
        results[kind] = (states.detach().double(), [g.double() for g in grads])
    expected, expected_grads = results["float64"]
    states, grads = results["packed_gru"]
    assert_close(states, expected, BFLOAT16, scale=1.0)
    scale = largest(expected_grads)
    for got, want in zip(grads, expected_grads):
        assert_close(got, want, BFLOAT16_GRADIENT, scale=scale)
    error = (states - expected).abs().max()
    assert error <= (results["nn.GRU"][0] - expected).abs().max()


# ------------------------------------------------------------------ freed memory (sgraf.kernels.memory)

FAULTS_SCRIPT = """
import resource, sys, torch
torch.set_num_threads(2)
from sgraf.kernels.memory import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "keep" else False)
def step():                                   # two blocks of about 57 MiB, as a training chunk's
    a = torch.empty(15_000_000).fill_(1.0)
    b = torch.empty(15_000_000).fill_(1.0)
    (a * b).sum()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_keeping_freed_memory_stops_most_page_faults_of_reused_blocks():
    """Blocks of a training chunk's size, freed and allocated again, are faulted in page by page
    under glibc's defaults (three blocks of 14,649 pages a step); after `keep_freed_memory()`
    most steps reuse them without a fault (glibc still gives one back now and then)."""
    counts = {}
    for mode in ("default", "keep"):
        proc = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, mode], capture_output=True, text=True,
                              env={**os.environ, "SGRAF_KEEP_FREED_MEMORY": "on"}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        changed, faults = proc.stdout.split()
        assert changed == ("True" if mode == "keep" else "False")
        counts[mode] = int(faults)
    assert counts["default"] > 6 * 3 * 14000, counts
    # a quarter or less here under PyTorch 2.13, 28 % under 2.3.1 (its allocator gives back more)
    assert counts["keep"] < counts["default"] / 3, counts


def test_keeping_freed_memory_can_be_turned_off_and_refuses_other_values(monkeypatch):
    from sgraf.kernels.memory import keep_freed_memory

    monkeypatch.setenv("SGRAF_KEEP_FREED_MEMORY", "off")
    assert keep_freed_memory() is False
    monkeypatch.setenv("SGRAF_KEEP_FREED_MEMORY", "sometimes")
    with pytest.raises(InputError, match=r"SGRAF_KEEP_FREED_MEMORY must be on or off \(or 1/0, true/false, "
                                         r"yes/no\), got 'sometimes'"):
        keep_freed_memory()


@pytest.mark.parametrize("variable", ["SGRAF_TUNE", "SGRAF_TOKEN_CACHE", "SGRAF_KEEP_FREED_MEMORY",
                                      "SGRAF_FAST_EXIT"])
def test_every_switch_reads_alike_and_a_command_refuses_a_typo_first(variable, monkeypatch, capsys):
    """The on/off variables had three readings: SGRAF_TUNE=of left tuning on, unsaid, while
    SGRAF_KEEP_FREED_MEMORY=0 was refused. One reading now, checked by every command first."""
    from sgraf.cli import main
    from sgraf.user_cache import switched_on

    for value, on in (("", True), ("On", True), ("1", True), ("yes", True), ("off", False), ("0", False),
                      ("FALSE", False), (" no ", False)):
        monkeypatch.setenv(variable, value)
        assert switched_on(variable) is on, value
    monkeypatch.setenv(variable, "of")
    assert main(["runs", "."]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"sgraf runs: error: {variable} must be on or off (or 1/0, true/false, yes/no), got 'of'", err


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("SGRAF_EDGE_ROUTE", "flash", "SGRAF_EDGE_ROUTE must be auto (the measured choice) or one of layout, sdpa, "
                                  "got 'flash'"),
    ("SGRAF_FILTER_ROUTE", "triton", "SGRAF_FILTER_ROUTE must be auto (the measured choice) or one of eager, "
                                     "fused, got 'triton'"),
    ("SGRAF_CPU_MATMUL", "mkl", "SGRAF_CPU_MATMUL must be auto (the measured choice) or one of onednn, aten, "
                                "got 'mkl'"),
    ("SGRAF_COMPILE", "fast", "SGRAF_COMPILE must be one of off, on, eval, train, all, auto, got 'fast'"),
    ("SGRAF_JOIN_TIMEOUT", "5m", "SGRAF_JOIN_TIMEOUT must be a number of seconds > 0, got '5m'")])
def test_a_choice_variable_set_wrong_stops_a_command_before_it_starts(variable, value, expected, monkeypatch,
                                                                      capsys, tmp_path):
    """These had been read only when the route was first taken: a typo stopped a run after its
    data had loaded, or, for SGRAF_JOIN_TIMEOUT, only under torchrun."""
    from sgraf.cli import main

    monkeypatch.setenv(variable, value)
    assert main(["runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"sgraf runs: error: {expected}"
    monkeypatch.setenv(variable, "auto" if variable != "SGRAF_JOIN_TIMEOUT" else "60")
    main(["runs", str(tmp_path)])
    assert "holds no sgraf run folder" in capsys.readouterr().err     # the command itself ran


def test_every_route_variable_is_checked_at_a_command_start():
    import re

    from sgraf.cli import ROUTE_VARIABLES

    kernels = pathlib.Path(cpu.__file__).parent
    source = "".join(path.read_text(encoding="utf-8") for path in kernels.glob("*.py"))
    assert set(re.findall(r'FusedRoutes\("(SGRAF_\w+)"', source)) | {"SGRAF_CPU_MATMUL", "SGRAF_EDGE_ROUTE"} == set(
        ROUTE_VARIABLES)


def test_a_forced_onednn_route_that_cannot_run_is_said(monkeypatch, caplog):
    from sgraf.kernels import cpu

    monkeypatch.setattr(cpu, "ONEDNN", False)
    cpu._say_once.cache_clear()
    with caplog.at_level("WARNING", logger="sgraf.kernels.cpu"):
        assert cpu._choose_route("matmul", "onednn") == "aten" and cpu._choose_route("matmul", "onednn") == "aten"
    assert [r.getMessage() for r in caplog.records if "SGRAF_CPU_MATMUL" in r.getMessage()] == [
        f"SGRAF_CPU_MATMUL=onednn is not taken under PyTorch {cpu.torch.__version__} (oneDNN's linear there is "
        "not safe against signals, or oneDNN is missing): the aten route runs"]


def test_the_compiled_paths_refuse_a_pytorch_that_cannot_trace_them_in_one_line(monkeypatch):
    """Before PyTorch 2.5 sgraf's compiled paths do not trace (2.3: an autograd Function's
    `needs_input_grad`; new weights recompiled): `SGRAF_COMPILE` and `compiling` say so in one
    line instead of failing inside Dynamo; off stays off."""
    from sgraf import torch_compat
    from sgraf.kernels import compiled

    monkeypatch.setattr(torch_compat, "compile_supported", lambda: False)
    monkeypatch.setenv("SGRAF_COMPILE", "train")
    with pytest.raises(InputError, match=r"^SGRAF_COMPILE=train needs PyTorch 2\.5 or later \(this is "):
        compiled.mode()
    with pytest.raises(InputError, match=r"^compiling\('eval'\) needs PyTorch 2\.5 or later"):
        with compiled.compiling("eval"):
            pass
    monkeypatch.setenv("SGRAF_COMPILE", "off")
    assert compiled.mode() == "off" and not compiled.eval_enabled()
