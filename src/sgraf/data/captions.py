"""A precomp caption file, read as the authors read it; without PyTorch or NumPy, so that a
process that only tokenises captions (`sgraf.data.token_cache`'s prefetch) starts fast."""

from __future__ import annotations

import os
from pathlib import Path

from sgraf import text_files
from sgraf.errors import InputError, decode_utf8


def read_captions(path: str | os.PathLike[str]) -> list[str]:
    """Read a caption file as the authors do (bytes split on '\\n', ASCII-stripped), strictly.

    Raises:
        InputError: bytes that are not UTF-8, an empty caption line between captions, a line of
            whitespace only (U+00A0, U+3000: no word) or a carriage return inside a line (the line
            ends of old Macs, which would make the file one caption), with the line number;
            blank lines after the last caption are no captions.
    """
    path = Path(path)
    data = text_files.read_bytes(path)
    decode_utf8(data, path, "UTF-8 text, one caption per line", column=True)
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()  # the newline that ends the last line, and blank lines after the last caption
    captions = []
    for number, raw in enumerate(lines, start=1):
        caption = raw.strip()  # bytes.strip: ASCII whitespace, as the authors' line.strip()
        if not caption:
            raise InputError(f"{path}:{number}: empty caption line; expected one caption per line")
        if b"\r" in caption:
            raise InputError(f"{path}:{number}: a carriage return (CR) inside the line (the line ends of old Macs?); "
                             "expected one caption per line, each ended by LF or CR LF")
        text = caption.decode("utf-8")
        if not text.split():
            points = ", ".join(sorted({f"U+{ord(c):04X}" for c in text}))
            raise InputError(f"{path}:{number}: a caption of whitespace only ({points}); expected words")
        captions.append(text)
    return captions
