"""`sgraf serve`: a gallery index behind a web page and an HTTP API (the `serve` extra)."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import device, non_negative_int, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a gallery index: a search page and a JSON API",
        description="Load an index (sgraf index) and its models once and answer searches and explanations "
                    "over HTTP: the page at /, the API at /api/..., its reference at /docs.")
    parser.add_argument("--index", required=True, metavar="INDEX", help="index folder (sgraf index)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="port (0: any free one)")
    parser.add_argument("--checkpoint", action="append", metavar="CKPT",
                        help="the index's model(s), if their recorded paths moved (must be the same weights)")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON, for checkpoints that carry none")
    parser.add_argument("--data", metavar="DIR",
                        help="the precomp folder the index was built from, if it moved (pictures, explanations)")
    parser.add_argument("--device", type=device, default="cpu", help="where the models compute (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="autocast precision of encoding and scoring")
    parser.add_argument("--shortlist", type=positive_int, default=100, metavar="N",
                        help="first-stage candidates re-ranked by the full score per query")
    parser.add_argument("--first-stage", choices=("auto", "numpy", "faiss"), default="auto",
                        help="shortlist with FAISS (when installed) or numpy inner products")
    parser.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                        help="requests waiting for the models at most; more are answered 503")
    parser.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                        help="text searches scored together at most (1 turns batching off)")
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N",
                        help="compute threads taking requests side by side")
    parser.add_argument("--threads", type=non_negative_int, default=1, metavar="N",
                        help="torch threads inside each operation (1: a query's small operations gain little "
                             "from more, and their threads spin against other work; 0: torch's own number)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the checksum of every index file (faster start for large galleries)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.errors import InputError

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise InputError(f"sgraf serve needs FastAPI and uvicorn ({exc.name} is missing): "
                         "pip install 'sgraf[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    if args.shortlist < 1:
        raise InputError(f"--shortlist must be a positive integer, got {args.shortlist}")
    for name in ("max_queue", "max_batch", "workers"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.threads < 0:
        raise InputError(f"--threads must be 0 (torch's default) or a positive integer, got {args.threads}")

    import torch

    from sgraf.serve.app import create_app
    from sgraf.serve.service import SearchService

    if args.threads:
        torch.set_num_threads(args.threads)

    service = SearchService.open(args.index, checkpoints=args.checkpoint, vocab=args.vocab, device=args.device,
                                 precision=args.precision, shortlist=args.shortlist, verify=not args.no_verify,
                                 first_stage=args.first_stage, data_dir=args.data)
    app = create_app(service, max_queue=args.max_queue, max_batch=args.max_batch, workers=args.workers)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {args.index} ({service.index.n_images} images, {service.index.n_captions} captions) "
          f"at http://{host}:{args.port}/  (API reference: /docs; Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
