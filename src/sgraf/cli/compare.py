"""`sgraf compare`: is one model's recall better than another's on a split, or within noise?"""

from __future__ import annotations

import argparse
import json
import os

from sgraf.cli.arguments import positive_int, seed


def _level(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (0.95 for 95 %), got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="two models' score matrices of one split, paired: each recall's difference, its bootstrap "
             "interval and a randomization-test p-value",
        description="Compare model A (--sims) with model B (--against) on the split both scored, from their "
                    "saved score matrices (sgraf evaluate --save-sims; several on one side are averaged, "
                    "e.g. SGR + SAF = SGRAF). Paired by image (an image with its captions is the unit): "
                    "each recall and rsum of A and B, A - B, a percentile bootstrap interval of A - B over "
                    "resampled images, and the p-value of a paired randomization test (each image's "
                    "queries counted for A or B at random).",
    )
    parser.add_argument("--sims", nargs="+", required=True, metavar="FILE.npy",
                        help="model A's (n_images, n_captions) score matrix (several: their average)")
    parser.add_argument("--against", nargs="+", required=True, metavar="FILE.npy",
                        help="model B's score matrix of the same split (several: their average)")
    parser.add_argument("--data", metavar="DIR",
                        help="the precomp folder of the split: checks the matrices' shape, and their captions "
                             "by the records --save-sims writes")
    parser.add_argument("--split", default="test", help="split name, with --data (MSCOCO: testall)")
    parser.add_argument("--folds", type=positive_int, default=1, metavar="K",
                        help="metrics averaged over K consecutive equal folds, images resampled within each "
                             "(MSCOCO 1K: --split testall --folds 5)")
    parser.add_argument("--resamples", type=positive_int, default=10000, metavar="N",
                        help="bootstrap resamples and randomization flips (the smallest p-value is 1 / (N + 1))")
    parser.add_argument("--level", type=_level, default=0.95, help="the interval's coverage")
    parser.add_argument("--seed", type=seed, default=0, help="the resampling's seed")
    parser.add_argument("--diagnose", action="store_true",
                        help="also sgraf diagnose's scores (Winoground per kind of hard negative, truth-aware "
                             "recall), paired by family; needs --data written by sgraf generate")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf import diagnose, evaluate, significance
    from sgraf.errors import InputError
    from sgraf.io_paths import check_distinct

    if args.split != "test" and not args.data:
        raise InputError("--split applies with --data")
    check_distinct("--sims", args.sims, "the matrices are averaged")
    check_distinct("--against", args.against, "the matrices are averaged")
    # one matrix may be on both sides (SGRAF against its SAF), but not the same model on both
    if {os.path.realpath(path) for path in args.sims} == {os.path.realpath(path) for path in args.against}:
        raise InputError(f"--sims and --against name the same {'matrix' if len(args.sims) == 1 else 'matrices'}: "
                         "a model compared with itself")
    scenes = _scenes(args) if args.diagnose else None       # checked before the matrices are read
    sims_a, sims_b = evaluate.load_compared(args.sims, args.against, args.data, args.split if args.data else None)
    result = significance.compare(sims_a, sims_b, folds=args.folds, resamples=args.resamples, level=args.level,
                                  seed=args.seed)
    families = None
    if scenes is not None:
        diagnose.check_scenes(scenes[0], *sims_a.shape, scenes[1])
        families = diagnose.compare_families(sims_a, sims_b, scenes[0], resamples=args.resamples, seed=args.seed,
                                             level=args.level)
    names = (" + ".join(args.sims), " + ".join(args.against))
    if args.json:
        extra = {} if families is None else {"diagnose": families}
        print(json.dumps({**result, **extra, "sims": list(args.sims), "against": list(args.against)}))
    else:
        print(significance.format_comparison(result, names))
        if families is not None:
            print()
            print(diagnose.format_family_comparison(families))
    return 0


def _scenes(args: argparse.Namespace) -> tuple[list, str]:
    """The split's scenes and their path, checked as `sgraf diagnose` checks them (InputError)."""
    from sgraf import diagnose
    from sgraf.errors import InputError

    if not args.data:
        raise InputError("--diagnose needs --data, a folder written by sgraf generate")
    if args.folds != 1:
        raise InputError("--diagnose compares the whole split: leave out --folds")
    scenes, scenes_path = diagnose.open_scenes(args.data, args.split, "--diagnose")
    return scenes, str(scenes_path)
