"""Precision is one switch: `autocast(precision, device)` returns the context to run under."""

from __future__ import annotations

import contextlib

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
