"""`sgraf extract`: a folder of images + captions -> precomp features through a pretrained CNN."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import DEVICE_HELP, add_json, device, int_in, positive_int, print_json, split_name


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract", help="CNN grid features for a folder of images (needs sgraf[vision])",
        description="Run each image of --images (named in --captions, lines 'file_name<TAB>caption') through "
                    "a pretrained backbone and write OUT/SPLIT_ims.npy (n, regions, dim), OUT/SPLIT_caps.txt, "
                    "OUT/SPLIT_image_names.txt, OUT/SPLIT_boxes.npy (each region's grid cell: x1, y1, x2, y2 in "
                    "pixels of its picture) and OUT/SPLIT_image_sizes.npy (width, height). EfficientNet-Lite0 at "
                    "192 px gives 6 x 6 = 36 regions of 1280-d.")
    parser.add_argument("--images", required=True, help="folder of images")
    parser.add_argument("--captions", required=True, help="captions file: 'file_name<TAB>caption' per line")
    parser.add_argument("--out", required=True, help="output data directory")
    parser.add_argument("--split", type=split_name, default="train", help="split name")
    parser.add_argument("--backbone", default="efficientnet-lite0", help="backbone name")
    parser.add_argument("--weights", help="weights file (default: the one installed with the backbone)")
    parser.add_argument("--image-size", type=int_in(16, 4096), default=192, help="input side in pixels")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per forward pass")
    parser.add_argument("--device", type=device, default="auto", help=f"where to run the backbone: {DEVICE_HELP}")
    parser.add_argument("--no-pictures", action="store_true",
                        help="do not keep the pictures in OUT/images/SPLIT/ (by default each is kept there, a copy "
                             "or upright RGB, so that search, serve and explain show it)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the split's files the folder already holds; those an earlier sgraf run wrote and "
                             "this one does not (image ids, pictures, ...) are removed, so no stale companion "
                             "stays beside the new features; files sgraf did not write are never deleted or "
                             "replaced (the command refuses and names them)")
    add_json(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.data.features import extract_folder, get_backbone

    from sgraf.cli.arguments import refuse_others_folder

    refuse_others_folder("--out", args.out)
    backbone = get_backbone(args.backbone, weights_path=args.weights, image_size=args.image_size).to(args.device)
    info = extract_folder(args.images, args.captions, args.out, args.split, backbone, batch_size=args.batch_size,
                          overwrite=args.overwrite, keep_pictures=not args.no_pictures)
    if args.json:
        print_json({"out": args.out, "split": args.split, **info})
        return 0
    print(f"wrote {args.out}/{args.split}_ims.npy: {info['images']} images x {info['regions']} regions x "
          f"{info['feature_dim']}; {info['captions']} captions")
    return 0
