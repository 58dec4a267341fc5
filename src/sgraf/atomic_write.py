"""Writing a file atomically, with errors that name the file the user asked for.

Every file sgraf writes goes to a temporary file beside its destination and is moved into
place with `os.replace` once complete, so a reader never sees half a file and a crash leaves
the previous version. The temporary name (`.NAME.x8f2k.tmp`) is an internal detail: when the
write fails (permission denied, disk full, a missing or non-folder parent, the destination is
a folder) the error is an `InputError` naming the destination.

A destination that is a symlink is written through: its target is replaced (atomically, as
above) and the link stays a link. A full disk ("No space left on device") is found before any
byte of a memory-mapped file is written: `preallocated_memmap` reserves the file's blocks
first, where writing through the map would kill the process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import secrets
import stat
from typing import TYPE_CHECKING, Iterator

from sgraf.errors import InputError

if TYPE_CHECKING:
    import numpy as np

_ATTEMPTS = 100


def write_error(path: str | os.PathLike[str], error: OSError) -> InputError:
    """A one-line `InputError` for a failed write of `path` (never the temporary file)."""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else None) or str(error) or type(error).__name__
    if error.errno in (errno.EEXIST, errno.ENOTDIR):   # "File exists" said nothing of which file
        reason = _parent_that_is_a_file(path) or reason
    if error.errno is None and " requested and " in str(error):   # numpy's short write (`tofile`): a full disk
        reason = f"{os.strerror(errno.ENOSPC)} ({error})"
    return InputError(f"cannot write {path}: {reason}")


def _parent_that_is_a_file(path: str | os.PathLike[str]) -> str | None:
    """'P is a file, where a folder is needed' for the nearest of `path`'s parents that exists and
    is no folder, if any."""
    for parent in pathlib.Path(path).parents:
        if os.path.lexists(parent):
            return None if parent.is_dir() else f"{parent} is a file, where a folder is needed"
    return None


def ensure_folder(folder: str | os.PathLike[str], what: str = "output folder") -> pathlib.Path:
    """Creates `folder` (and its parents); `InputError` naming it when it is a file or cannot be made."""
    folder = pathlib.Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{what} {folder} is a file, expected a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"cannot create {what} {folder}: {_parent_that_is_a_file(folder) or error.strerror or error}") \
            from None
    return folder


def missing_folders(folder: str | os.PathLike[str]) -> list[pathlib.Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: what creating it
    makes, and `remove_empty_folders` takes back when the command fails before writing there."""
    folder = pathlib.Path(os.path.abspath(folder))
    return [path for path in (folder, *folder.parents) if not os.path.lexists(path)]


def remove_empty_folders(folders: list[pathlib.Path]) -> None:
    """Removes `folders` (deepest first, as `missing_folders` lists them) while they are empty,
    so that a refused or failed command leaves no folder it made behind; stops at the first that
    holds anything."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:     # not empty (or gone): it and its parents stay
            return


@contextlib.contextmanager
def taken_back_on_failure(folders: list[pathlib.Path]) -> Iterator[None]:
    """`remove_empty_folders(folders)` when the block raises (`missing_folders` before making
    them): a command refused or failed after making its output folder leaves none behind (one
    whose lock could not be written, on a full disk, had)."""
    try:
        yield
    except BaseException:
        remove_empty_folders(folders)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[pathlib.Path]:
    """A temporary path beside `path`, moved onto `path` when the block ends without error.

    The block writes the temporary path by name (a memory map, `savefig`, `Image.save`; give
    those the format explicitly, the temporary name ends in `.tmp`). An `OSError` raised in the
    block or by the move becomes an `InputError` naming `path`; the temporary file is removed.
    A file replaced keeps its permissions; a read-only one (no write permission for anyone) is
    refused before the block runs, as writing it in place would be (a rename had replaced it
    silently, with the umask's permissions).
    """
    given = path = pathlib.Path(path)
    if path.is_symlink():                   # written through: the link keeps pointing at the new file
        path = pathlib.Path(os.path.realpath(path))
    if path.is_dir():
        raise write_error(given, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise InputError(f"cannot write {given}: {blocker} is a file, not a folder")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = None                          # a new file: the umask's permissions
    if mode is not None and not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise InputError(f"cannot write {given}: the file is read-only (make it writable, chmod u+w, or "
                         "choose another path)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = _new_temporary_file(path)
    except OSError as error:
        raise write_error(given, error) from None
    try:
        yield temporary
        _fsync(temporary)
        if mode is not None:
            os.chmod(temporary, mode)        # the replaced file's permissions, not the umask's
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise write_error(given, error) from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def preallocated_memmap(path: str | os.PathLike[str], dtype: object, shape: tuple[int, ...]) -> np.memmap:
    """A new `.npy` file at `path` opened as a writable memory map, its blocks reserved first.

    `numpy.lib.format.open_memmap(mode="w+")` makes a sparse file: on a full disk the first
    write through the map that needs a new block kills the process with SIGBUS, before any
    cleanup can run. Here the whole file is allocated (`posix_fallocate`) before it is mapped,
    so a full disk is an `OSError` (ENOSPC) raised here, that the caller's `atomic_path` or
    `NewGeneration` turns into one line naming the user's path.
    """
    import numpy as np

    header = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    offset, size = header.offset, header.nbytes
    del header   # sparse so far: nothing was written through it
    handle = os.open(path, os.O_RDWR)
    try:
        _allocate(handle, offset, offset + size)
    finally:
        os.close(handle)
    return np.lib.format.open_memmap(path, mode="r+")


def _allocate(handle: int, start: int, size: int) -> None:
    """Reserves the first `size` bytes of the open file `handle` on the disk (ENOSPC when they are
    not free); the bytes from `start` on are zeros."""
    if size == 0:
        return
    try:
        os.posix_fallocate(handle, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        # a file system without fallocate: write the zeros (slower, as safe)
        block = b"\0" * (1 << 20)
        os.lseek(handle, start, os.SEEK_SET)
        for offset in range(start, size, len(block)):
            os.write(handle, block[: min(len(block), size - offset)])
    except AttributeError:   # no posix_fallocate on this platform (macOS)
        os.ftruncate(handle, size)


def temporary_folder(parent: str | os.PathLike[str], prefix: str) -> pathlib.Path:
    """A new, empty folder in `parent` that will be moved into place whole (an index).

    Unlike `tempfile.mkdtemp` (mode 0700), its permissions follow the umask, as the folder's
    would if it were written in place.
    """
    for _ in range(_ATTEMPTS):
        candidate = pathlib.Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))


def _new_temporary_file(path: pathlib.Path) -> pathlib.Path:
    """An empty `.NAME.RANDOM.tmp` beside `path`, with the permissions the umask gives a new file
    (`tempfile.mkstemp` makes them 0600, which the replaced file would keep)."""
    for _ in range(_ATTEMPTS):
        candidate = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as temporary, open(temporary, "wb") as handle:
        handle.write(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Writes `text` as UTF-8 to `path` atomically (see `atomic_path`)."""
    write_bytes(path, text.encode("utf-8"))


def _fsync(path: pathlib.Path) -> None:
    """Flush a finished temporary file to the disk before it replaces the previous version."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF):  # file systems without fsync of read handles
            raise
    finally:
        os.close(handle)
