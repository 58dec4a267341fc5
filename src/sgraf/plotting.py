"""matplotlib for sgraf's pictures (`pyplot`): figures drawn apart from pyplot's state.

A library that calls `matplotlib.use` or draws through pyplot changes the backend of the
notebook or program that calls it (every later `plt.show()` of a notebook showed nothing after
sgraf drew a picture); sgraf draws on `matplotlib.figure.Figure` objects, which no pyplot state
holds, and saves them with the Agg renderer whatever the backend is.
"""
from __future__ import annotations

import warnings
from typing import Any

_SUBPLOTS_OPTIONS = ("sharex", "sharey", "squeeze", "width_ratios", "height_ratios", "subplot_kw", "gridspec_kw")


class _Figures:
    """pyplot's `figure`, `subplots` and `close`, on figures of their own."""

    def __init__(self, figure_class: type) -> None:
        self._figure = figure_class

    def figure(self, **options: Any) -> Any:
        return self._figure(**options)

    def subplots(self, nrows: int = 1, ncols: int = 1, **options: Any) -> tuple[Any, Any]:
        layout = {key: options.pop(key) for key in _SUBPLOTS_OPTIONS if key in options}
        figure = self._figure(**options)
        return figure, figure.subplots(nrows, ncols, **layout)

    def close(self, figure: Any = None) -> None:
        """Nothing to release: no pyplot state holds the figure (it goes with its last reference)."""


def pyplot() -> Any:
    """An object with pyplot's `figure`, `subplots` and `close` that leaves the caller's
    matplotlib backend alone (see the module). Deprecation warnings raised inside the import (an
    older matplotlib calling names a newer pyparsing deprecates) are not sgraf's to act on, and
    under `PYTHONWARNINGS=error` they had stopped the commands that draw: they are ignored for the
    import only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from matplotlib.figure import Figure

    # a character the font lacks is drawn as a box; matplotlib warns once per character, so a
    # server drawing clients' texts logged two lines for every new one (CJK: megabytes)
    warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)
    return _Figures(Figure)
