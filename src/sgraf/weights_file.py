"""Reading a PyTorch file of tensors and plain values, and refusing anything else by name.

`torch.load(weights_only=True)` never runs code from the file, but when it refuses a file its
own message advises re-running with `weights_only=False`, which would run whatever the pickle
holds. sgraf never suggests that: a refused file is reported as not a safe checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Sequence

from sgraf import torch_compat
from sgraf.errors import InputError

_PICKLE_PROTOCOL = 0x80   # first byte of a pickle of protocol 2 or higher


def load_weights_only(path: str | os.PathLike[str], map_location: Any = "cpu", allowed: Sequence[type] = (),
                      what: str = "checkpoint") -> Any:
    """`torch.load(path, weights_only=True)`, with the classes in `allowed` also accepted.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: as `open` raises them.
        InputError: the file pickles a class or object that is not allowed (named when torch
            names it), is a raw Python pickle, or is not a PyTorch file at all.
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        # a pipe (`--checkpoint <(cat best.pt)`, a FIFO) or a device: a checkpoint is read by seeking
        # in it, and an empty FIFO would wait for a writer without end
        raise InputError(f"{path}: not a regular file (a pipe or a device?); a PyTorch {what} is read by seeking "
                         "in it: save it to a file first")
    try:
        with warnings.catch_warnings():
            # a raw pickle's protocol draws a warning before the refusal, which says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch_compat.load_allowing(path, map_location, allowed)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:  # noqa: BLE001 - any parser failure on a foreign file means "not a checkpoint"
        # a text file starting with 'c' reads as a pickle's GLOBAL opcode too: only a pickle is refused as one
        pickled = is_torch_file(path) or _is_raw_pickle(path)
        refused = isinstance(error, pickle.UnpicklingError) and "GLOBAL" in str(error)
        if pickled and (refused or "weights_only" in str(error)) or _is_raw_pickle(path):
            raise _unsafe(path, str(error), what, allowed) from None
        raise InputError(f"{path}: not a readable PyTorch {what} ({torch_file_problem(path, error)})") from None


def _unsafe(path: Path, message: str, what: str, allowed: Sequence[type]) -> InputError:
    """The refusal: never torch's text, which advises loading the file unsafely."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    accepted = "only tensors, plain values" + "".join(f" and {_class_name(c)}" for c in allowed) + " are allowed"
    if found and not _is_raw_pickle(path):
        return InputError(f"{path}: refusing to load: the {what} pickles the class {found.group(1)}; {accepted}")
    kind = "a raw Python pickle" if _is_raw_pickle(path) else "a pickle of Python objects"
    return InputError(f"{path}: not a safe {what}: it is {kind}, a format that can run code when loaded, not a "
                      f"file of tensors and plain values; {accepted}")


def _class_name(cls: type) -> str:
    if cls.__module__ == "argparse" and cls.__name__ == "Namespace":
        return "argparse.Namespace (the authors' options)"
    return f"{cls.__module__}.{cls.__name__}"


def _is_raw_pickle(path: Path) -> bool:
    """A pickle written by `pickle.dump` rather than `torch.save` (which writes a zip archive)."""
    try:
        with open(path, "rb") as handle:
            first = handle.read(2)
    except OSError:
        return False
    return not zipfile.is_zipfile(path) and (first[:1] == bytes([_PICKLE_PROTOCOL]) or first[:1] in (b"(", b"}", b"]"))


_ZIP_MAGIC = b"PK\x03\x04"   # torch.save's archive format (PyTorch >= 1.6)


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError:
        return b""


def is_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts as `torch.save` writes: a zip archive, or (legacy) a binary pickle."""
    return _head(Path(path), len(_ZIP_MAGIC)).startswith((_ZIP_MAGIC, bytes([_PICKLE_PROTOCOL])))


def torch_file_problem(path: str | os.PathLike[str], error: BaseException) -> str:
    """What is wrong with a file `torch.load(..., weights_only=True)` refused with `error`, in
    our words (torch's own advice is to load the file unsafely, wrong for a file given by mistake)."""
    if not _head(Path(path), 1):
        return "empty file"
    if not is_torch_file(path):
        if _head(Path(path), 6) == b"\x93NUMPY":      # a score matrix given where a checkpoint goes
            return "a NumPy .npy array: a score matrix? give it with --sims"
        return "neither a torch.save archive nor a pickle"
    if _head(Path(path), len(_ZIP_MAGIC)) == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        # a zip archive's directory is its last bytes: a copy or download cut short loses it first
        return (f"a torch.save archive cut short: its {os.path.getsize(path):,} bytes end before the "
                f"archive's directory; expected the whole file, copied or downloaded again")
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(error))
    if detail:
        return detail.group(1).strip()
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else 'no details'}"
