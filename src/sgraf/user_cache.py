"""Where sgraf keeps what it can compute again: `$SGRAF_CACHE_DIR`, else
`$XDG_CACHE_HOME/sgraf` (an absolute path; a relative one is ignored, as the XDG specification
says), else `~/.cache/sgraf`, else, where no home folder can be found (no HOME and a user id
without a passwd entry: a container run as an arbitrary user), `sgraf-cache-UID` in the temporary
folder, private to the user (measured choices, `sgraf.kernels.tuning`;
captions' token ids, `sgraf.data.token_cache`). Deleting it loses nothing but time. Each use
has its own switch (`switched_on`)."""

from __future__ import annotations

import functools
import os
import pathlib
import tempfile


def cache_dir() -> pathlib.Path:
    """The cache folder (see the module); not created here, but for the temporary folder's."""
    if os.environ.get("SGRAF_CACHE_DIR"):
        return pathlib.Path(os.environ["SGRAF_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return pathlib.Path(xdg) / "sgraf"
    try:
        return pathlib.Path.home() / ".cache" / "sgraf"
    except RuntimeError:    # "Could not determine home directory"
        return _own_temporary_cache()


@functools.cache      # one folder a process
def _own_temporary_cache() -> pathlib.Path:
    """`sgraf-cache-UID` in the temporary folder, made private (0700) if it is not there; one that
    another user made, or that others may write, is not used (they could plant cached token ids):
    a private folder of this process's own then, the cache lost at its end."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    folder = pathlib.Path(tempfile.gettempdir()) / f"sgraf-cache-{uid if uid is not None else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        state = folder.lstat()
        if uid is None or (state.st_uid == uid and not state.st_mode & 0o077 and folder.is_dir()
                           and not folder.is_symlink()):
            return folder
    except OSError:
        pass
    return pathlib.Path(tempfile.mkdtemp(prefix="sgraf-cache-"))


def say_unwritable(folder: pathlib.Path, error: Exception) -> None:
    """Warn, once a process and folder, that the cache folder cannot be written (a file in its
    place, a read-only home): nothing kept, all computed again each run."""
    import logging

    if str(folder) in _said_unwritable:
        return
    _said_unwritable.add(str(folder))
    blocker = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
    reason = (f"{blocker} is a file, not a folder" if blocker is not None
              else (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__)
    logging.getLogger("sgraf").warning(
        "the cache folder %s cannot be written (%s): measured choices and token ids are not kept, each run computes "
        "them again (SGRAF_CACHE_DIR names another folder; SGRAF_TUNE=off and SGRAF_TOKEN_CACHE=off stop both)",
        folder, reason)


_said_unwritable: set[str] = set()


# sgraf's on/off environment variables, each on when unset (the commands check them all first)
SWITCHES = ("SGRAF_TUNE", "SGRAF_TOKEN_CACHE", "SGRAF_KEEP_FREED_MEMORY", "SGRAF_FAST_EXIT")
_ON, _OFF = ("", "on", "1", "true", "yes"), ("off", "0", "false", "no")


def switched_on(variable: str) -> bool:
    """False when the environment variable is off/0/false/no (any case); True when unset, empty
    or on/1/true/yes.

    Raises:
        InputError: any other value (a typo such as `of` had left the switch on, unsaid).
    """
    value = os.environ.get(variable, "").strip().lower()
    if value in _OFF or value in _ON:
        return value not in _OFF
    from sgraf.errors import InputError

    raise InputError(f"{variable} must be on or off (or 1/0, true/false, yes/no), got {os.environ[variable]!r}")


def check_switches() -> None:
    """Every one of `SWITCHES`, checked (`switched_on`): a command refuses a bad value before it starts."""
    for variable in SWITCHES:
        switched_on(variable)
