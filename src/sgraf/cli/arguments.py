"""Argument types shared by the sub-commands: numbers in range, seeds, devices, text.

Each is an argparse `type=`: a bad value is refused while parsing, so argparse prints
`argument --batch-size: expected a positive integer, got 0` with the usage and exit code 2,
before anything is loaded.
"""

from __future__ import annotations

import argparse
from typing import Callable


def _integer(text: str, expected: str) -> int:
    """Plain digits with a sign or none (`sgraf.errors.plain_integer`; int() alone also reads ' 7 ')."""
    from sgraf.errors import plain_integer

    if not plain_integer(text):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, batch sizes)."""
    value = _integer(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


MAX_RESAMPLES = 1_000_000   # bootstrap / randomization resamples: memory grows with them (10,000 is plenty)


def check_bootstrap(resamples: int | None) -> None:
    """A command's `--bootstrap N`, checked before any work against the intervals' level
    (`sgraf.significance.check_resamples`); None or 0: no intervals asked for."""
    if resamples:
        from sgraf.significance import LEVEL, check_resamples

        check_resamples(resamples, LEVEL)


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (a count whose work or memory grows with it: a
    huge one had run out of memory with a traceback, or been killed)."""
    def parse(text: str) -> int:
        value = _integer(text, f"an integer in {low}..{high}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {value}")
        return value

    parse.__name__ = f"integer in {low}..{high}"     # what argparse names in its own messages
    return parse


def non_negative_int(text: str) -> int:
    """An integer >= 0 (indices; counts where 0 means 'none' or 'all')."""
    value = _integer(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def split_name(text: str) -> str:
    """A split name (train, dev, test, testall, ...): a plain name, no path (`layout.split_problem`)."""
    from sgraf.data.layout import split_problem

    problem = split_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def seed(text: str) -> int:
    """A random seed, 0 .. 2**32 - 1 (what numpy accepts)."""
    from sgraf.training.config import MAX_SEED

    value = _integer(text, f"a seed in 0..{MAX_SEED}")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed in 0..{MAX_SEED}, got {value}")
    return value


DEVICE_HELP = "cpu, cuda, cuda:N or mps; auto: cuda when available, else cpu"


def device(text: str) -> str:
    """A torch device this machine can use ('cpu', 'cuda', 'cuda:N', 'mps'; 'auto': CUDA when
    available), checked now (`sgraf.devices.resolve_device`)."""
    from sgraf.devices import resolve_device
    from sgraf.errors import InputError

    try:
        return str(resolve_device(text))
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def checked_device(text: str) -> str:
    """`--device` of `add_scoring_options`, checked when the command starts: the device this
    machine can use, or the one-line refusal the other commands give while parsing."""
    from sgraf.devices import resolve_device
    from sgraf.errors import InputError

    try:
        return str(resolve_device(text))
    except InputError as error:
        raise InputError(f"argument --device: {error}") from None


def png_path(value: str) -> str:
    """A file name for a picture to write, which must end in .png (the format is taken from it)."""
    if not value.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"expected a .png file name, got {value!r}")
    return value


def utf8_text(value: str) -> str:
    """Text from the command line that must be valid Unicode.

    Bytes that are not UTF-8 in `argv` reach Python as lone surrogates (surrogateescape);
    they would fail later, inside the tokenizer, with a codec message. Under a locale that is not
    UTF-8 (`LC_ALL=C` without Python's UTF-8 mode) every byte past ASCII arrives so, valid UTF-8
    too: the command line's bytes are read as UTF-8 first.
    """
    import os

    try:
        return os.fsencode(value).decode("utf-8")
    except UnicodeError:
        pass
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raw = value[error.start].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"bytes that are not valid UTF-8 (byte 0x{raw[0]:02x} at character {error.start + 1}); "
            "expected UTF-8 text") from None
    return value


# why a model named twice is refused (`check_distinct`)
ENSEMBLE_OF_MODELS = "an ensemble averages the scores of different models"


