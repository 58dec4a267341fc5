"""The `sgraf` command line: a thin layer over the library.

Each sub-command lives in its own module `sgraf.cli.<name>` exposing `register(subparsers)`,
which adds its parser and sets `func` to a callable `(args) -> int`. Modules import heavy
dependencies inside their functions, so `sgraf --help` stays fast.

Bad input (`ValueError`, which `sgraf.errors.InputError` subclasses, and missing or unreadable
files) is reported in one line on stderr with exit code 2. SIGTERM and SIGINT stop a command
with a one-line message and exit code 143 or 130, after its temporary files are removed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

# Order is the order of `sgraf --help`.
COMMAND_MODULES = (
    "demo",
    "train",
    "evaluate",
    "index",
    "search",
    "explain",
    "serve",
    "generate",
    "data",
    "vocab",
    "extract",
    "convert_tsv",
    "convert_checkpoint",
)

logger = logging.getLogger("sgraf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sgraf",
        description="Image-text matching with SGRAF (Similarity Graph Reasoning and Attention Filtration).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"sgraf.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"sgraf.cli.{name}":
                continue  # command not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from sgraf.signals import Stopped, stop_on_sigterm

    try:
        with stop_on_sigterm():
            return int(args.func(args) or 0)
    except Stopped as stop:
        print(f"sgraf {args.command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        message = str(exc) if not isinstance(exc, OSError) or not exc.filename else (
            f"{exc.filename}: {exc.strerror}")
        print(f"sgraf {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sgraf {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
