"""`sgraf convert-checkpoint SRC DST [--vocab JSON] [--overwrite]`: an official `.pth.tar` into our format."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import add_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-checkpoint", help="convert an official SGRAF checkpoint to the sgraf format",
        description="Read the authors' .pth.tar (three state dicts and their options; only "
                    "argparse.Namespace is unpickled) and write an sgraf checkpoint (tensors and plain "
                    "values, loadable with weights_only=True), optionally with its vocabulary.")
    parser.add_argument("src", help="official checkpoint (model_best.pth.tar) or an sgraf checkpoint")
    parser.add_argument("dst", help="output path (not a file of a run folder, index or data set)")
    parser.add_argument("--vocab", help="vocabulary JSON of the data set (e.g. f30k_precomp_vocab.json), "
                                        "stored in the checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace DST when it is an sgraf checkpoint (converting again); without it an existing "
                             "DST is refused, and any other file is refused either way")
    add_json(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.checkpoint import convert_official
    from sgraf.cli.arguments import print_json, refuse_others_files
    from sgraf.io_paths import check_outputs

    check_outputs([("SRC", args.src), ("--vocab", args.vocab)], [("DST", args.dst)])
    refuse_others_files([("DST", args.dst)])   # e.g. a run's best.pt, which sgraf runs would then misdescribe
    _refuse_replacing_other_files(args.dst, args.overwrite)

    checkpoint = convert_official(args.src, args.dst, vocab=args.vocab)
    config = checkpoint["config"]
    n_params = sum(t.numel() for name, t in checkpoint["state_dict"].items() if "running" not in name
                   and "num_batches" not in name)
    vocab = checkpoint["vocab"]
    if args.json:
        print_json({"out": args.dst, "module": config["module"], "parameters": n_params,
                    "vocab_size": config["vocab_size"], "vocabulary_words": len(vocab["word2idx"]) if vocab else None})
        return 0
    print(f"wrote {args.dst}: module {config['module']}, {n_params:,} parameters, vocab_size "
          f"{config['vocab_size']}, " + (f"vocabulary of {len(vocab['word2idx'])} words" if vocab else "no vocabulary"))
    return 0


def _refuse_replacing_other_files(dst: str, overwrite: bool) -> None:
    """DST may replace an sgraf checkpoint (converting again) with --overwrite, never another file:
    the authors' `.pth.tar` named by a slip of the arguments' order, a score matrix, anything else."""
    import os

    from sgraf.checkpoint import FORMAT
    from sgraf.errors import InputError
    from sgraf.weights_file import load_weights_only

    if not os.path.lexists(dst):
        return
    if os.path.isdir(dst):
        raise InputError(f"DST {dst} is a folder; give the checkpoint file to write "
                         f"(e.g. {os.path.join(dst, 'sgr.pt')})")
    try:
        ours = load_weights_only(dst, allowed=[argparse.Namespace]).get("format") == FORMAT
    except Exception:  # noqa: BLE001  (unreadable, not a checkpoint, a folder: not ours either way)
        ours = False
    if not ours:
        raise InputError(f"DST {dst} exists and is not an sgraf checkpoint (the authors' file? a matrix?); "
                         "convert-checkpoint replaces only its own output: choose another path")
    if not overwrite:
        raise InputError(f"DST {dst} exists (an sgraf checkpoint): pass --overwrite to replace it, or choose "
                         "another path")
