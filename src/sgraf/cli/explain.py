"""`sgraf explain`: a PNG of what the model attends to for one image and one caption."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from sgraf.cli.arguments import (DEVICE_HELP, ENSEMBLE_OF_MODELS, data_inputs, device, non_negative_int,
                                 print_json, refuse_others_files, split_name, utf8_text)

if TYPE_CHECKING:
    from sgraf.explain import Explanation


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="draw SAF weights, SGR alignment and word attention for an image and a caption",
        description="For one image of a split and one caption: SAF's weight on each alignment, SGR's "
                    "final-vs-raw alignment per word and each word's attention over the image.")
    parser.add_argument("--checkpoint", action="extend", nargs="+", required=True, metavar="CKPT",
                        help="model checkpoint; several (or --checkpoint repeated) for an ensemble (e.g. SGR and SAF)")
    parser.add_argument("--data", required=True, metavar="DIR", help="precomp data folder")
    parser.add_argument("--split", type=split_name, default="test", help="split holding the image")
    parser.add_argument("--image-id", required=True, type=non_negative_int, metavar="N",
                        help="image index in the split")
    parser.add_argument("--text", required=True, type=utf8_text, help="the caption to explain")
    parser.add_argument("--out", required=True, metavar="FILE.png", help="PNG to write")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON, for checkpoints that carry none")
    parser.add_argument("--allow-unknown", action="store_true", help="map unknown words to <unk>")
    parser.add_argument("--device", type=device, default="auto", help=f"where to compute: {DEVICE_HELP}")
    parser.add_argument("--json", action="store_true",
                        help="print the explanation's numbers as one JSON object on stdout instead of the table "
                             "(the fields of sgraf.explain.Explanation, arrays as lists, and out: the picture)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.api import Matcher
    from sgraf.data.precomp import PrecompSplit
    from sgraf.errors import InputError
    from sgraf.explain import explain_pair, region_layout, render_explanation
    from sgraf.io_paths import check_distinct, check_outputs, labelled

    check_distinct("--checkpoint", args.checkpoint, ENSEMBLE_OF_MODELS)
    if not args.out.lower().endswith(".png"):
        raise InputError(f"--out must name a .png file, got {args.out!r}")
    check_outputs([*labelled("--checkpoint", args.checkpoint), ("--vocab", args.vocab),
                   *data_inputs(args.data, [args.split]),
                   ("--data", f"{args.data}/images/{args.split}/{args.image_id:05d}.png")], [("--out", args.out)])
    refuse_others_files([("--out", args.out)])
    matcher = Matcher.load(args.checkpoint, vocab=args.vocab, device=args.device)
    split = PrecompSplit(args.data, args.split)
    if not 0 <= args.image_id < split.n_images:
        raise InputError(f"--image-id {args.image_id} is out of range: split {args.split!r} of {args.data} "
                         f"has images 0..{split.n_images - 1}")
    features = split.read_images(args.image_id, args.image_id + 1)[0]   # NaN/inf refused, naming the file
    boxes = None
    if matcher.needs_boxes:   # normalised, for the model; the picture draws the pixel boxes (region_layout)
        boxes = split.read_boxes(required=True)[args.image_id]
    explanation = explain_pair(matcher, features, args.text, allow_unknown=args.allow_unknown, boxes=boxes)
    explanation.image_id = args.image_id
    names = split.image_names()
    explanation.image_name = names[args.image_id] if names is not None else None
    layout = region_layout(args.data, args.split, args.image_id, split.num_regions)
    out = render_explanation(explanation, layout, args.out)
    if args.json:
        import dataclasses

        print_json({**dataclasses.asdict(explanation), "out": str(out), "regions": layout.source})
        return 0
    print(format_explanation(explanation))
    print(f"wrote {out} (regions: {layout.source})")
    return 0


def format_explanation(explanation: "Explanation") -> str:
    """A text table of the per-node quantities and the scores."""
    from sgraf.explain import image_label, other_place_terms, penalty_note

    lines = [f"{image_label(explanation)} / {explanation.text!r}: "
             + ", ".join(f"{k} {v:.4f}" for k, v in explanation.scores.items())]
    header = f"{'node':<14}{'SAF beta':>10}{'SGR final.raw':>15}{'top region':>12}"
    signed = explanation.place_signed
    if explanation.place is not None:
        header += f"{'place':>8}" + (f"{'signed':>8}" if signed is not None else "")
        lines[0] += (f" (place term {_signed(explanation.place.sum())}, {explanation.place_model}"
                     f"{penalty_note(explanation)}{other_place_terms(explanation)})")
    lines.append(header)
    offset = 1 if explanation.node_labels and explanation.node_labels[0] == "[global]" else 0
    for p, label in enumerate(explanation.node_labels):
        beta = f"{explanation.saf_beta[p]:.3f}" if explanation.saf_beta is not None else "-"
        sgr = _signed(explanation.sgr_alignment[p]) if explanation.sgr_alignment is not None else "-"
        region = "-"
        if explanation.attention is not None and p >= offset and p - offset < len(explanation.attention):
            weights = explanation.attention[p - offset]
            region = f"{int(weights.argmax())} ({weights.max():.2f})"
        line = f"{label:<14}{beta:>10}{sgr:>15}{region:>12}"
        if explanation.place is not None:
            word = p - offset
            line += f"{_signed(explanation.place[word]):>8}" if 0 <= word < len(explanation.place) else f"{'-':>8}"
            if signed is not None:
                line += f"{_signed(signed[word]):>8}" if 0 <= word < len(signed) else f"{'-':>8}"
        lines.append(line)
    return "\n".join(lines)


def _signed(value: float) -> str:
    """`value` to 3 decimals with its sign, a value that rounds to zero as +0.000 (not -0.000)."""
    return f"{round(float(value), 3) + 0.0:+.3f}"
