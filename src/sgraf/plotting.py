"""matplotlib for sgraf's pictures (`pyplot`): the file-only Agg backend, imported once."""
from __future__ import annotations

import warnings
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display is needed or opened). Deprecation
    warnings raised inside the import (an older matplotlib calling names a newer pyparsing
    deprecates) are not sgraf's to act on, and under `PYTHONWARNINGS=error` they had stopped the
    commands that draw: they are ignored for the import only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

    return plt