def add_score_source(parser: argparse.ArgumentParser, sims_help: str) -> None:
    """Exactly one of `--checkpoint PATH` (repeatable: an ensemble) or `--sims FILE.npy ...`
    (saved score matrices), for the commands that score a split (`evaluate`, `diagnose`)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", action="extend", nargs="+", metavar="PATH",
                        help="our checkpoint or the authors' .pth.tar; several (or --checkpoint repeated) for an "
                             "ensemble")
    source.add_argument("--sims", action="extend", nargs="+", metavar="FILE.npy", help=sims_help)


def check_score_source(args: argparse.Namespace) -> None:
    """InputError for options that apply to `--checkpoint` only but came with `--sims`, and for
    a checkpoint or matrix named twice (`sgraf.io_paths.check_distinct`)."""
    from sgraf.errors import InputError
    from sgraf.io_paths import check_distinct

    if args.sims and args.vocab:
        raise InputError("--vocab applies to --checkpoint, not to --sims")
    if args.sims:     # each had been ignored unsaid (a --split dev check of a test matrix passed)
        if getattr(args, "split", "test") != "test" and not getattr(args, "data", None):
            raise InputError("--split applies with --data (a saved matrix's record names the split it scored)")
        given = [flag for flag, on in (("--precision", getattr(args, "precision", "fp32") != "fp32"),
                                       ("--batch-size", getattr(args, "batch_size", 128) != 128),
                                       ("--tf32", bool(getattr(args, "tf32", False)))) if on]
        if given:
            raise InputError(f"{given[0]} applies to --checkpoint, not to --sims (the matrix is scored already)")
    check_distinct("--checkpoint", args.checkpoint, ENSEMBLE_OF_MODELS)
    check_distinct("--sims", args.sims, "the matrices are averaged")


def add_scoring_options(parser: argparse.ArgumentParser, torchrun: bool = False, save_sims: bool = True) -> None:
    """The options of a command that scores a split with checkpoints as `sgraf evaluate` does
    (`evaluate`, `diagnose`, `compare`): vocabulary, saved matrix (unless not `save_sims`), JSON,
    precision, batch size, device (every command has --quiet: `sgraf.cli.build_parser`)."""
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON (needed for the authors' checkpoints)")
    if save_sims:
        parser.add_argument("--save-sims", metavar="FILE.npy",
                            help="write the score matrix (caption-file order; float32, or float64 for an "
                                 "ensemble's mean or a float64 matrix given), and beside it FILE.npy.json, the "
                                 "split it scored (checked when it is read with --sims)")
    add_json(parser)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="encoder and scorer precision (bf16: autocast; scores stay float32, an ensemble's "
                             "mean float64)")
    parser.add_argument("--batch-size", type=positive_int, default=128, metavar="N",
                        help="captions/images per encoder batch and captions per scoring bucket")
    # checked by the command (`checked_device`), not while parsing: checking needs PyTorch, and
    # `evaluate` starts tokenising its captions in another process before importing it
    parser.add_argument("--device", default="auto",
                        help=DEVICE_HELP
                             + (" (under torchrun each process takes its LOCAL_RANK device)" if torchrun else ""))


JSON_HELP = "print one JSON object on stdout instead of the text"


def add_json(parser: argparse.ArgumentParser) -> None:
    """`--json`: the command's result as one JSON object on stdout (`print_json`)."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def print_json(value: object) -> None:
    """`value` as one line of strict JSON on stdout: numpy scalars and arrays as numbers and
    lists, paths as text, a NaN or infinity as null (which JSON has no word for)."""
    import json
    import math
    from pathlib import PurePath

    import numpy as np

    def plain(item: object) -> object:
        if isinstance(item, dict):
            return {str(key): plain(inner) for key, inner in item.items()}
        if isinstance(item, (list, tuple)):
            return [plain(inner) for inner in item]
        if isinstance(item, np.ndarray):
            return plain(item.tolist())
        if isinstance(item, np.generic):
            return plain(item.item())
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, PurePath):
            return str(item)
        return item

    print(json.dumps(plain(value), allow_nan=False))


def data_inputs(data: str | None, splits: list[str] | tuple[str, ...], label: str = "--data") -> list[tuple[str, str]]:
    """The data folder `data`, the files of `splits` in it (features, captions, boxes, scenes,
    pictures) and every other file of the data set there (other splits, the vocabulary, their
    pictures: `layout.data_set_files`), labelled for `sgraf.io_paths.check_outputs`: what a
    command reading those splits must not write over."""
    from sgraf.data.layout import data_set_files, split_paths

    if not data:
        return []
    return ([(label, data)] + [(label, path) for split in splits for path in split_paths(data, split)]
            + [(label, path) for path in data_set_files(data)])


