"""Progress bars: one way to make them (`bar`), and one switch that silences them all
(`silence`, which `sgraf --quiet` turns, and the command line where stderr is no terminal: a log
file would fill with the bars' carriage-return lines). A closed stderr draws none."""
from __future__ import annotations

import sys
from typing import Any

_silenced = False


def silence(silenced: bool = True) -> None:
    """Show no progress bar from now on (`silence(False)`: show them again where asked)."""
    global _silenced
    _silenced = silenced


def bar(total: int, desc: str, unit: str, enabled: bool = True, leave: bool = False, **options: Any) -> Any:
    """A tqdm bar on stderr of `total` `unit`s, shown only if `enabled` and not silenced; a
    disabled bar takes the same calls (update, close, context manager) and draws nothing."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=_silenced or not enabled or sys.stderr is None, leave=leave, **options)


def terminal(stream: Any) -> bool:
    """Whether `stream` (sys.stderr) is an open terminal."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):     # no isatty, or closed
        return False
