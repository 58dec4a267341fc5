"""`sgraf serve`: a gallery index behind a web page and an HTTP API (the `serve` extra)."""

from __future__ import annotations

import argparse
import socket
from typing import Any

from sgraf.cli.arguments import DEVICE_HELP, device, int_in, non_negative_int, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a gallery index: a search page and a JSON API",
        description="Load an index (sgraf index) and its models once and answer searches and explanations "
                    "over HTTP: the page at /, the API at /api/..., its reference at /docs.")
    parser.add_argument("--index", required=True, metavar="INDEX", help="index folder (sgraf index)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="port (0: any free one)")
    parser.add_argument("--checkpoint", action="extend", nargs="+", metavar="CKPT",
                        help="the index's model(s), if their recorded paths moved (must be the same weights)")
    parser.add_argument("--vocab", metavar="JSON", help="vocabulary JSON, for checkpoints that carry none")
    parser.add_argument("--data", metavar="DIR",
                        help="the precomp folder the index was built from, if it moved (pictures, explanations)")
    parser.add_argument("--device", type=device, default="auto", help=f"where the models compute: {DEVICE_HELP}")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="autocast precision of encoding and scoring")
    parser.add_argument("--shortlist", type=non_negative_int, default=100, metavar="N",
                        help="candidates re-ranked by the full score per query (at least top_k); 0 scores the "
                             "whole gallery (as sgraf search --shortlist)")
    parser.add_argument("--first-stage", choices=("auto", "numpy", "faiss"), default="auto",
                        help="shortlist with FAISS (when installed) or numpy inner products")
    parser.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                        help="requests waiting for the models at most; more are answered 503")
    parser.add_argument("--max-per-client", type=positive_int, default=None, metavar="N",
                        help="requests one client address may have waiting at most; more are answered 429 "
                             "(default: a quarter of --max-queue, at least 1)")
    parser.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                        help="text searches scored together at most (1 turns batching off)")
    parser.add_argument("--workers", type=int_in(1, 64), default=1, metavar="N",
                        help="compute threads taking requests side by side")
    parser.add_argument("--threads", type=non_negative_int, default=1, metavar="N",
                        help="torch threads inside each operation (1: a query's small operations gain little "
                             "from more, and their threads spin against other work; 0: torch's own number)")
    parser.add_argument("--memory-map", action="store_true",
                        help="map the index instead of reading it into memory, for a gallery larger than the "
                             "memory (files copied over the index while serving then change answers or end the server)")
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
    for name in ("max_queue", "max_batch", "workers"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.max_per_client is not None and args.max_per_client < 1:
        raise InputError(f"--max-per-client must be a positive integer, got {args.max_per_client}")
    if args.threads < 0:
        raise InputError(f"--threads must be 0 (torch's default) or a positive integer, got {args.threads}")

    import torch

    from sgraf.serve.app import SECURITY_HEADERS, create_app
    from sgraf.serve.connections import guarded_protocol, raise_descriptor_limit
    from sgraf.serve.service import SearchService
    from sgraf.signals import Stopped

    if args.threads:
        torch.set_num_threads(args.threads)

    # a busy port or a bad address: one line before the index and the models load (seconds); the port
    # is held from here, and listened on once the server can answer
    listening = bind(args.host, args.port)
    try:
        service = SearchService.open(args.index, checkpoints=args.checkpoint, vocab=args.vocab, device=args.device,
                                     precision=args.precision, shortlist=args.shortlist, verify=not args.no_verify,
                                     memory_map=args.memory_map, first_stage=args.first_stage, data_dir=args.data)
        raise_descriptor_limit()
        service.warm_up()   # the first request's one-time work (tokenizer, first stage, kernels) before announcing
        try:
            listening.listen(2048)
        except OSError as exc:        # another socket bound with SO_REUSEADDR began listening meanwhile
            raise InputError(f"--port {args.port}: the port is already in use on {args.host} ({exc.strerror}); "
                             "choose another --port") from None
    except BaseException:
        listening.close()
        raise
    port = listening.getsockname()[1]
    app = create_app(service, max_queue=args.max_queue, max_batch=args.max_batch, workers=args.workers,
                     max_per_client=args.max_per_client)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {args.index} ({service.index.n_images} images, {service.index.n_captions} captions) "
          f"at http://{host}:{port}/  (API reference: /docs; Ctrl-C stops)", flush=True)
    server = _server_class(uvicorn)(uvicorn.Config(app, log_level="warning", access_log=False,
                                                   timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5,
                                                   http=guarded_protocol(SECURITY_HEADERS), backlog=128))
    try:
        server.run(sockets=[listening])
        return server.exit_code()
    except (Stopped, KeyboardInterrupt) as stop:
        if app.state.worker.computing:
            _exit_now(stop)
        raise
    finally:
        listening.close()


def _exit_now(stop: BaseException) -> None:
    """End the process now, with the line and code `sgraf.cli.main` gives a signal: a compute
    thread is still inside a job that outlived the grace period, and letting the interpreter
    finalise under a thread running torch aborts the process ("terminate called ...")."""
    import os
    import sys

    from sgraf.signals import Stopped

    if isinstance(stop, Stopped):
        print(f"sgraf serve: {stop}", file=sys.stderr)
        code = stop.exit_code
    else:
        print("sgraf serve: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


SHUTDOWN_GRACE_S = 3   # once a signal came, the requests being computed get this long, then 503


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (not yet listening), or an `InputError` in one line
    saying why not."""
    import errno

    from sgraf.errors import InputError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise InputError(f"--host {host}: not an address or a known host name ({reason})") from None
    listening = socket.socket(family, kind, proto)
    try:
        if hasattr(socket, "SO_EXCLUSIVEADDRUSE"):   # Windows: SO_REUSEADDR there lets a second server share the port
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        else:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except OSError as exc:
        listening.close()
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"--port {port}: the port is already in use on {host} (another server?); "
                             "choose another --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise InputError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
        if exc.errno == errno.EACCES:
            raise InputError(f"--port {port}: permission denied (ports below 1024 need privileges)") from None
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listening.set_inheritable(True)
    return listening


def _server_class(uvicorn: Any) -> type:
    """uvicorn's server, with the shutdown `sgraf serve` promises: on SIGTERM or Ctrl-C the
    requests still queued are refused at once (503), the ones being computed finish, and the
    command ends like every other: one line, exit 143 or 130."""
    import asyncio
    import signal

    from sgraf.serve.connections import quiet_accept_errors
    from sgraf.signals import Stopped

    class Server(uvicorn.Server):
        signum: int | None = None

        async def startup(self, sockets: list | None = None) -> None:
            quiet_accept_errors(asyncio.get_running_loop())   # no traceback per accept without descriptors
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: object) -> None:
            self.signum = self.signum or sig
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list | None = None) -> None:
            worker = getattr(getattr(self.config.app, "state", None), "worker", None)
            if worker is not None:
                worker.close()                  # the queued requests are answered 503 now
                asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, worker.abandon)
            await super().shutdown(sockets)

        def exit_code(self) -> int:
            # uvicorn raises the signal again once it has stopped; where that did not end the
            # command (SIGINT ignored, as in a background job), end it here the same way
            if self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            if self.signum is not None:
                raise Stopped(self.signum)
            return 0

    return Server