def check_score_outputs(args: argparse.Namespace) -> None:
    """`--save-sims` of `evaluate` / `diagnose`: a .npy name that is none of the command's inputs."""
    from sgraf import score_record
    from sgraf.io_paths import check_outputs, labelled, require_suffix

    require_suffix("--save-sims", args.save_sims, ".npy", "a NumPy score matrix")
    inputs = [*labelled("--checkpoint", args.checkpoint), *labelled("--sims", args.sims), ("--vocab", args.vocab),
              *data_inputs(args.data, [args.split])]
    record = None if args.save_sims is None else str(score_record.record_path(args.save_sims))
    check_outputs(inputs, [("--save-sims", args.save_sims), ("--save-sims's record", record)])
    refuse_others_files([("--save-sims", args.save_sims)])


def _index_folder(folder: object) -> bool:
    """Whether `folder` (a Path) holds a gallery index: its manifest beside its arrays."""
    return (folder / "manifest.json").is_file() and any(folder.glob("*.npy"))


def refuse_others_folder(label: str, folder: str, writes: str = "a data set") -> None:
    """A folder to write that is another command's: for a data set (`generate`, `extract`,
    `convert-tsv`) a training run's, a gallery index's or a demo's folder (their files would sit
    among the data set's, and `--overwrite` could not tell them apart); for a training run
    (`writes="a training run"`) a data set's, an index's or a demo's. InputError naming it."""
    from sgraf.data.layout import data_set_files
    from sgraf.errors import InputError
    from sgraf.io_paths import resolved
    from sgraf.output_folder import DEMO_MARKER
    from sgraf.training.runs import is_run_folder

    target = resolved(folder)
    from sgraf.data.layout import IMAGES

    for above in (target, *target.parents):    # another's folder: its pictures, an index, a run's own folders
        if above.name == IMAGES and data_set_files(above.parent):
            what = (f"the pictures folder of the precomp data set in {above.parent}" if above == target
                    else f"inside the pictures of the precomp data set in {above.parent}")
        elif above == target:       # an index, a run or a demo folder itself: said below
            continue
        elif _index_folder(above):
            what = f"inside the folder of the sgraf index {above}"
        elif is_run_folder(above) and any((above / name).is_file() for name in ("last.pt", "best.pt")):
            what = f"inside the training run folder {above}"
        else:
            continue
        raise InputError(f"{label} {folder} is {what}; {writes} written there would mix with its files: choose "
                         "another folder")
    if not target.is_dir():
        return
    run = writes == "a training run"
    ran = any((target / name).is_file() for name in ("last.pt", "best.pt", "metrics.jsonl"))
    if not run and is_run_folder(target) and ran:     # not a folder that merely holds a config.yaml
        what = "a training run folder"
    elif run and data_set_files(target):
        what = "a precomp data set's folder"
    elif _index_folder(target):
        what = "the folder of an sgraf index"
    elif (target / DEMO_MARKER).is_file():
        what = "a demo's folder (its data set is DEMO/data)"
    else:
        return
    raise InputError(f"{label} {folder} is {what}; {writes} written there would mix with its files: choose "
                     "another folder")


def refuse_others_files(outputs: list[tuple[str, str | None]]) -> None:
    """A side output (a score matrix, a picture) that would land among the files of a folder
    another sgraf command wrote, not one this command reads (those `check_outputs` refuses): a
    file of a precomp data set's layout where one is (it would replace that data set's
    features, captions or vocabulary), any file in a gallery index's folder (its manifest would
    no longer match), a run folder's own files. InputError naming the folder."""
    import os
    from pathlib import Path

    from sgraf.data.layout import IMAGES, data_set_family, data_set_files
    from sgraf.errors import InputError
    from sgraf.io_paths import resolved
    from sgraf.output_folder import read_record
    from sgraf.training.runs import run_folder_of

    for label, path in outputs:
        if path is None:
            continue
        target = resolved(path)
        folder = target.parent
        written_by = read_record(folder).get(target.name)
        if _index_folder(folder):
            what = f"in the folder of the sgraf index {folder}"
        elif data_set_family(target.name) and data_set_files(folder):
            what = f"a file name of the precomp data set in {folder}"
        elif folder.parent.name == IMAGES and data_set_files(folder.parent.parent):
            what = f"in the pictures of the precomp data set in {folder.parent.parent}"
        elif run_folder_of(target) is not None:
            what = f"a file of the run folder {folder}"
        elif written_by is not None:    # a demo's report and pictures among them
            what = f"a file sgraf {written_by} wrote in {folder}"
        else:
            continue
        raise InputError(f"{label} {os.fspath(path)} is {what}; an output must not write among another command's "
                         f"files: choose another path (e.g. {Path(os.fspath(path)).name} in another folder)")
