"""`sgraf evaluate`: recalls of a checkpoint, an ensemble, or saved score matrices on a split."""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="R@K / medr / meanr / rsum of checkpoints (averaged: SGR + SAF = SGRAF) or saved score matrices",
        description="Evaluate image-text retrieval on a precomp split with the authors' protocol. Several "
                    "--checkpoint (or --sims) are evaluated on the average of their score matrices. "
                    "Runs on several processes with torchrun, each scoring a share of the images.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", action="append", metavar="PATH",
                        help="our checkpoint or the authors' .pth.tar; repeat for an ensemble")
    source.add_argument("--sims", nargs="+", metavar="FILE.npy",
                        help="saved (n_images, n_captions) score matrices to evaluate or average")
    parser.add_argument("--data", metavar="DIR", help="directory with {SPLIT}_ims.npy and {SPLIT}_caps.txt "
                        "(required with --checkpoint; with --sims, checks the matrices' shape)")
    parser.add_argument("--split", default="test", help="split name (default: test; MSCOCO: testall)")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON (needed for the authors' checkpoints)")
    parser.add_argument("--folds", type=_positive_int, default=1, metavar="K",
                        help="average over K consecutive equal folds (MSCOCO 1K: --split testall --folds 5)")
    parser.add_argument("--save-sims", metavar="FILE.npy", help="write the float32 score matrix (caption-file order)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="default: fp32")
    parser.add_argument("--tf32", action="store_true",
                        help="on CUDA, fp32 matmuls and cuDNN in TF32 (faster, 10-bit mantissa; default: exact fp32)")
    parser.add_argument("--batch-size", type=_positive_int, default=128, metavar="N",
                        help="captions/images per encoder batch and captions per scoring bucket (default: 128)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available; under "
                        "torchrun each process takes its LOCAL_RANK device)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf import distributed, evaluate, metrics
    from sgraf.errors import InputError
    from sgraf.precision import tf32

    if args.sims:
        if args.vocab:
            raise InputError("--vocab applies to --checkpoint, not to --sims")
        result = evaluate.evaluate_sims_files(args.sims, folds=args.folds, data_dir=args.data,
                                              split=args.split if args.data else None, save_sims=args.save_sims)
    else:
        if not args.data:
            raise InputError("--data DIR is required with --checkpoint")
        info = distributed.init_from_env(device=args.device)
        try:
            with tf32(args.tf32):
                result = evaluate.evaluate_checkpoints(
                    args.checkpoint, args.data, args.split, vocab=args.vocab, folds=args.folds,
                    precision=args.precision, batch_size=args.batch_size, device=info.device,
                    progress=not args.quiet, save_sims=args.save_sims)
        finally:
            distributed.cleanup()
        if not info.is_main:
            return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(metrics.format_table(result))
    return 0
