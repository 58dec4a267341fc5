"""Precision switches: autocast by name, the ambient precision, and TF32 only when asked."""

from __future__ import annotations

import contextlib

import pytest
import torch

from numerics import BFLOAT16, assert_close, largest
from sgraf.precision import autocast, current_precision, low_precision_weights, rnn_like_matmul, tf32


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_current_precision_reads_the_ambient_autocast():
    assert current_precision("cpu") == "fp32"
    with autocast("bf16", "cpu"):
        assert current_precision("cpu") == "bf16"
        assert current_precision("cuda") == "fp32"   # autocast is per device type
    assert current_precision("cpu") == "fp32"


def test_tf32_is_off_unless_asked_and_the_previous_setting_comes_back():
    before = _flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # PyTorch's cuDNN default
        with tf32():
            assert _flags() == (False, False)
        assert _flags() == (True, True)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        with tf32(True):
            assert _flags() == (True, True)
        assert _flags() == (False, False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture
def tf32_flags():
    """Sets (matmul, cuDNN) TF32 flags for a test and puts PyTorch's back after (monkeypatch cannot:
    `torch.backends.cuda.matmul` answers its attributes through __getattr__)."""
    before = _flags()

    def set_flags(matmul: bool, cudnn: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn

    yield set_flags
    set_flags(*before)


@pytest.mark.parametrize("matmul_tf32", [False, True])
def test_the_caption_gru_follows_the_float32_matmul_precision_on_cuda(matmul_tf32, tf32_flags, monkeypatch):
    """PyTorch allows TF32 in cuDNN (the GRU) by default while float32 matmuls stay exact: on an
    H200 that put GPU scores ~1e-3 off the CPU's. The GRU runs with cuDNN's flag set to the
    matmuls' for the call only; elsewhere, and on other devices, nothing changes."""
    from sgraf.model import encoders

    tf32_flags(matmul_tf32, not matmul_tf32)
    with rnn_like_matmul("cuda"):
        assert torch.backends.cudnn.allow_tf32 is matmul_tf32
    assert torch.backends.cudnn.allow_tf32 is (not matmul_tf32)
    with rnn_like_matmul("cpu"):
        assert torch.backends.cudnn.allow_tf32 is (not matmul_tf32)
    with pytest.raises(RuntimeError), rnn_like_matmul(torch.device("cuda", 0)):
        raise RuntimeError("restored on an error too")
    assert torch.backends.cudnn.allow_tf32 is (not matmul_tf32)
    # the text encoder's scoring path (no gradients: nn.GRU, cuDNN's on a GPU) runs under it
    seen = []
    real = encoders.rnn_like_matmul
    monkeypatch.setattr(encoders, "rnn_like_matmul", lambda device: seen.append(torch.device(device)) or real(device))
    encoder = encoders.TextEncoder(20, 8, 6, 1)
    with torch.no_grad():
        encoder(torch.randint(1, 20, (3, 5)), torch.tensor([5, 3, 2]))
    assert seen == [torch.device("cpu")]


def test_the_gru_precision_stays_set_while_any_thread_is_inside(tf32_flags):
    """The service scores in several threads: one leaving must not put TF32 back under another's
    GRU; the last one out restores PyTorch's setting."""
    import threading

    tf32_flags(False, True)
    inside, leave = threading.Barrier(2), threading.Event()
    seen = []

    def second():
        with rnn_like_matmul("cuda"):
            inside.wait(timeout=30)
            leave.wait(timeout=30)
            seen.append(torch.backends.cudnn.allow_tf32)

    thread = threading.Thread(target=second, daemon=True)
    try:
        with rnn_like_matmul("cuda"):        # this thread changes the flag, the second enters after
            thread.start()
            inside.wait(timeout=30)
        assert torch.backends.cudnn.allow_tf32 is False     # the other thread is still inside
    finally:
        leave.set()
        thread.join(timeout=30)
    assert seen == [False]
    assert torch.backends.cudnn.allow_tf32 is True


def test_training_and_evaluate_run_under_their_tf32_setting(monkeypatch, tmp_path):
    from sgraf.cli import main
    from sgraf.training import loop
    from sgraf.training.config import TrainConfig

    seen = []
    monkeypatch.setattr(loop, "_fit", lambda *args, **kwargs: seen.append(_flags()) or {})
    loop.fit(TrainConfig(), tmp_path, tmp_path / "run")
    loop.fit(TrainConfig(tf32=True), tmp_path, tmp_path / "run")
    assert seen == [(False, False), (True, True)]

    import sgraf.evaluate as evaluate_module
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoints",
                        lambda *args, **kwargs: seen.append(_flags()) or {"rsum": 0.0})
    for flags in ([], ["--tf32"]):
        assert main(["evaluate", "--checkpoint", "x.pt", "--data", str(tmp_path), "--json", "--device", "cpu",
                     *flags]) == 0
    assert seen[2:] == [(False, False), (True, True)]


@pytest.mark.parametrize("module, chunk", [("sgr", None), ("saf", None), ("sgr", 2)])
def test_low_precision_weights_give_autocasts_numbers_without_its_casts(module, chunk):
    """bf16 copies of the linear layers' weights, made once: the same scores as autocast casting
    every weight at every use, and the same gradients up to bf16 sums (2 captions per chunk:
    recomputed chunks too)."""
    from model_helpers import random_batch, random_model
    from sgraf.model.loss import ranking_loss

    images, captions, lengths = random_batch(random_model(module=module), 5, [4, 7, 3, 6, 5])
    results = []
    for copies in (False, True):
        model = random_model(module=module).train()
        model.train_chunk, model.train_checkpoint = chunk, True
        weights = low_precision_weights(model, "bf16") if copies else contextlib.nullcontext()
        with weights:
            with autocast("bf16"):
                scores = model(images, captions, lengths)
            ranking_loss(scores.float()).backward()
        assert all(p.dtype == torch.float32 for p in model.parameters())     # the parameters are back
        results.append((scores.detach().float(), {n: p.grad for n, p in model.named_parameters()}))
    (scores, grads), (scores_copies, grads_copies) = results
    assert torch.equal(scores, scores_copies)
    assert grads.keys() == grads_copies.keys()
    for name, grad in grads.items():
        assert grads_copies[name].dtype == torch.float32, name
        # the same bf16 gradient of each use; summed in bf16 where one weight is used several times
        # (SGR's W_q twice per step, every chunk), where autocast's casts of views and of recomputed
        # chunks were summed in float32
        assert_close(grads_copies[name], grad, BFLOAT16, scale=largest(list(grads.values())))
        if module == "saf" and chunk is None:
            assert torch.equal(grad, grads_copies[name]), name


def test_low_precision_weights_is_nothing_in_fp32():
    model = torch.nn.Linear(3, 2)
    with low_precision_weights(model, "fp32"):
        assert model.weight.dtype == torch.float32


def test_a_low_precision_without_fast_kernels_on_this_cpu_is_named_once(monkeypatch, caplog):
    """bf16 or fp16 on a CPU whose oneDNN has no kernel for it (an AVX2-only processor) runs
    PyTorch's generic matmuls, several times slower than fp32: the first autocast of each says so
    in one warning; a CPU with the kernels, fp32 and the GPU plan emulated on the CPU say nothing."""
    import logging

    from sgraf import precision
    from sgraf.kernels import cpu, plan

    monkeypatch.setattr(cpu, "onednn_runs", lambda dtype: False)
    precision.slow_on_this_cpu.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="sgraf.precision"):
            with plan.emulate_gpu(2**30), autocast("bf16", "cpu"):
                pass
            assert not caplog.records
            for _ in range(2):
                for name in ("fp32", "bf16", "fp16"):
                    with autocast(name, "cpu"):
                        assert current_precision("cpu") == name
            messages = [record.getMessage() for record in caplog.records]
            assert len(messages) == 2, messages
            assert messages[0].startswith("bf16 on this CPU is several times slower than fp32")
            assert "AVX-512 BF16 or AMX" in messages[0] and "AVX-512 FP16" in messages[1]
            assert all(record.levelname == "WARNING" for record in caplog.records)

            caplog.clear()
            precision.slow_on_this_cpu.cache_clear()
            monkeypatch.setattr(cpu, "onednn_runs", lambda dtype: True)
            with autocast("bf16", "cpu"), autocast("fp16", "cpu"):
                pass
            assert not caplog.records
    finally:
        precision.slow_on_this_cpu.cache_clear()


def test_low_precision_on_mps_needs_a_pytorch_with_autocast_there(monkeypatch):
    """Before PyTorch 2.5 (fp16) and 2.6 (bf16) MPS has no autocast: the scores would have been
    fp32, recorded as bf16."""
    from sgraf import torch_compat
    from sgraf.errors import InputError
    from sgraf.precision import autocast

    monkeypatch.setattr(torch_compat, "VERSION", torch.torch_version.TorchVersion("2.5.1"))
    with pytest.raises(InputError, match=r"^precision bf16 on mps needs PyTorch 2.6 or later .* this is 2.5.1; "
                                         r"use fp32$"):
        autocast("bf16", "mps")
    assert torch_compat.mps_autocast_missing(torch.float16) is None
    monkeypatch.setattr(torch_compat, "VERSION", torch.torch_version.TorchVersion("2.13.0"))
    assert torch_compat.mps_autocast_missing(torch.bfloat16) is None
