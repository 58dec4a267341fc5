"""Where sgraf keeps what it can compute again: `$SGRAF_CACHE_DIR`, else
`$XDG_CACHE_HOME/sgraf` (an absolute path; a relative one is ignored, as the XDG specification
says), else `~/.cache/sgraf`, else, where no home folder can be found (no HOME and a user id
without a passwd entry: a container run as an arbitrary user), `sgraf-cache-UID` in the temporary
folder (measured choices, `sgraf.kernels.tuning`;
captions' token ids, `sgraf.data.token_cache`). Deleting it loses nothing but time. Each use
has its own switch (`switched_on`)."""

from __future__ import annotations

import os
import pathlib
import tempfile


def cache_dir() -> pathlib.Path:
    """The cache folder (see the module); not created here."""
    if os.environ.get("SGRAF_CACHE_DIR"):
        return pathlib.Path(os.environ["SGRAF_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return pathlib.Path(xdg) / "sgraf"
    try:
        return pathlib.Path.home() / ".cache" / "sgraf"
    except RuntimeError:    # "Could not determine home directory"
        return pathlib.Path(tempfile.gettempdir()) / f"sgraf-cache-{os.getuid()}"


def switched_on(variable: str) -> bool:
    """False when the environment variable is off/0/false/no (any case); on when unset."""
    return os.environ.get(variable, "on").strip().lower() not in ("off", "0", "false", "no")
