"""The one reader of text files: captions, vocabularies, YAML configs, scenes, TSV, caption tables.

A file saved by some editors (Notepad, Excel's "UTF-8" export) starts with the UTF-8 byte-order
mark EF BB BF. Read as text it would become part of the first word (`'\ufeffa'`), which no
vocabulary holds, so every reader of sgraf removes one leading mark, and only there: a mark
elsewhere is text like any other character. Everything else (UTF-8 checking, line numbers)
stays with the reader of each format. This module imports nothing above `sgraf.errors`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from sgraf.errors import decode_utf8

BOM = b"\xef\xbb\xbf"


def strip_bom(data: bytes) -> bytes:
    """`data` without a leading UTF-8 byte-order mark."""
    return data[len(BOM):] if data.startswith(BOM) else data


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the text file `path`, a leading byte-order mark removed."""
    return strip_bom(Path(path).read_bytes())


def read_text(path: str | os.PathLike[str], expected: str, column: bool = False) -> str:
    """The text file `path` decoded as UTF-8 (a leading byte-order mark removed); bytes that are
    not UTF-8 are an `InputError` naming the line (and column) and `expected`."""
    return decode_utf8(read_bytes(path), path, expected, column=column)


def lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw bytes with their newline) of a text file read as a stream, a
    leading byte-order mark removed from the first line."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, strip_bom(line) if number == 1 else line
