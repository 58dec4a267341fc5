"""`sgraf runs`: run folders side by side (best dev rsum, how far each got, what sets them apart)."""

from __future__ import annotations

import argparse
import json
import logging

from sgraf.cli.arguments import png_path, refuse_others_files

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs",
        help="training runs side by side: best dev rsum, epochs, state (finished, stopped, running) and the "
             "settings that differ",
        description="List run folders written by sgraf train: each run's best dev rsum and its epoch, the last "
                    "validation's rsum, epochs done, and whether it finished, stopped early (patience), stopped "
                    "(with the command that resumes it), is running (who holds it) or never reached a "
                    "checkpoint; then the settings (config.yaml) and data that differ between the runs. Reads "
                    "the folders only: no checkpoint is loaded and no lock taken.",
    )
    parser.add_argument("folders", nargs="+", metavar="FOLDER",
                        help="a run folder, or a folder searched for run folders (e.g. runs/)")
    parser.add_argument("--sort", choices=("name", "rsum"), default="name",
                        help="name: the folders' order; rsum: best dev rsum first")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", type=png_path, metavar="FILE.png",
                        help="also draw every run's training loss and dev rsum against the step into one picture")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.errors import InputError
    from sgraf.training import runs

    summary = runs.summarise(args.folders, sort=args.sort)
    drawn = [run["path"] for run in summary["runs"] if run.get("last_rsum") is not None]
    if args.plot:
        from sgraf.training.plots import check_plot_output

        check_plot_output([run["path"] for run in summary["runs"]], args.plot)   # a run's curves.png is an input
        refuse_others_files([("--plot", args.plot)])
        if not drawn:
            raise InputError("--plot: none of the runs has a validation yet; nothing to draw")
    print(json.dumps(summary) if args.json else runs.format_runs(summary))
    if args.plot:
        from sgraf.training.plots import plot_runs

        plot_runs(dict(zip(_legend_names(drawn), drawn)), args.plot)
        logger.info("drew the curves of %d run%s into %s", len(drawn), "" if len(drawn) == 1 else "s", args.plot)
    return 0


def _legend_names(paths: list[str]) -> list[str]:
    """The runs' folders below the folder they share (`runs/a`, `runs/b` -> `a`, `b`), for a legend."""
    import os

    if len(paths) == 1:
        return [os.path.basename(os.path.normpath(paths[0])) or paths[0]]
    try:
        common = os.path.commonpath([os.path.abspath(path) for path in paths])
    except ValueError:        # Windows: runs on several drives share no folder
        return [os.path.abspath(path) for path in paths]
    return [os.path.relpath(os.path.abspath(path), common) for path in paths]
