"""Where sgraf keeps what it can compute again: `$SGRAF_CACHE_DIR`, else
`$XDG_CACHE_HOME/sgraf`, else `~/.cache/sgraf` (measured choices, `sgraf.kernels.tuning`;
captions' token ids, `sgraf.data.token_cache`). Deleting it loses nothing but time. Each use
has its own switch (`switched_on`)."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """The cache folder (see the module); not created here."""
    if os.environ.get("SGRAF_CACHE_DIR"):
        return pathlib.Path(os.environ["SGRAF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "sgraf"


def switched_on(variable: str) -> bool:
    """False when the environment variable is off/0/false/no (any case); on when unset."""
    return os.environ.get(variable, "on").strip().lower() not in ("off", "0", "false", "no")
