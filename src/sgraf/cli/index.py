"""`sgraf index`: encode a split's images and captions into a gallery index on disk."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import (DEVICE_HELP, ENSEMBLE_OF_MODELS, add_json, data_inputs, device, positive_int,
                                 print_json, split_name)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "index", help="build a searchable gallery index of a split",
        description="Encode the images and captions of a precomp split with one model or an ensemble "
                    "(repeat --checkpoint) and write them, memory-mappable, to an index folder. A model with "
                    "positions reads the split's region boxes (SPLIT_boxes.npy with SPLIT_image_sizes.npy), "
                    "which the index keeps beside the regions.")
    parser.add_argument("--checkpoint", action="extend", nargs="+", required=True, metavar="CKPT",
                        help="model checkpoint (ours or the authors' .pth.tar); several (or --checkpoint repeated) "
                             "for an ensemble")
    parser.add_argument("--data", required=True, metavar="DIR", help="precomp data folder")
    parser.add_argument("--split", type=split_name, default="test", help="split to index")
    parser.add_argument("--out", required=True, metavar="INDEX", help="index folder to write")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON, for checkpoints that carry none")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="storage of the embeddings: float32 (exact) or float16 (half the disk)")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="images / captions encoded per chunk")
    parser.add_argument("--device", type=device, default="auto", help=f"where to encode: {DEVICE_HELP}")
    add_json(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sgraf.api import Matcher
    from sgraf.data.precomp import PrecompSplit
    from sgraf.io_paths import check_distinct, check_outputs, labelled
    from sgraf.search import build_index

    check_distinct("--checkpoint", args.checkpoint, ENSEMBLE_OF_MODELS)
    check_outputs([*labelled("--checkpoint", args.checkpoint), ("--vocab", args.vocab),
                   *data_inputs(args.data, [args.split])], folders=[("--out", args.out)])
    matcher = Matcher.load(args.checkpoint, vocab=args.vocab, batch_size=args.batch_size, device=args.device)
    split = PrecompSplit(args.data, args.split)
    boxes = split.read_boxes(required=True) if matcher.needs_boxes else None   # one line when missing
    source = {"data_dir": str(Path(args.data).resolve()), "split": args.split}
    out = build_index(matcher, split.images, split.captions, args.out, caps_per_image=split.caps_per_image,
                      source=source, dtype=args.dtype, batch_size=args.batch_size, progress=not args.quiet,
                      boxes=boxes, image_names=split.image_names())
    if args.json:
        print_json({"out": str(out), "images": split.n_images, "captions": split.n_captions, "data": args.data,
                    "split": args.split, "models": len(args.checkpoint), "dtype": args.dtype})
        return 0
    print(f"indexed {split.n_images} images and {split.n_captions} captions of {args.data} [{args.split}] "
          f"with {len(args.checkpoint)} model(s) into {out}")
    return 0
