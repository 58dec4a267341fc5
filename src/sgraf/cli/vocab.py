"""`sgraf vocab build`: a vocabulary JSON (the authors' format) from a data directory's captions."""

from __future__ import annotations

import argparse
import os

from sgraf.cli.arguments import add_json, data_inputs, positive_int, print_json, refuse_others_files


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("vocab", help="build vocabularies",
                                   description="Vocabulary tools (the authors' JSON format).")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="build a vocabulary from training captions",
        description="Count tokens (lower-cased, Treebank-tokenised as the authors do) in the captions of "
                    "the given splits and keep words seen at least --min-count times.")
    build.add_argument("--data", required=True, help="data directory (precomp layout)")
    build.add_argument("--out", required=True, help="output JSON path (DATA/vocab.json: where train and data check "
                                                    "look for it; an earlier one there is replaced)")
    build.add_argument("--min-count", type=positive_int, default=4, help="minimum occurrences (authors: 4)")
    build.add_argument("--splits", action="extend", nargs="+", metavar="SPLIT",
                       help="caption files to count, repeatable; train and dev when not given (as the authors count)")
    add_json(build)
    build.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from sgraf.data.layout import split_files
    from sgraf.data.precomp import read_captions
    from sgraf.data.vocab import build_vocab
    from sgraf.errors import InputError
    from sgraf.io_paths import check_outputs

    if args.splits is None:      # extended when given, so the default is filled in here
        args.splits = ["train", "dev"]
    # the data set's own vocab.json is no input of this command: --out DATA/vocab.json rebuilds it
    own = os.path.normpath(os.path.join(args.data, "vocab.json"))
    check_outputs([(label, path) for label, path in data_inputs(args.data, args.splits)
                   if os.path.normpath(path) != own], [("--out", args.out)])
    if os.path.normpath(args.out) != own:
        refuse_others_files([("--out", args.out)])   # a run's best.pt, an index's manifest, a demo's report
    captions: list[str] = []
    used = []
    for split in args.splits:
        path = split_files(args.data, split)[1]
        if not path.is_file():
            if split == "dev" and args.splits == ["train", "dev"]:
                continue  # the default tolerates a data set without dev
            raise InputError(f"{path}: missing caption file for split {split!r}")
        captions.extend(read_captions(path))
        used.append(split)
    if not captions:
        raise InputError(f"{args.data}: no captions found for splits {', '.join(args.splits)}")
    vocab = build_vocab(captions, min_count=args.min_count)
    vocab.save(args.out)
    if args.json:
        print_json({"out": args.out, "entries": len(vocab), "captions": len(captions), "splits": used,
                    "min_count": args.min_count})
        return 0
    print(f"wrote {args.out}: {len(vocab)} entries from {len(captions)} captions ({', '.join(used)}), "
          f"min count {args.min_count}")
    return 0
