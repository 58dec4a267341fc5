"""Why a file could not be read as a NumPy array or a PyTorch file, in a few words.

NumPy and PyTorch explain a refused file with advice meant for files one trusts ("load it
unsafely with allow_pickle=", "re-running torch.load with weights_only=False will likely
succeed"), which is the wrong advice for a text file or random bytes given by mistake. These
helpers look at the file's first bytes and name what it is not.
"""

from __future__ import annotations

import os
import re

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"   # torch.save's archive format (PyTorch >= 1.6)
PICKLE_PROTOCOL = b"\x80"   # the legacy torch.save format starts with a pickle protocol opcode


def _head(path: str | os.PathLike[str], size: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError:
        return b""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def npy_problem(path: str | os.PathLike[str], error: BaseException) -> str:
    """What is wrong with a file `np.load(..., allow_pickle=False)` refused with `error`."""
    head = _head(path, len(NPY_MAGIC))
    if not head:
        return "empty file"
    if head != NPY_MAGIC:
        return "no .npy header, so not a NumPy array file"
    return _first_line(error)


def is_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts as `torch.save` writes: a zip archive, or (legacy) a binary pickle."""
    return _head(path, len(ZIP_MAGIC)).startswith((ZIP_MAGIC, PICKLE_PROTOCOL))


def torch_file_problem(path: str | os.PathLike[str], error: BaseException) -> str:
    """What is wrong with a file `torch.load(..., weights_only=True)` refused with `error`."""
    if not _head(path, 1):
        return "empty file"
    if not is_torch_file(path):
        return "neither a torch.save archive nor a pickle"
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(error))
    return detail.group(1).strip() if detail else f"{type(error).__name__}: {_first_line(error)}"
