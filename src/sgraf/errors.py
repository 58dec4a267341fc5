"""Exceptions raised for bad input.

`InputError` subclasses `ValueError`, so callers that catch `ValueError` see it too; the
command line turns it into a one-line message and exit code 2.
"""

import numbers


class InputError(ValueError):
    """Bad user input: a file, field or tensor that is not what was expected.

    The message names the file (and line or field) or the argument, and what was expected.
    """


class NonFiniteFeatures(InputError):
    """Region features holding NaN/inf (`sgraf.data.arrays.check_finite_features`): bad input
    that can be met only as the features are read, a training run's mid-way."""


def check_positive_int(value: object, name: str) -> int:
    """`value` as an int if it is an integer >= 1 (a size or a count), else `InputError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def plain_integer(text: str) -> bool:
    """Whether `text` is an integer in plain ASCII digits, with a sign or none: `int()` also reads
    '1_0' as 10 and other scripts' digits, which a command line or a config should not."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    return digits.isascii() and digits.isdigit()


def decode_utf8(data: bytes, path: object, expected: str, column: bool = False) -> str:
    """`data` (the bytes of the file `path`) as text, else `InputError` naming the line, the
    first bad byte (and its column if `column`) and `expected`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        where = f"byte 0x{data[error.start]:02x}"
        if column:
            line_start = data.rfind(b"\n", 0, error.start) + 1
            where += f" at column {error.start - line_start + 1}"
        raise InputError(f"{path}:{line}: bytes are not valid UTF-8 ({where}); expected {expected}") from None
