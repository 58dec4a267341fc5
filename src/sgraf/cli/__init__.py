"""The `sgraf` command line: a thin layer over the library.

Each sub-command lives in its own module `sgraf.cli.<name>` exposing `register(subparsers)`,
which adds its parser and sets `func` to a callable `(args) -> int`. Modules import heavy
dependencies inside their functions, so `sgraf --help` stays fast.

Bad input (`ValueError`, which `sgraf.errors.InputError` subclasses, and missing or unreadable
files) is reported in one line on stderr with exit code 2; so are arguments out of range, which
the shared argparse types of `sgraf.cli.arguments` refuse before anything is loaded. `--help`
shows every option's default. SIGTERM and SIGINT stop a command with a one-line message and
exit code 143 or 130, after its temporary files are removed.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import importlib
import logging
import os
import sys
from typing import Any, NoReturn, Sequence

# Order is the order of `sgraf --help`.
COMMAND_MODULES = (
    "demo",
    "train",
    "runs",
    "evaluate",
    "compare",
    "diagnose",
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


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default after its help text (flags and options without one aside)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if "%(default)" in help_text or default is None or default is argparse.SUPPRESS or action.nargs == 0:
            return help_text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{help_text} (default: {shown.replace('%', '%%')})".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `HelpFormatter`; sub-command parsers inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """One line, like every other refusal of the command line (the usage is one --help away)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The installed distribution's version, else the package's own `__version__`."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("sgraf")
    except PackageNotFoundError:
        from sgraf import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="sgraf",
        description="Image-text matching with SGRAF (Similarity Graph Reasoning and Attention Filtration).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", dest="quiet_everywhere", action="store_true", help=QUIET_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=ArgumentParser)
    for name in COMMAND_MODULES:      # a name without its module fails here (it had been skipped)
        importlib.import_module(f"sgraf.cli.{name}").register(subparsers)
    for command in _leaf_parsers(parser):
        if "--quiet" not in command._option_string_actions:
            command.add_argument(*(("-q",) if "-q" not in command._option_string_actions else ()), "--quiet",
                                 action="store_true", help=QUIET_HELP)
    return parser


QUIET_HELP = ("no progress bars and no INFO lines; warnings and errors still print (bars are drawn only "
              "where stderr is a terminal)")


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of the commands that run (`evaluate`, `data check`), not of those that only
    name others (`data`)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return [parser]
    return [leaf for child in dict.fromkeys(actions[0].choices.values()) for leaf in _leaf_parsers(child)]


