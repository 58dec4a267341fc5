"""`sgraf diagnose`: Winoground scores per kind of hard negative, and truth-aware recall."""

from __future__ import annotations

import argparse
import json
import logging

from sgraf.cli.arguments import (MAX_RESAMPLES, add_score_source, add_scoring_options, check_bootstrap,
                                 check_score_outputs, check_score_source, checked_device, int_in, split_name)

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagnose",
        help="Winoground text / image / group scores per kind of hard negative, and truth-aware recall",
        description="Score a checkpoint, an ensemble (averaged, as sgraf evaluate) or saved score matrices on "
                    "a split of the embedded benchmark (sgraf generate), pairing each hard negative with its "
                    "family's base picture the Winoground way; chance is 25 / 25 / 16.7 %. Truth-aware "
                    "recall counts a picture of the caption's family as correct unless the caption is false "
                    "for it.",
    )
    add_score_source(parser, "saved (n_images, n_captions) score matrices of the split (averaged)")
    parser.add_argument("--data", metavar="DIR", required=True,
                        help="a folder written by sgraf generate (with {SPLIT}_scenes.jsonl)")
    parser.add_argument("--split", type=split_name, default="test", help="split name")
    parser.add_argument("--bootstrap", type=int_in(1, MAX_RESAMPLES), metavar="N",
                        help="also 95 %% intervals of every score, from N (at least 40) bootstrap resamples of "
                             "the families (a base picture with its twins, drawn together; seed 0)")
    add_scoring_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf import diagnose, evaluate

    check_score_source(args)
    check_score_outputs(args)
    device = checked_device(args.device)
    check_bootstrap(args.bootstrap)
    scenes, scenes_path = diagnose.open_scenes(args.data, args.split, "diagnose")   # before scoring
    if args.sims:
        _, sims = evaluate.evaluate_sims_files_with_sims(args.sims, data_dir=args.data, split=args.split,
                                                         save_sims=args.save_sims)
    else:
        _, sims = evaluate.evaluate_checkpoints_with_sims(
            args.checkpoint, args.data, args.split, vocab=args.vocab, precision=args.precision,
            batch_size=args.batch_size, device=device, progress=not args.quiet, save_sims=args.save_sims)
    diagnose.check_scenes(scenes, *sims.shape, str(scenes_path))
    result = diagnose.diagnose_sims(sims, scenes, bootstrap=args.bootstrap)
    if args.json:
        print(json.dumps(result))
    else:
        print(diagnose.format_report(result))
    return 0
