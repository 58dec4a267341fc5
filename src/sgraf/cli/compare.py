"""`sgraf compare`: is one model's recall better than another's on a split, or within noise?"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from sgraf.cli.arguments import (ENSEMBLE_OF_MODELS, MAX_RESAMPLES, add_score_source, add_scoring_options,
                                 checked_device, int_in, positive_int, seed, split_name)

if TYPE_CHECKING:
    import numpy as np


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
        help="two models on one split, paired: each recall's difference, its bootstrap interval and a "
             "randomization-test p-value",
        description="Compare model A (--checkpoint or --sims) with model B (--against) on one split: from "
                    "checkpoints, scored on --data's split, or from their saved score matrices (sgraf evaluate "
                    "--save-sims); several on one side are averaged, e.g. SGR + SAF = SGRAF. Paired by image "
                    "(an image with its captions is the unit): each recall and rsum of A and B, A - B, a "
                    "percentile bootstrap interval of A - B over resampled images, and the p-value of a paired "
                    "randomization test (each image's queries counted for A or B at random).",
    )
    add_score_source(parser, "model A's saved (n_images, n_captions) score matrices (several: their average)")
    parser.add_argument("--against", action="extend", nargs="+", required=True, metavar="FILE",
                        help="model B of the same split: score matrices (.npy, averaged) or checkpoints (an "
                             "ensemble)")
    parser.add_argument("--data", metavar="DIR",
                        help="the precomp folder of the split: needed to score checkpoints; checks saved matrices' "
                             "shape, and their captions by the records --save-sims writes")
    parser.add_argument("--split", type=split_name, default="test", help="split name, with --data (MSCOCO: testall)")
    parser.add_argument("--folds", type=positive_int, default=1, metavar="K",
                        help="metrics averaged over K consecutive equal folds, images resampled within each "
                             "(MSCOCO 1K: --split testall --folds 5)")
    parser.add_argument("--resamples", type=int_in(1, MAX_RESAMPLES), default=10000, metavar="N",
                        help="bootstrap resamples and randomization flips (the smallest p-value is 1 / (N + 1); "
                             "at least 2 / (1 - level), 40 for 95 %%)")
    parser.add_argument("--level", type=_level, default=0.95, help="the interval's coverage")
    parser.add_argument("--seed", type=seed, default=0, help="the resampling's seed")
    parser.add_argument("--diagnose", action="store_true",
                        help="also sgraf diagnose's scores (Winoground per kind of hard negative, truth-aware "
                             "recall), paired by family; needs --data written by sgraf generate")
    add_scoring_options(parser, save_sims=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from sgraf import diagnose, significance

    side_a = (args.checkpoint or args.sims, args.checkpoint is not None)
    side_b = (args.against, _checkpoints("--against", args.against))
    _check(args, side_a, side_b)
    significance.check_resamples(args.resamples, args.level)      # before the matrices are read or scored
    device = checked_device(args.device)
    scenes = _scenes(args) if args.diagnose else None       # checked before the matrices are read or scored
    sims_a, sims_b = _matrices(args, side_a, side_b, device)
    if np.array_equal(sims_a, sims_b):     # a copy of a matrix, or a checkpoint against its own saved matrix
        from sgraf.errors import InputError

        raise InputError("A and B score every pair alike, to the bit (the same model, or copies of one matrix): "
                         "nothing to compare")
    result = significance.compare(sims_a, sims_b, folds=args.folds, resamples=args.resamples, level=args.level,
                                  seed=args.seed)
    families = None
    if scenes is not None:
        diagnose.check_scenes(scenes[0], *sims_a.shape, scenes[1])
        families = diagnose.compare_families(sims_a, sims_b, scenes[0], resamples=args.resamples, seed=args.seed,
                                             level=args.level)
    names = (" + ".join(side_a[0]), " + ".join(side_b[0]))
    if args.json:
        extra = {} if families is None else {"diagnose": families}
        source = "checkpoint" if side_a[1] else "sims"
        print(json.dumps({**result, **extra, source: list(side_a[0]), "against": list(args.against)}))
    else:
        print(significance.format_comparison(result, names))
        if families is not None:
            print()
            print(diagnose.format_family_comparison(families))
    return 0


def _checkpoints(flag: str, paths: list[str]) -> bool:
    """Whether `paths` are checkpoints (True) or saved score matrices (.npy; False); InputError
    for a mix."""
    from sgraf.errors import InputError

    matrices = [path for path in paths if path.lower().endswith(".npy")]
    if matrices and len(matrices) < len(paths):
        other = next(path for path in paths if not path.lower().endswith(".npy"))
        raise InputError(f"{flag}: {matrices[0]} is a score matrix (.npy) and {other} is not: give one model's "
                         "saved matrices or its checkpoints, not both")
    return not matrices


def _side_vocab(paths: list[str], vocab: str | None) -> str | None:
    """`--vocab` for a side with a checkpoint that carries no vocabulary (the authors'); None for a
    side whose checkpoints all carry theirs, which keep them (ours, trained on a vocabulary built
    from the data, against the authors' .pth.tar and their vocabulary file had been refused either
    way: --vocab applied to both sides, or to neither)."""
    if vocab is None:
        return None
    from sgraf.checkpoint import load_checkpoint

    return vocab if any(load_checkpoint(path).get("vocab") is None for path in paths) else None


def _check(args: argparse.Namespace, side_a: tuple[list[str], bool], side_b: tuple[list[str], bool]) -> None:
    """The arguments' one-line refusals, before anything is read."""
    from sgraf.errors import InputError
    from sgraf.io_paths import check_distinct

    if args.split != "test" and not args.data:
        raise InputError("--split applies with --data")
    for flag, (paths, checkpoints) in (("--checkpoint" if side_a[1] else "--sims", side_a), ("--against", side_b)):
        check_distinct(flag, paths, ENSEMBLE_OF_MODELS if checkpoints else "the matrices are averaged")
        if checkpoints and not args.data:
            raise InputError(f"{flag} names checkpoints: --data DIR is required to score them")
    if args.vocab and not (side_a[1] or side_b[1]):
        raise InputError("--vocab applies to checkpoints, not to saved score matrices")
    # one model may be on both sides (SGRAF against its SAF), but not the same model on both
    if {os.path.realpath(path) for path in side_a[0]} == {os.path.realpath(path) for path in side_b[0]}:
        raise InputError(f"{'--checkpoint' if side_a[1] else '--sims'} and --against name the same "
                         f"{'model' if side_a[1] else 'matrix' if len(side_a[0]) == 1 else 'matrices'}: "
                         "a model compared with itself")


def _matrices(args: argparse.Namespace, side_a: tuple[list[str], bool], side_b: tuple[list[str], bool],
              device: str) -> tuple[np.ndarray, np.ndarray]:
    """A's and B's score matrices of the split: saved ones read and checked (`evaluate.load_compared`,
    `load_matrices`), then checkpoints scored on --data's split (`evaluate_checkpoints_with_sims`)."""
    from sgraf import evaluate

    split = args.split if args.data else None
    if not (side_a[1] or side_b[1]):
        return evaluate.load_compared(side_a[0], side_b[0], args.data, split)
    # both sides' checkpoints loaded and fitted to the split before either is scored: a typo in
    # --against must not cost the minutes of scoring A first
    precomp = evaluate.open_split(args.data, args.split)
    vocabs = {index: _side_vocab(paths, args.vocab) for index, (paths, checkpoints) in enumerate((side_a, side_b))
              if checkpoints}
    for index, (paths, checkpoints) in enumerate((side_a, side_b)):
        if checkpoints:
            models, _ = evaluate.load_ensemble(paths, vocabs[index], "cpu")
            for model, path in zip(models, paths):
                evaluate.check_split_fits(model, precomp, str(path))
            del models      # loaded again to be scored: not held twice meanwhile
    saved = {index: evaluate.load_matrices(paths, args.data, split)[0]
             for index, (paths, checkpoints) in enumerate((side_a, side_b)) if not checkpoints}
    scored = {index: evaluate.evaluate_checkpoints_with_sims(
                  paths, args.data, args.split, vocab=vocabs[index], folds=args.folds, precision=args.precision,
                  batch_size=args.batch_size, device=device, progress=not args.quiet)[1]
              for index, (paths, checkpoints) in enumerate((side_a, side_b)) if checkpoints}
    matrices = {**saved, **scored}
    return matrices[0], matrices[1]


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
