"""`sgraf data check`: validate a precomp split and print a summary."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from sgraf.cli.arguments import add_json, positive_int, print_json, split_name

logger = logging.getLogger("sgraf.cli.data")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="inspect precomp data",
                                   description="Tools for data in the SCAN precomp layout.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a split and print a summary",
        description="Open DIR/SPLIT_ims.npy (memory-mapped) and DIR/SPLIT_caps.txt, check shapes, counts, "
                    "UTF-8, empty lines and NaN/inf (on a sample of images unless --full-scan), and print "
                    "images, captions, captions per image, regions, feature size and the unknown-word rate. "
                    "Exit code 2 on bad input.")
    check.add_argument("--data", required=True, help="data directory")
    check.add_argument("--split", type=split_name, required=True, help="split name (train, dev, test, testall, ...)")
    check.add_argument("--vocab", help="vocabulary JSON (default: DIR/vocab.json when present)")
    check.add_argument("--full-scan", action="store_true", help="check every feature for NaN/inf")
    check.add_argument("--max-captions", type=positive_int, help="only the first N captions (the authors' dev: 5000)")
    add_json(check)
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    report = check_report(args)
    if args.json:
        print_json(report)
        return 0
    s = report
    print(f"split            {s['split']} ({args.data})")
    print(f"images           {s['images']}")
    print(f"captions         {s['captions']}")
    print(f"captions/image   {s['captions_per_image']}")
    if s["rows_per_image"] > 1:
        print(f"feature rows     one per caption (each image {s['rows_per_image']} times): one of every "
              f"{s['rows_per_image']} read")
    print(f"regions          {s['regions']}")
    print(f"feature size     {s['feature_dim']} ({s['dtype']}, {s['features_bytes'] / 2**20:.1f} MiB on disk)")
    print(f"NaN/inf check    {s['finite_check']}: none found")
    zero = s["zero_regions"]
    print(f"all-zero regions {_describe_zero(zero)}")
    print(f"region boxes     {s['boxes']['note']}")
    vocab = s["vocabulary"]
    if vocab is None:
        print("unknown words    (no vocabulary: pass --vocab)")
        return 0
    from sgraf.data.vocab import UNKNOWN_WARN_SHARE

    above = vocab["unknown_share"] > UNKNOWN_WARN_SHARE      # evaluate and index warn there too
    print(f"unknown words    {100 * vocab['unknown_share']:.2f}% of {vocab['tokens']} tokens ({vocab['path']}, "
          f"{vocab['entries']} entries)"
          + (f": above {100 * UNKNOWN_WARN_SHARE:.0f}%, is it the vocabulary of this data?" if above else ""))
    ids = s["caption_ids"]
    print(f"caption length   min {ids['min']}, mean {ids['mean']:.1f}, max {ids['max']} ids (with <start>/<end>)")
    return 0


def check_report(args: argparse.Namespace) -> dict:
    """What `sgraf data check` found, as `--json` prints it: the split's summary (`PrecompSplit.summary`),
    the data folder, the NaN/inf check done ("sampled" or "full scan"), the boxes ({"checked", "note"}),
    and with a vocabulary its path, entries, tokens, unknown tokens and their share (a fraction), and
    the captions' lengths in ids ({"min", "mean", "max"}); without one, "vocabulary" and
    "caption_ids" are null."""
    from sgraf.data.precomp import PrecompSplit
    from sgraf.data.vocab import load_vocab

    split = PrecompSplit(args.data, args.split, max_captions=args.max_captions)
    # NaN/inf and all-zero regions in one pass: a sample (every command checks what it reads
    # anyway), or every feature with --full-scan
    zero = split.check_finite(full=args.full_scan)
    split.check_caption_lengths()        # what sgraf train refuses
    boxes = split.read_boxes(required=False)   # checked against the features when the split has them
    vocab_path = Path(args.vocab) if args.vocab else Path(args.data) / "vocab.json"
    vocab = load_vocab(vocab_path) if args.vocab or vocab_path.is_file() else None
    if zero["regions"]:
        logger.warning("%s: %s; a zero region is embedded as the encoder's bias alone, and an image of zero "
                       "regions scores every caption alike: padding, or a file cut short?", split.ims_path,
                       _describe_zero(zero))
    report = {**split.summary(), "data": args.data, "finite_check": "full scan" if args.full_scan else "sampled",
              "zero_regions": zero,
              "boxes": {"checked": boxes is not None, "note": _describe_boxes(split, boxes)},
              "vocabulary": None, "caption_ids": None}
    if vocab is None:
        return report
    unknown = total = 0
    lengths = []
    for caption in split.captions:
        ids = vocab.encode(caption)[1:-1]
        unknown += sum(i == vocab.unk_id for i in ids)
        total += len(ids)
        lengths.append(len(ids) + 2)
    report["vocabulary"] = {"path": str(vocab_path), "entries": len(vocab), "tokens": total, "unknown": unknown,
                            "unknown_share": unknown / max(total, 1)}
    report["caption_ids"] = {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)}
    return report


def _describe_zero(zero: dict) -> str:
    looked = f"the {zero['looked_at']} image{'s' if zero['looked_at'] > 1 else ''} looked at"
    if not zero["regions"]:
        return f"none in {looked}"
    empty = zero["empty_images"]
    images = f"{empty} image{'' if empty == 1 else 's'}"
    return f"{zero['images']} of {looked} have some ({zero['regions']} regions; {images} all zero)"


def _describe_boxes(split: object, boxes: object) -> str:
    from sgraf.data.boxes import boxes_files

    boxes_path, sizes_path = boxes_files(split.data_dir, split.split)
    if boxes is not None:
        return f"{boxes_path.name} and {sizes_path.name}: checked, one box per region of every image"
    if boxes_path.is_file():
        return f"{boxes_path.name} without {sizes_path.name}: a model with positions refuses them"
    return "none (a model with positions needs them)"
