"""`sgraf evaluate`: recalls of a checkpoint, an ensemble, or saved score matrices on a split."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from sgraf.cli.arguments import (MAX_RESAMPLES, add_score_source, add_scoring_options, check_bootstrap,
                                 check_score_outputs, check_score_source, checked_device, int_in, positive_int,
                                 split_name)

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="R@K / medr / meanr / rsum of checkpoints (averaged: SGR + SAF = SGRAF) or saved score matrices",
        description="Evaluate image-text retrieval on a precomp split with the authors' protocol. Several "
                    "--checkpoint (or --sims) are evaluated on the average of their score matrices. "
                    "Runs on several processes with torchrun, each scoring a share of the images.",
    )
    add_score_source(parser, "saved (n_images, n_captions) score matrices to evaluate or average")
    parser.add_argument("--data", metavar="DIR", help="directory with {SPLIT}_ims.npy and {SPLIT}_caps.txt "
                        "(required with --checkpoint; with --sims, checks the matrices' shape, and their captions "
                        "by the records --save-sims writes)")
    parser.add_argument("--split", type=split_name, default="test", help="split name (MSCOCO: testall)")
    parser.add_argument("--folds", type=positive_int, default=1, metavar="K",
                        help="average over K consecutive equal folds (MSCOCO 1K: --split testall --folds 5)")
    parser.add_argument("--tf32", action="store_true",
                        help="on CUDA, fp32 matmuls and cuDNN in TF32 (faster, 10-bit mantissa; default: exact fp32)")
    parser.add_argument("--bootstrap", type=int_in(1, MAX_RESAMPLES), metavar="N",
                        help="also 95 %% intervals of every recall and rsum, from N (at least 40) bootstrap "
                             "resamples of the images (an image with its captions; seed 0); sgraf compare tests "
                             "two models")
    parser.add_argument("--timings", action="store_true",
                        help="seconds per stage (startup, imports, device start, checkpoint, tokenise, encode, "
                             "score, metrics, save) on stderr, and as \"timings\" in --json's object")
    add_scoring_options(parser, torchrun=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.stopwatch import Stopwatch, process_age, stage

    watch = Stopwatch(startup=process_age()) if args.timings else None
    check_score_source(args)
    check_score_outputs(args)
    with stage(watch, "imports"):
        prefetched = _prefetch_captions(args)   # tokenised in another process meanwhile
        import sgraf.evaluate  # noqa: F401  (PyTorch, timed here; used in _evaluate)
    try:
        return _evaluate(args, watch, prefetched)
    finally:
        if prefetched is not None:   # a command that stopped before it needed them
            prefetched.cancel()


def _prefetch_captions(args: argparse.Namespace) -> Any:
    """`sgraf.data.token_cache.prefetch` of the split's captions, started before this process
    imports PyTorch and loads the checkpoint; None with --sims, without the caption file, or
    under torchrun (each process would start one)."""
    from sgraf.cli import _torchrun_rank
    from sgraf.data.layout import split_files

    if args.sims or not args.data or _torchrun_rank()[1] > 1:
        return None
    captions = split_files(args.data, args.split)[1]
    if not captions.is_file():
        return None
    from sgraf.data.token_cache import prefetch

    return prefetch(captions)


def _evaluate(args: argparse.Namespace, watch: Any, prefetched: Any) -> int:
    from sgraf import distributed, evaluate, metrics
    from sgraf.errors import InputError
    from sgraf.precision import tf32
    from sgraf.stopwatch import format_timings, stage

    device = checked_device(args.device)    # refused before anything is read
    check_bootstrap(args.bootstrap)
    sims = None
    if args.sims:
        from sgraf.cli import _torchrun_rank

        if _torchrun_rank()[0] > 0:     # saved matrices have no shares: the first process prints (and writes)
            return 0
        result, sims = evaluate.evaluate_sims_files_with_sims(
            args.sims, folds=args.folds, data_dir=args.data, split=args.split if args.data else None,
            save_sims=args.save_sims, stopwatch=watch)
    else:
        if not args.data:
            raise InputError("--data DIR is required with --checkpoint")
        with stage(watch, "device start"):
            info = distributed.init_from_env(device=device)
            if watch is not None:   # the device's context now, not inside the checkpoint's stage
                watch.use(info.device)
                evaluate.start_device(info.device)
        clean = False
        try:
            # the matrix comes to the host only where it is saved or resampled
            score = evaluate.evaluate_checkpoints_with_sims if args.bootstrap else evaluate.evaluate_checkpoints
            with tf32(args.tf32):
                result = score(
                    args.checkpoint, args.data, args.split, vocab=args.vocab, folds=args.folds,
                    precision=args.precision, batch_size=args.batch_size, device=info.device,
                    progress=not args.quiet, save_sims=args.save_sims, stopwatch=watch, token_prefetch=prefetched)
            if args.bootstrap:
                result, sims = result
            clean = True
        finally:
            distributed.cleanup(barrier=clean)     # leaving on an error: no wait for the others (torchrun stops them)
        if not info.is_main:
            return 0
    intervals = None
    if args.bootstrap:
        from sgraf import significance

        with stage(watch, "metrics"):
            intervals = significance.recall_intervals(sims, folds=args.folds, resamples=args.bootstrap)
        result = {**result, "intervals": intervals}
    if watch is not None:
        timings = watch.report()
        print(f"sgraf evaluate: timings: {format_timings(timings)}", file=sys.stderr)
        if args.json:
            result = {**result, "timings": timings}
    if args.json:
        print(json.dumps(result))
    else:
        print(metrics.format_table(result))
        if intervals is not None:
            from sgraf import significance

            print(significance.format_intervals(intervals))
    return 0
