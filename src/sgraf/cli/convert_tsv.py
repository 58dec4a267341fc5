"""`sgraf convert-tsv`: bottom-up-attention TSV -> precomp `.npy` (+ boxes, image ids, captions)."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import add_json, print_json, split_name


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-tsv", help="convert bottom-up-attention TSV features to the precomp layout",
        description="Stream a generate_tsv file (image_id, image_w, image_h, num_boxes, base64 boxes, base64 "
                    "features) into OUT/SPLIT_ims.npy, OUT/SPLIT_boxes.npy (x1, y1, x2, y2 in pixels), "
                    "OUT/SPLIT_image_sizes.npy (image_w, image_h) and OUT/SPLIT_image_ids.txt; with --captions "
                    "(lines 'image_id<TAB>caption') also OUT/SPLIT_caps.txt in the same image order.")
    parser.add_argument("--tsv", required=True, help="input TSV file")
    parser.add_argument("--out", required=True, help="output data directory")
    parser.add_argument("--split", type=split_name, required=True, help="split name, e.g. train")
    parser.add_argument("--captions", help="captions file: 'image_id<TAB>caption' per line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the split's files the folder already holds; those an earlier sgraf run wrote and "
                             "this one does not (captions, boxes, ...) are removed, so no stale companion stays beside "
                             "the new features; files sgraf did not write are never deleted or "
                             "replaced (the command refuses and names them)")
    add_json(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.data.convert import convert_tsv

    from sgraf.cli.arguments import refuse_others_folder

    refuse_others_folder("--out", args.out)
    info = convert_tsv(args.tsv, args.out, args.split, captions_path=args.captions, progress=not args.no_progress,
                       overwrite=args.overwrite)
    if args.json:
        print_json({"out": args.out, "split": args.split, **info})
        return 0
    print(f"wrote {args.out}/{args.split}_ims.npy: {info['images']} images x {info['regions']} regions x "
          f"{info['feature_dim']}" + (f"; {info['captions']} captions" if args.captions else ""))
    return 0
