"""Precision is one switch: `autocast(precision, device)` returns the context to run under."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

import torch

from sgraf import torch_compat
from sgraf.config import PRECISIONS
from sgraf.errors import InputError
from sgraf.kernels import plan

logger = logging.getLogger(__name__)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def validation_precision(training: str) -> str:
    """The precision a training run in `training` precision validates in: bf16 in bf16, fp16 and
    fp32 in fp32 (`sgraf.training.loop.validate`; `sgraf evaluate` names it for a run's checkpoint)."""
    return "bf16" if training == "bf16" else "fp32"


def autocast(precision: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Autocast context for `precision` ('fp32' gives a null context) on `device`."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if device_type == "cpu" and not plan.gpu_plan(device_type):   # (not the GPU plan emulated on the CPU)
        slow_on_this_cpu(precision)
    needed = torch_compat.mps_autocast_missing(dtype) if device_type == "mps" else None
    if needed is not None:      # there autocast would be off, unsaid, while the scores said bf16
        raise InputError(f"precision {precision} on mps needs PyTorch {needed[0]}.{needed[1]} or later (autocast on "
                         f"Apple's GPU), this is {torch_compat.VERSION}; use fp32")
    return torch.autocast(device_type=device_type, dtype=dtype)


@functools.cache
def slow_on_this_cpu(precision: str) -> bool:
    """Whether `precision` ('bf16' or 'fp16') is a slow path on this CPU; the first time it is,
    a warning says so (once per process and precision; `autocast` asks on the CPU).

    Its matmuls are fast only through oneDNN's kernels for that type (bf16: AVX-512 BF16 or
    AMX; fp16: AVX-512 FP16 or AMX-FP16). Without them PyTorch falls back to generic matmuls:
    on a 2-core AMD EPYC Zen 3 (AVX2) SGR scored 323 pairs/s in bf16 against 2,330 in fp32
    (`benchmarks/bench_score.py --small`).
    """
    from sgraf.kernels.cpu import onednn_runs

    if onednn_runs(torch.bfloat16 if precision == "bf16" else torch.float16):
        return False
    needs = "AVX-512 BF16 or AMX" if precision == "bf16" else "AVX-512 FP16 or AMX-FP16"
    logger.warning("%s on this CPU is several times slower than fp32: its matmuls have no fast kernel here "
                   "(they need %s); fp32 is this machine's fast precision", precision, needs)
    return True


def current_precision(device: torch.device | str = "cpu") -> str:
    """The precision of the autocast context active on `device`'s type now ('fp32' outside one)."""
    device_type = torch.device(device).type
    if not torch_compat.autocast_enabled(device_type):
        return "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(torch_compat.autocast_dtype(device_type), "fp32")


_rnn_lock = threading.Lock()
_rnn_inside = 0              # threads inside `rnn_like_matmul` with the flag changed
_rnn_saved: bool | None = None


@contextlib.contextmanager
def rnn_like_matmul(device: torch.device | str) -> Iterator[None]:
    """On CUDA, cuDNN's recurrent layers (the caption GRU) in the float32 matmuls' precision.

    PyTorch lets cuDNN use TF32 by default while it keeps float32 matmuls exact, so on an Ampere
    or later GPU the caption GRU alone would run in TF32 and the scores leave the CPU's by about
    1e-3 (seen on an H200). Under this context the GRU follows
    `torch.backends.cuda.matmul.allow_tf32`: exact by default, TF32 under `tf32(True)`. The flag
    is process-wide: it is changed while at least one thread is inside (threads scoring at once,
    as the service does, keep it changed until the last one leaves) and put back after.
    """
    global _rnn_inside, _rnn_saved
    wanted = torch.backends.cuda.matmul.allow_tf32
    if torch.device(device).type != "cuda":
        yield
        return
    with _rnn_lock:
        changed = _rnn_inside > 0 or torch.backends.cudnn.allow_tf32 != wanted
        if changed:
            if _rnn_inside == 0:
                _rnn_saved, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, wanted
            _rnn_inside += 1
    try:
        yield
    finally:
        if changed:
            with _rnn_lock:
                _rnn_inside -= 1
                if _rnn_inside == 0:
                    torch.backends.cudnn.allow_tf32 = bool(_rnn_saved)


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


@contextlib.contextmanager
def low_precision_weights(model: torch.nn.Module, precision: str,
                          device: torch.device | str = "cpu") -> Iterator[None]:
    """Within this context every `nn.Linear` of `model` computes with a `precision` copy of its
    weight and bias, made for all of them in one multi-tensor copy on entry; on exit the copies'
    gradients go to the parameters (float32) in one multi-tensor copy. A null context for fp32.

    Autocast casts each weight where an operation reads it and casts each gradient back in
    backward: about a hundred small copies per training step (twice as many for a recomputed
    chunk, whose forward runs again in a new autocast region). The copies hold the same values as
    those casts, so the step computes the same numbers. Run forward AND backward inside the
    context, under `autocast(precision, device)`; the parameters must not change inside it.
    """
    check_precision(precision)
    if precision == "fp32":
        yield
        return
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    slots = [(module, name) for module in model.modules() if isinstance(module, torch.nn.Linear)
             for name in ("weight", "bias")
             if module._parameters.get(name) is not None and module._parameters[name].requires_grad
             and module._parameters[name].dtype == torch.float32]
    originals = [module._parameters[name] for module, name in slots]
    copies = [torch.empty_like(p, dtype=dtype) for p in originals]
    if copies:
        with torch.no_grad():
            torch._foreach_copy_(copies, originals)
    for (module, name), low in zip(slots, copies):
        module._parameters[name] = torch.nn.Parameter(low)
    swapped = [module._parameters[name] for module, name in slots]
    try:
        yield
    finally:
        for (module, name), original in zip(slots, originals):
            module._parameters[name] = original
        pairs = [(p, low.grad) for p, low in zip(originals, swapped) if low.grad is not None]
        fresh = [(p, grad) for p, grad in pairs if p.grad is None]
        for p, grad in pairs:
            if p.grad is not None:      # a gradient from elsewhere: add to it
                p.grad.add_(grad)
        if fresh:
            grads = [torch.empty_like(p) for p, _ in fresh]
            with torch.no_grad():
                torch._foreach_copy_(grads, [grad for _, grad in fresh])
            for (p, _), grad in zip(fresh, grads):
                p.grad = grad
