"""Inputs and outputs of a command: no output may be one of its inputs.

Every command calls `check_outputs` with the paths it reads and the paths it writes, before it
writes anything. Paths are compared as files, not as strings: `./x`, `x`, `dir/../x`, a symlink
to `x` and a hard link to `x` are all the same file. The refusal is one line naming both
arguments and both paths:

    --save-sims D/test_ims.npy is the input --data D/test_ims.npy; an output must not be an input
    (it would be written over): choose another path

Three kinds of path take part:

- inputs: files or folders the command reads (`--checkpoint`, `--data`, `--tsv`, ...);
- outputs: files the command writes (`--save-sims`, `vocab build --out`, `explain --out`, the
  files a data writer puts into its folder);
- folders: folders the command replaces whole (`index --out`): an input equal to such a
  folder or inside it is refused too.

A symlinked output is written through to its target (an atomic replace of the target, the
link stays); the comparison therefore uses the target. This module imports nothing above
`sgraf.errors`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple, Union

from sgraf.errors import InputError

PathArg = Union[str, "os.PathLike[str]", None]
Labelled = Tuple[str, PathArg]


def resolved(path: str | os.PathLike[str]) -> Path:
    """`path` made absolute with every symlink followed (also of a file that does not exist yet)."""
    return Path(os.path.realpath(os.fspath(path)))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _given(paths: Iterable[Labelled]) -> list[tuple[str, str]]:
    return [(label, os.fspath(path)) for label, path in paths if path is not None and os.fspath(path) != ""]


def check_outputs(inputs: Iterable[Labelled], outputs: Iterable[Labelled] = (),
                  folders: Iterable[Labelled] = ()) -> None:
    """Refuses, in one line naming both, an output that is one of the inputs.

    Args:
        inputs: (label, path) of every file or folder the command reads; a None path is skipped.
        outputs: (label, path) of every file the command writes; two outputs may not be the
            same file either.
        folders: (label, path) of every folder the command writes as a whole; an input that is
            the folder or lies inside it is refused.

    Raises:
        InputError: "OUT_LABEL OUT is the input IN_LABEL IN; ..." or "... holds the input ...".
    """
    sources = [(label, path, _identity(path)) for label, path in _given(inputs)]
    source_of: dict[object, tuple[str, str]] = {}   # each input's keys, the first input first: one lookup an output
    for in_label, source, source_identity in reversed(sources):
        source_of.update({key: (in_label, source) for key in source_identity})
    written: dict[object, tuple[str, str]] = {}
    for out_label, out in _given(outputs):
        identity = _identity(out)
        clash = [source_of[key] for key in identity if key in source_of]
        if clash:
            in_label, source = min(clash, key=lambda found: [s[:2] for s in sources].index(found))
            raise InputError(_message(out_label, out, "is", in_label, source))
        for key in identity:
            if key in written and written[key] != (out_label, out):
                other_label, other = written[key]
                raise InputError(f"{out_label} {out} and {other_label} {other} are the same file; "
                                 "each output needs its own path")
            written[key] = (out_label, out)
    for out_label, folder in _given(folders):
        top = resolved(folder)
        for in_label, source, source_identity in sources:
            inside = _inside(resolved(source), top)
            if inside or _identity(folder) & source_identity:
                relation = "holds" if inside and resolved(source) != top else "is"
                raise InputError(_message(out_label, folder, relation, in_label, source))


def _identity(path: str) -> set[object]:
    """What names a file: its resolved path and, when it exists, its (device, inode)."""
    keys: set[object] = {resolved(path)}
    try:
        status = os.stat(path)
        keys.add((status.st_dev, status.st_ino))
    except OSError:
        pass
    return keys


def _message(out_label: str, out: str, relation: str, in_label: str, source: str) -> str:
    return (f"{out_label} {out} {relation} the input {in_label} {source}; an output must not be an input "
            "(it would be written over): choose another path")


def check_distinct(label: str, paths: Optional[Sequence[PathArg]], what: str) -> None:
    """Refuses, in one line, a file named twice in a repeatable option (`--checkpoint a.pt
    --checkpoint ./a.pt`: one model averaged with itself, most likely a slip for another file).

    Args:
        label: the option, as the user typed it; paths: its values (None: none given).
        what: what the values make together, for the message ("an ensemble averages ...").

    Raises:
        InputError: "LABEL P is given twice (1st and 3rd, the same file); WHAT: name each once".
    """
    first: dict[object, int] = {}   # each name of a file (as `check_outputs` keys its outputs): its position
    for number, (_, path) in enumerate(_given(labelled(label, paths)), start=1):
        identity = _identity(path)
        earlier = [first[key] for key in identity if key in first]
        if earlier:
            raise InputError(f"{label} {path} is given twice ({_ordinal(earlier[0])} and {_ordinal(number)}, "
                             f"the same file); {what}: name each once")
        first.update(dict.fromkeys(identity, number))


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def labelled(label: str, paths: Optional[Sequence[PathArg]]) -> list[Labelled]:
    """`[(label, p) for p in paths]` for an option that may repeat (None: none given)."""
    return [(label, path) for path in (paths or [])]


def require_suffix(label: str, path: PathArg, suffix: str, what: str) -> None:
    """An output whose format is taken from its name must end in `suffix` (`--save-sims x.npy`)."""
    if path is not None and not os.fspath(path).lower().endswith(suffix):
        raise InputError(f"{label} must name a {suffix} file ({what}), got {os.fspath(path)!r}")


def path_list(label: str, paths: Union[PathArg, Iterable[PathArg]]) -> list[PathArg]:
    """`paths` as a list: one path (a str or a path object) is a list of one, not its characters;
    an empty list, or an item that is not a path, is an InputError naming `label`."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    try:
        items = list(items)
    except TypeError:
        raise InputError(f"{label}: expected a path or a list of paths, got {type(paths).__name__}") from None
    if not items:
        raise InputError(f"{label}: expected a path or a list of paths, got an empty list")
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise InputError(f"{label}: expected paths, got {type(item).__name__} {item!r}")
    return items
