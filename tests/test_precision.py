"""Precision switches: autocast by name, the ambient precision, and TF32 only when asked."""

from __future__ import annotations

import torch

from sgraf.precision import autocast, current_precision, tf32


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
