"""Exceptions raised for bad input.

`InputError` subclasses `ValueError`, so callers that catch `ValueError` see it too; the
command line turns it into a one-line message and exit code 2.
"""


class InputError(ValueError):
    """Bad user input: a file, field or tensor that is not what was expected.

    The message names the file (and line or field) or the argument, and what was expected.
    """
