"""One sgraf process at a time in an output folder: a lock file that the kernel releases.

A command that writes a folder over a long time (`sgraf train` into its run folder, `sgraf demo`,
`sgraf generate`, the converters) holds `FOLDER/.sgraf-lock` for as long as it writes. The
lock is an advisory `flock` on that file (POSIX); the file also holds a one-line record of the
holder (pid, host, start time, command) so that a refused process can name it.

Because the kernel drops a `flock` when its process ends, however it ends, a lock left by a
killed run never blocks the next run (`sgraf train --resume` after `kill -9`): what stays
behind is only the record, which is ignored when the lock is free. On NFS, Linux turns `flock`
into a POSIX record lock held by the server, which releases it when the client that held it is
gone; where the file system refuses locks altogether (ENOLCK, EOPNOTSUPP), the record decides:
a record of a process of this host that no longer runs is stale and taken over, any other
record refuses (its message says which file to delete if that run is known to be gone).

On Windows (no `fcntl`) the lock is `msvcrt.locking` on a byte past the record, which Windows
also releases when the process ends.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import pathlib
import shlex
import socket
import sys
import weakref
from typing import Any

from sgraf.errors import InputError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

LOCK_FILE = ".sgraf-lock"
_HELD: "weakref.WeakSet[FolderLock]" = weakref.WeakSet()     # this process's locks (`_forget_in_child`)
_WINDOWS_LOCK_OFFSET = 1 << 20  # locked byte, beyond the record so the record stays readable


class FolderLockedError(InputError):
    """Another process holds the folder's lock; the message names it."""


def holder_record(purpose: str | None = None) -> dict[str, Any]:
    """Who this process is: pid, host, start time (UTC) and command line, and what it holds the
    folder for where given (`FolderLock(purpose=)`)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
              "command": _command_line()}
    return {**record, "purpose": purpose} if purpose else record


def _command_line() -> str:
    argv = list(sys.argv) or ["python"]
    name = os.path.basename(argv[0])
    if name in ("sgraf", "__main__.py", "sgraf.exe"):
        program = ["sgraf"]
    elif argv[0] == "-c":
        program = ["python", "-c"]
    else:
        program = [name]
    return shlex.join(program + argv[1:])


def describe_holder(record: dict[str, Any] | None) -> str:
    """'pid P on host H, started T, command: C' from a lock record."""
    if not record:
        return "it has not written its name yet"
    return (f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}, "
            f"command: {record.get('command')}")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (perhaps owned by another user). On Windows,
    where `os.kill(pid, 0)` ends the process instead of asking about it, the process is looked up
    (`OpenProcess`); where that cannot tell, it counts as alive."""
    if os.name == "nt":
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


def _windows_pid_alive(pid: int) -> bool:
    try:
        import ctypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)   # type: ignore[attr-defined]
        handle = kernel32.OpenProcess(0x1000, False, int(pid))      # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5                     # access denied: it exists
        try:
            code = ctypes.c_ulong()
            if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
                return True
            return code.value == 259                                 # STILL_ACTIVE
        finally:
            kernel32.CloseHandle(handle)
    except (OSError, AttributeError, ValueError):
        return True


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, ...) drops its copies of the parent's locks, untouched:
    a flock belongs to the open file, so a worker outliving its killed parent for seconds had kept
    the folder locked, and an immediate --resume was refused, naming the dead parent."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


class FolderLock:
    """An exclusive lock on `folder` for one process; a context manager.

    Args:
        folder: an existing folder (named in messages).
        purpose: what the holder does, recorded in the lock for readers.
        path: the lock file, when not `folder`'s own `LOCK_FILE` (its parent must exist).

    Raises (on enter / `acquire`):
        FolderLockedError: another live process holds the folder.
        InputError: the lock file cannot be created (the folder is not writable).
    """

    def __init__(self, folder: str | os.PathLike[str], purpose: str | None = None,
                 path: str | os.PathLike[str] | None = None) -> None:
        self.folder = pathlib.Path(folder)
        self.purpose = purpose      # recorded for readers of the lock (`sgraf runs`: "training run")
        # the lock file: in the folder, or `path` beside it for a folder that is replaced whole (an index)
        self.path = pathlib.Path(path) if path is not None else self.folder / LOCK_FILE
        self._fd: int | None = None
        self._advice = ""

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
            except OSError as error:
                raise InputError(f"cannot lock {self.folder}: {error.strerror or error} "
                                 f"(creating {self.path.name})") from None
            try:
                locked = self._lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if not locked:
                record = self._read(fd)
                os.close(fd)
                raise FolderLockedError(f"{self.folder} is in use by another sgraf process "
                                        f"({describe_holder(record)}); wait for it to end or stop it{self._advice}")
            if self._same_file(fd):   # not unlinked by a holder releasing it meanwhile
                break
            os.close(fd)
        self._fd = fd
        _HELD.add(self)
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(holder_record(self.purpose)).encode() + b"\n")
        except OSError as error:   # a full disk: the lock file stays empty, so release it
            self.release()
            raise InputError(f"cannot lock {self.folder}: {error.strerror or error} (writing {self.path.name})") from None

    def release(self) -> None:
        if self._fd is None:
            return
        _HELD.discard(self)
        fd, self._fd = self._fd, None
        if fcntl is None:                       # Windows deletes no open file: closed (unlocked) first
            os.close(fd)
        try:
            self.path.unlink(missing_ok=True)   # while locked: a waiter re-checks the file it locked
        except OSError:
            pass
        if fcntl is not None:
            os.close(fd)                        # drops the lock

    def _lock(self, fd: int) -> bool:
        """True when this process now holds the lock, False when another one does."""
        if fcntl is None:
            os.lseek(fd, _WINDOWS_LOCK_OFFSET, 0)
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            except OSError:
                return False
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise InputError(f"cannot lock {self.folder}: {error.strerror or error}") from None
        return self._record_says_free(fd)   # no locks on this file system

    def _record_says_free(self, fd: int) -> bool:
        record = self._read(fd)
        if not record:
            return True
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            return not pid_alive(record["pid"])
        self._advice = f" (this file system has no locks: delete {self.path} if that run is gone)"
        return False

    def _same_file(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _read(fd: int) -> dict[str, Any] | None:
        try:
            os.lseek(fd, 0, 0)
            text = os.read(fd, 4096).decode("utf-8", "replace").strip()
            record = json.loads(text) if text else None
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None


if hasattr(os, "register_at_fork"):     # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)
