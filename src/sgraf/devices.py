"""Which torch device a name means on this machine, checked before any work starts.

Every entry point that takes a device (`--device`, the training config's `device`, `Matcher`)
resolves it here, so a device this PyTorch cannot use is refused in one line that lists the
ones it can, instead of failing deep inside the first `.to(device)`.
"""

from __future__ import annotations

import os

import torch

from sgraf.errors import InputError

SUPPORTED_TYPES = ("cpu", "cuda", "mps")


def available_cores() -> int:
    """CPU cores this process may run on (its affinity, where the system tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def available_devices() -> list[str]:
    """The devices this process can use: 'cpu', then 'cuda:0' ... and 'mps' when present."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def resolve_device(name: str | torch.device | None, what: str = "device") -> torch.device:
    """The `torch.device` that `name` means here, or a one-line `InputError`.

    Args:
        name: 'cpu', 'cuda', 'cuda:N', 'mps', a `torch.device`, or None / 'auto' (CUDA when
            available, else the CPU).
        what: how the caller's user named the setting (e.g. '--device'), for the message.

    Raises:
        InputError: not a device name, a device type sgraf does not run on, or a device this
            machine or PyTorch build does not have; the message lists the available ones.
    """
    if name is None or (isinstance(name, str) and name.strip().lower() == "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    available = ", ".join(available_devices())
    try:
        device = torch.device(name.strip() if isinstance(name, str) else name)
    except (RuntimeError, TypeError):
        raise InputError(f"{what} {name!r} is not a device name; expected cpu, cuda, cuda:N or mps"
                         f"; available here: {available}") from None
    if device.type not in SUPPORTED_TYPES:
        raise InputError(f"{what} {name!r}: sgraf runs on cpu, cuda or mps, not {device.type}; "
                         f"available here: {available}")
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise InputError(f"{what} {name!r}: there is one CPU device, cpu; available here: {available}")
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = ("this PyTorch build has no CUDA" if torch.version.cuda is None
                     else "no CUDA device is visible")
            raise InputError(f"{what} {name!r}: CUDA is not available ({build}, torch {torch.__version__}); "
                             f"available here: {available}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"{what} {name!r}: no such CUDA device, this machine has "
                             f"{torch.cuda.device_count()}; available here: {available}")
        return device
    if not torch.backends.mps.is_available():
        raise InputError(f"{what} {name!r}: MPS (Apple GPU) is not available here; available here: {available}")
    return device
