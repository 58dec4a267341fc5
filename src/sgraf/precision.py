"""Precision is one switch: `autocast(precision, device)` returns the context to run under."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(precision: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Autocast context for `precision` ('fp32' gives a null context) on `device`."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def current_precision(device: torch.device | str = "cpu") -> str:
    """The precision of the autocast context active on `device`'s type now ('fp32' outside one)."""
    device_type = torch.device(device).type
    if not torch.is_autocast_enabled(device_type):
        return "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(torch.get_autocast_dtype(device_type), "fp32")


@contextlib.contextmanager
def tf32(enabled: bool = False) -> Iterator[None]:
    """CUDA float32 matmuls and convolutions in TF32 (10-bit mantissa) or exact float32, for the
    duration; the previous settings are restored after. sgraf keeps fp32 exact unless asked
    (`--tf32`, `TrainConfig.tf32`): PyTorch allows TF32 in cuDNN (the GRU, convolutions) by default.
    """
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
