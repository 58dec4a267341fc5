"""`sgraf runs`: run folders side by side (best dev rsum, how far each got, what sets them apart)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs",
        help="training runs side by side: best dev rsum, epochs, state (finished, stopped, running) and the "
             "settings that differ",
        description="List run folders written by sgraf train: each run's best dev rsum and its epoch, the last "
                    "validation's rsum, epochs done, and whether it finished, stopped (with the command that "
                    "resumes it), is running (who holds it) or never reached a checkpoint; then the settings "
                    "(config.yaml) and data that differ between the runs. Reads the folders only: no "
                    "checkpoint is loaded and no lock taken.",
    )
    parser.add_argument("folders", nargs="+", metavar="FOLDER",
                        help="a run folder, or a folder searched for run folders (e.g. runs/)")
    parser.add_argument("--sort", choices=("name", "rsum"), default="name",
                        help="name: the folders' order; rsum: best dev rsum first")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.training import runs

    summary = runs.summarise(args.folders, sort=args.sort)
    print(json.dumps(summary) if args.json else runs.format_runs(summary))
    return 0
