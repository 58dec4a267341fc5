"""`sgraf search`: query an index, text -> images or image -> captions."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import DEVICE_HELP, device, non_negative_int, positive_int, utf8_text


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "search", help="search a gallery index (text -> images, image -> captions)",
        description="Two-stage search: the global vectors shortlist candidates, the full SGRAF "
                    "score re-ranks them. Ids are image / caption indices in the split's order. Each hit "
                    "shows its score (the full score, the ensemble's mean) and coarse (the first stage's "
                    "score: the inner product of the global vectors that shortlisted it).")
    parser.add_argument("--index", required=True, metavar="INDEX", help="index folder (sgraf index)")
    query = parser.add_mutually_exclusive_group(required=True)
    query.add_argument("--text", type=utf8_text,
                       help="a text query (at most 500 characters and 64 words, as sgraf serve takes): returns images")
    query.add_argument("--image-id", type=non_negative_int, metavar="N",
                       help="an image of the index: returns captions")
    parser.add_argument("--top-k", type=positive_int, default=10, metavar="K", help="results to return")
    parser.add_argument("--shortlist", type=non_negative_int, default=100, metavar="N",
                        help="candidates re-ranked by the full score (at least --top-k: a smaller one is raised to "
                             "it); 0 scores the whole gallery")
    parser.add_argument("--json", action="store_true",
                        help='print [{"id", "score"}, ...], best first, with "name" (images of an index that records '
                             'names) or "caption" (captions)')
    parser.add_argument("--checkpoint", action="extend", nargs="+", metavar="CKPT",
                        help="the index's model(s), if their recorded paths moved (must be the same weights)")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON, for checkpoints that carry none")
    parser.add_argument("--first-stage", choices=("auto", "numpy", "faiss"), default="auto",
                        help="shortlist with FAISS (when installed) or numpy inner products")
    parser.add_argument("--allow-unknown", action="store_true",
                        help="map words unknown to the vocabulary to <unk> instead of refusing the query")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the checksum of every index file (faster for large galleries)")
    parser.add_argument("--device", type=device, default="auto", help=f"where to encode and score: {DEVICE_HELP}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from sgraf.search import open_index, shortlist_for

    index = open_index(args.index, checkpoints=args.checkpoint, vocab=args.vocab, verify=not args.no_verify,
                       first_stage=args.first_stage, device=args.device)
    shortlist = shortlist_for(args.shortlist, args.top_k)
    if args.text is not None:
        hits = index.search_text(args.text, top_k=args.top_k, shortlist=shortlist,
                                 allow_unknown=args.allow_unknown)
        kind = "image"
    else:
        hits = index.search_image(image_id=args.image_id, top_k=args.top_k, shortlist=shortlist)
        kind = "caption"
    if args.json:
        print(json.dumps([{**hit.to_dict(), **({"caption": hit.text} if kind == "caption" else {})} for hit in hits]))
        return 0
    query = repr(args.text) if args.text is not None else f"image {args.image_id}"
    if args.text is None and index.name_of(args.image_id) is not None:
        query += f" ({index.name_of(args.image_id)})"
    gallery = index.n_images if kind == "image" else index.n_captions
    stages = ("whole gallery scored" if shortlist is None or shortlist >= gallery
              else f"shortlist {shortlist} by {index.first_stage}")
    print(f"{query} -> top {len(hits)} {kind}s ({stages}, re-ranked by {len(index.matcher.models)} model(s))")
    for rank, hit in enumerate(hits, 1):
        label = f"{kind} {hit.id}" + (f" {hit.name}" if hit.name is not None else "")
        text = f"  {hit.text}" if hit.text else ""
        if kind == "image" and hit.text:
            text = f"  (first caption: {hit.text})"
        print(f"{rank:3d}. {label:<14} score {hit.score:.4f}  coarse {hit.coarse:+.3f}{text}")
    return 0