def _parser_of(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str],
               unknown: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser whose options `unknown` stood among: the innermost (sub-)command named before the
    first of them (`sgraf vocab build --bogus`: `vocab build`), else the top one (`sgraf --bogus evaluate`);
    without `unknown`, the innermost command named."""
    first = argv.index(unknown[0]) if unknown and unknown[0] in argv else len(argv)
    current, position = parser, 0
    while True:
        actions = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, actions[0].dest, None) if actions and actions[0].dest != argparse.SUPPRESS else None
        if chosen is None or chosen not in argv[position:first]:
            return current
        position = argv.index(chosen, position) + 1
        current = actions[0].choices[chosen]


# the words of a collective failing because another process of the job left: gloo's, NCCL's
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "NCCL communicator was aborted")


def _peer_gone(error: RuntimeError) -> bool:
    """Whether `error` is a collective of a torchrun job failing because another process left,
    rather than a fault of this one."""
    return "torch.distributed" in sys.modules and any(text in str(error) for text in _PEER_GONE)


def _refuse_repeated(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`parser.error` for an option of one value given twice (`--split test --split dev`): argparse
    keeps the last silently. Options that collect (`--checkpoint`, `--sims`: extend) may repeat."""
    seen: dict[argparse.Action, tuple[str, str]] = {}
    for position, token in enumerate(argv):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name, has_value, value = token.partition("=")
        action = parser._option_string_actions.get(name)
        if action is None:      # an abbreviation argparse took (`--spl`)
            matches = {a for option, a in parser._option_string_actions.items() if option.startswith(name)}
            action = matches.pop() if len(matches) == 1 else None
        if not isinstance(action, argparse._StoreAction):
            continue
        value = value if has_value else (argv[position + 1] if position + 1 < len(argv) else "")
        if action in seen:
            parser.error(f"argument {'/'.join(action.option_strings)}: given twice ({seen[action][1]}, then "
                         f"{value}): give it once")
        seen[action] = (name, value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        given = sys.argv[1:] if argv is None else list(argv)
        if unknown:   # said by the command's parser: "sgraf evaluate: error: ... (see sgraf evaluate --help)"
            _parser_of(parser, args, given, unknown).error(f"unrecognized arguments: {' '.join(unknown)}")
        command = _parser_of(parser, args, given)
        prog = command.prog     # "sgraf data check", as argparse's own refusals name it
        _refuse_repeated(command, given[given.index(args.command) + 1:] if args.command in given else given)
        args.quiet = quiet = args.quiet_everywhere or args.quiet
        if quiet and args.verbose:
            command.error("--verbose and --quiet ask for opposite things: give one")
    except SystemExit as stop:  # --help, --version (0) or a refused argument (2)
        return int(stop.code or 0)
    except KeyboardInterrupt:   # Ctrl-C while the arguments are read (`--device` imports torch: a second)
        print("sgraf: interrupted", file=sys.stderr)
        return 130
    for stream in (sys.stdout, sys.stderr):
        # A path given as bytes that are not UTF-8 reaches Python as lone surrogates; print it back
        # as those bytes (as ls does) rather than fail after the work is done. Under an ASCII locale
        # without Python's UTF-8 mode (LC_ALL=C PYTHONUTF8=0), text past ASCII (a query, a caption,
        # one echoed in an error) is printed in UTF-8, as it was read (`arguments.utf8_text`); under
        # another one (Latin-1) a character it cannot write is written as an escape, never a failure.
        if not callable(getattr(stream, "reconfigure", None)):
            continue
        encoding = codecs.lookup(stream.encoding or "ascii").name
        if encoding == "ascii":
            stream.reconfigure(encoding="utf-8", errors="surrogateescape")
        else:
            stream.reconfigure(errors="surrogateescape" if encoding == "utf-8" else "backslashreplace")
    from sgraf import progress

    # this call's choice, not an earlier call's (tests run `main` in one process); bars only on a terminal
    progress.silence(quiet or not progress.terminal(sys.stderr))
    rank, world_size = _torchrun_rank()
    if rank > 0:    # under torchrun every process may say the same: the others' lines say which they are
        prog = f"{prog} [rank {rank}]"
    logging.basicConfig(
        level=log_level(args.verbose, rank, quiet),
        format=("%(levelname)s %(name)s: %(message)s" if world_size <= 1
                else f"%(levelname)s %(name)s [rank {rank}]: %(message)s"),
        stream=sys.stderr,
    )
    if sys.stdout is None:  # started with stdout closed (>&-): what the command prints goes nowhere
        logger.warning("stdout is closed: what %s prints (its results, or what it wrote) is lost", prog)
    if not args.verbose:    # PyTorch's INFO lines (a cache's statistics at exit) are not ours to print
        logging.getLogger("torch").setLevel(logging.WARNING)
    try:
        return _run_command(args, prog)
    finally:        # the bars of later Python calls in this process are theirs to choose again
        progress.silence(False)


# sgraf's variables naming a choice, and the module whose ROUTES they take
ROUTE_VARIABLES = {"SGRAF_CPU_MATMUL": "sgraf.kernels.cpu", "SGRAF_EDGE_ROUTE": "sgraf.kernels.edges",
                   **dict.fromkeys(("SGRAF_WORD_ROUTE", "SGRAF_STEP_ROUTE", "SGRAF_ATTENTION_ROUTE",
                                    "SGRAF_FILTER_ROUTE"), "sgraf.kernels.fused_routes")}


def _check_set_variables() -> None:
    """The route variables, SGRAF_COMPILE and SGRAF_JOIN_TIMEOUT checked when they are set, so a
    typo stops a command before it starts rather than when the route is first taken (unset,
    nothing is imported: `sgraf runs` stays without PyTorch)."""
    given = {name for name in (*ROUTE_VARIABLES, "SGRAF_COMPILE", "SGRAF_JOIN_TIMEOUT")
             if os.environ.get(name, "").strip()}
    if not given:
        return
    from sgraf.kernels import tuning

    for name in sorted(given & ROUTE_VARIABLES.keys()):
        tuning.forced_route(name, importlib.import_module(ROUTE_VARIABLES[name]).ROUTES)
    if "SGRAF_COMPILE" in given:
        from sgraf.kernels import compiled

        compiled.variable_mode()
    if "SGRAF_JOIN_TIMEOUT" in given:
        from sgraf.distributed import join_timeout

        join_timeout()


def _run_command(args: argparse.Namespace, prog: str) -> int:
    """The command's function, its exceptions turned into one line on stderr and an exit code."""
    from sgraf.signals import Stopped, stop_on_sigterm

    try:
        from sgraf.user_cache import check_switches

        check_switches()
        _check_set_variables()
        with stop_on_sigterm():
            return int(args.func(args) or 0)
    except Stopped as stop:
        print(f"{prog}: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        message = str(exc) if not isinstance(exc, OSError) or not exc.filename else (
            f"{exc.filename}: {exc.strerror}")
        print(f"{prog}: error: {bounded(message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        if not _peer_gone(exc):
            raise
        # another process of the torchrun job failed (its own line says why) and left: this one stops too
        print(f"{prog}: error: another process of this torchrun job stopped (its error is above); this one stops "
              "too", file=sys.stderr)
        return 1
    except MemoryError as exc:    # numpy's names the size it could not allocate
        print(f"{prog}: error: out of memory" + (f": {bounded(str(exc))}" if str(exc) else ""),
              file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader of the output went away (`sgraf search ... | head -1`): what it wanted it has;
        # the rest goes nowhere, as the other commands' output does when flushed at exit
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            # a writer that did not name its file (each of sgraf's does): still one line
            print(f"{prog}: error: cannot write {exc.filename or 'its output'}: {exc.strerror}",
                  file=sys.stderr)
            return 2
        if exc.filename is None:
            raise
        # what the system refused about a path: a name too long, a loop of links, a read-only file system
        print(f"{prog}: error: {bounded(f'{exc.filename}: {exc.strerror}')}", file=sys.stderr)
        return 2


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
LONG_WORD = 400     # characters of one word of an error message shown at most (a long path fits)


def bounded(message: str) -> str:
    """`message` with every word longer than `LONG_WORD` characters cut to its start and its length
    (a refusal echoes the value given: `--set module=` 100 KB of text was printed whole)."""
    import re

    return re.sub(r"\S{%d,}" % (LONG_WORD + 1),
                  lambda found: f"{found.group()[:60]}... ({len(found.group()):,} characters)", message)


def entry() -> NoReturn:
    """The `sgraf` console script and `python -m sgraf`: `main`, then `exit_process` with its code."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """End the process with exit status `code` now that the command is done, without the
    interpreter's teardown.

    Tearing down a process that imported PyTorch takes most of a second (its thousand modules
    and its operator registry unwound one by one, measured on a 2-core EPYC), about a fifth of a
    later Flickr30K-size `sgraf evaluate` there. So once the output is flushed and the atexit handlers
    have run (logging's, temporary folders', multiprocessing's children), `os._exit` ends the
    process at once. It exits the usual way instead where that could cut work short: a thread
    that is not a daemon or a child process still running, a Python without
    `atexit._run_exitfuncs`, or `SGRAF_FAST_EXIT=off`.
    """
    import atexit
    import threading

    from sgraf.errors import InputError
    from sgraf.user_cache import switched_on

    try:
        fast = switched_on("SGRAF_FAST_EXIT")
    except InputError:       # said by the command's own check: the usual way out
        fast = False
    others = [thread for thread in threading.enumerate()
              if thread is not threading.main_thread() and not thread.daemon]
    children = sys.modules["multiprocessing"].active_children() if "multiprocessing" in sys.modules else []
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if others or children or run_exit_handlers is None or not fast:
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:              # started with the stream closed (`>&-`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):   # a reader that went away, a stream already closed
            pass
    os._exit(code)


def log_level(verbose: bool, rank: int, quiet: bool = False) -> int:
    """DEBUG with --verbose; WARNING with --quiet; else INFO, but WARNING on the processes of
    torchrun other than rank 0."""
    if verbose:
        return logging.DEBUG
    return logging.INFO if rank == 0 and not quiet else logging.WARNING


def _torchrun_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) that torchrun set for this process; (0, 1) without torchrun."""
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


if __name__ == "__main__":  # pragma: no cover
    entry()
