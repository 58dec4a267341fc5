"""What sgraf asks of PyTorch where its API changed after 2.3, the oldest release sgraf supports.

PyTorch 2.4 gave the autocast queries a device type (`torch.is_autocast_enabled("cpu")`,
`torch.get_autocast_dtype("cpu")`) and let `torch.load(weights_only=True)` accept allow-listed
classes (`add_safe_globals`; 2.5: the `safe_globals` context); Adam's fused kernel runs on the
CPU from 2.4 on; `torch.nn.utils.get_total_norm` came in 2.6 and Dynamo's `recompile_limit` was
`cache_size_limit` before. The functions here take the new API where it exists and the old one
before. sgraf's Triton kernels need Triton 3.4 or later (PyTorch 2.3 ships 2.3): with an older
one they are not offered (`triton_usable`) and the eager routes run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch

VERSION = torch.torch_version.TorchVersion(torch.__version__)
# plain booleans, read inside compiled graphs (Dynamo does not trace a TorchVersion comparison)
_DEVICE_AUTOCAST_API = VERSION >= (2, 4)
_FUSED_ADAM_ON_CPU = VERSION >= (2, 4)
# sgraf's compiled paths (`sgraf.kernels.compiled`): PyTorch 2.3's Dynamo cannot trace them
# (an autograd Function's `needs_input_grad`, the old autocast queries); 2.4 was not tried
COMPILE_MIN = (2, 5)
# autocast on Apple's MPS: float16 from PyTorch 2.5, bfloat16 from 2.6 (before, no autocast there)
MPS_AUTOCAST_MIN = {torch.float16: (2, 5), torch.bfloat16: (2, 6)}


def mps_autocast_missing(dtype: torch.dtype) -> tuple[int, int] | None:
    """The PyTorch version MPS autocast to `dtype` needs, where this one is older; else None."""
    needed = MPS_AUTOCAST_MIN.get(dtype)
    return needed if needed is not None and VERSION < needed else None


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for `device_type` ('cpu', 'cuda', ...) in this thread."""
    if _DEVICE_AUTOCAST_API:
        return torch.is_autocast_enabled(device_type)
    if device_type == "cpu":
        return torch.is_autocast_cpu_enabled()
    return device_type == "cuda" and torch.is_autocast_enabled()


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype autocast computes in on `device_type` (meaningful while it is on)."""
    if _DEVICE_AUTOCAST_API:
        return torch.get_autocast_dtype(device_type)
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype()
    return torch.get_autocast_gpu_dtype()


def compile_supported() -> bool:
    """Whether sgraf's compiled paths run under this PyTorch (`COMPILE_MIN` or later)."""
    return VERSION >= COMPILE_MIN


def fused_adam_runs(device: torch.device) -> bool:
    """Whether Adam's fused kernel runs on `device`'s tensors (CUDA always; the CPU from 2.4)."""
    return device.type == "cuda" or (device.type == "cpu" and _FUSED_ADAM_ON_CPU)


def can_allow_classes() -> bool:
    """Whether `torch.load(weights_only=True)` can be told to accept more classes (2.4 and later)."""
    return hasattr(torch.serialization, "add_safe_globals")


@contextlib.contextmanager
def safe_globals(allowed: Sequence[type]) -> Iterator[None]:
    """`torch.serialization.safe_globals(allowed)` (2.5), or under 2.4 `add_safe_globals`, which
    allows them for the rest of the process; under 2.3 nothing more can be allowed (a file that
    needs a class then fails to load, and the caller says which PyTorch reads it)."""
    if not allowed:
        yield
    elif hasattr(torch.serialization, "safe_globals"):
        with torch.serialization.safe_globals(list(allowed)):
            yield
    else:
        if can_allow_classes():
            torch.serialization.add_safe_globals(list(allowed))
        yield


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The l2 norm of all `tensors` together (`torch.nn.utils.get_total_norm`, or its arithmetic:
    the norm of the per-tensor norms)."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(tensors)
    if not tensors:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def raise_recompile_limit(at_least: int) -> None:
    """Let Dynamo keep at least `at_least` graphs per compiled function."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), at_least))


TRITON_MIN = (3, 4)


@functools.cache
def triton_usable() -> bool:
    """Whether Triton is installed at `TRITON_MIN` or later (read from its metadata, not imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return False
    return torch.torch_version.TorchVersion(version) >= TRITON_MIN


def load_allowing(path: Any, map_location: Any, allowed: Sequence[type]) -> Any:
    """`torch.load(path, weights_only=True)` that also accepts the classes in `allowed`. From
    PyTorch 2.4 through its allow-list (`safe_globals`). Before, `weights_only` accepts no class,
    so the file is read by an unpickler that resolves exactly the globals `weights_only` allows
    (PyTorch's own list of tensor-rebuilding functions and storage types) and `allowed`, and
    refuses every other one before anything is called; the classic way to restrict a pickle."""
    if can_allow_classes() or not allowed:
        with safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    from torch import _weights_only_unpickler

    names = dict(_weights_only_unpickler._get_allowed_globals())
    names.update({f"{c.__module__}.{c.__qualname__}": c for c in allowed})

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = names.get(f"{module}.{name}")
            if found is None:
                raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} is not allowed")
            return found

    class RestrictedPickle:
        Unpickler = Restricted
        load = staticmethod(lambda file, **kwargs: Restricted(file, **kwargs).load())
        __name__ = "sgraf_restricted_pickle"

    return torch.load(path, map_location=map_location, weights_only=False, pickle_module=RestrictedPickle)
