"""`sgraf serve` under a bounded load: throughput, latency percentiles, errors, memory.

Builds (or, with --workdir, reuses) a generated gallery (default 100,000 images of 36 random
128-d regions, 1,000 captions) indexed by a randomly initialised SGR + SAF ensemble (embed 64,
float16 index: the gallery of `bench_search.py`), saves the two models as checkpoints, starts
`sgraf serve` on it as a separate process on 127.0.0.1, then:

1. one client alone sends --single requests one after the other (latency without queueing);
2. --concurrency clients (threads, each with its own keep-alive connection) send --requests
   requests in all, as fast as they are answered.

Queries are random 6-13 word texts over the gallery's vocabulary (each different). It prints
throughput, p50/p95/p99 latency as the client sees it, errors (non-200 answers, must be 0), the
server's RSS (and its anonymous part) before and after, and how the server batched. Each
--server value is one server run with those extra `sgraf serve` options (e.g. "--max-batch 1"
turns batching off, "--threads 2" two torch threads per operation, "--workers 2" two compute
threads).

    python benchmarks/bench_serve.py --workdir /tmp/serve-bench          # 100,000 images, 1,000 requests
    python benchmarks/bench_serve.py --gallery 20000 --requests 300 --server "" "--max-batch 1"

Everything runs on this machine (127.0.0.1), clients included: they share its cores.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_search import RandomFeatures  # noqa: E402  (the same generated gallery)

from sgraf.api import Matcher  # noqa: E402
from sgraf.checkpoint import save_model  # noqa: E402
from sgraf.search import build_index  # noqa: E402

WORDS = ("a red blue green yellow square circle triangle diamond cross small large left right of the "
         "above below and there is are two three picture with on in").split()


def build_gallery(workdir: Path, n_images: int, n_captions: int, embed: int) -> Path:
    """The index folder, built unless an index of this size is already there."""
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    index_dir = workdir / f"gallery-{n_images}-e{embed}"
    manifest = index_dir / "manifest.json"
    if manifest.is_file():
        recorded = json.loads(manifest.read_text())
        if recorded["n_images"] == n_images and all(Path(m["source"]).is_file() for m in recorded["models"]):
            print(f"reusing {index_dir}")
            return index_dir
    vocab = Vocabulary.from_words(WORDS)
    paths = []
    for seed, module in enumerate(("sgr", "saf")):
        torch.manual_seed(seed)
        model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=128, word_dim=32, embed_size=embed,
                                  sim_dim=embed // 2, module=module))
        path = workdir / f"{module}-e{embed}.pt"
        save_model(model, path, vocab=vocab)
        paths.append(path)
    matcher = Matcher.load(paths, batch_size=512)
    rng = np.random.default_rng(1)
    captions = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))) for _ in range(n_captions)]
    tic = time.perf_counter()
    build_index(matcher, RandomFeatures(n_images, 36, 128), captions, index_dir, dtype="float16", batch_size=1024)
    print(f"built {index_dir} in {time.perf_counter() - tic:.0f} s")
    return index_dir


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _memory(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024.0   # MiB
    return fields


class Client:
    """One keep-alive connection to the server."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def search(self, text: str, top_k: int = 10) -> tuple[int, float, bytes]:
        path = f"/api/search?text={text.replace(' ', '+')}&top_k={top_k}"
        tic = time.perf_counter()
        self.connection.request("GET", path)
        response = self.connection.getresponse()
        body = response.read()
        return response.status, time.perf_counter() - tic, body

    def get(self, path: str) -> dict:
        self.connection.request("GET", path)
        return json.loads(self.connection.getresponse().read())

    def close(self) -> None:
        self.connection.close()


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000.0
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max())}


def run_load(port: int, queries: list[str], concurrency: int) -> dict[str, object]:
    """`concurrency` threads take the queries in turn until none is left."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    position = iter(range(len(queries)))

    def client_loop() -> None:
        client = Client(port)
        try:
            while True:
                with lock:
                    q = next(position, None)
                if q is None:
                    return
                try:
                    status, seconds, _ = client.search(queries[q])
                except (OSError, http.client.HTTPException):
                    status, seconds = -1, 0.0
                    client.close()
                    client = Client(port)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    if status == 200:
                        latencies.append(seconds)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    tic = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - tic
    return {"wall": wall, "throughput": statuses.get(200, 0) / wall, "statuses": statuses,
            "errors": sum(n for s, n in statuses.items() if s != 200), **_percentiles(latencies or [0.0])}


def bench(index_dir: Path, args: argparse.Namespace, options: str) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "sgraf", "serve", "--index", str(index_dir), "--host", "127.0.0.1",
               "--port", str(port), "--shortlist", str(args.shortlist), "--max-queue", str(args.max_queue),
               "--no-verify", "--first-stage", args.first_stage, *shlex.split(options)]
    tic = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = None
        while client is None:
            if server.poll() is not None:
                raise SystemExit(f"sgraf serve exited: {server.stdout.read()}")
            try:
                client = Client(port)
                health = client.get("/api/health")
            except OSError:
                client = None
                time.sleep(0.2)
        started = time.perf_counter() - tic
        rng = np.random.default_rng(7)
        make = lambda n: [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))) for _ in range(n)]  # noqa: E731
        for text in make(args.warmup):
            client.search(text)
        before = _memory(server.pid)
        single = [client.search(text) for text in make(args.single)]
        single_ok = [s for status, s, _ in single if status == 200]
        client.close()       # idle through the load: the server may have closed it (keep-alive timeout)
        load = run_load(port, make(args.requests), args.concurrency)
        after = _memory(server.pid)
        client = Client(port)
        queue = client.get("/api/health")["queue"]
        client.close()
    finally:
        server.terminate()
        server.wait(30)
    one = _percentiles(single_ok)
    print(f"\n## sgraf serve {options or '(defaults)'}: {health['gallery']['images']:,} images, shortlist "
          f"{args.shortlist}, max batch {queue['max_batch']}, workers {queue['workers']}, torch threads "
          f"{health['torch_threads']}, first stage {health['first_stage']}, {os.cpu_count()} CPUs (server up in "
          f"{started:.1f} s)\n")
    print("| phase | requests | throughput | p50 | p95 | p99 | errors |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 client | {len(single)} | {len(single_ok) / max(sum(single_ok), 1e-9):.1f} q/s | {one['p50']:.0f} ms | "
          f"{one['p95']:.0f} ms | {one['p99']:.0f} ms | {len(single) - len(single_ok)} |")
    print(f"| {args.concurrency} clients | {args.requests} | {load['throughput']:.1f} q/s | {load['p50']:.0f} ms | "
          f"{load['p95']:.0f} ms | {load['p99']:.0f} ms | {load['errors']} |")
    print(f"\nanswers by status: {load['statuses']}; server RSS before the load {before['VmRSS']:.0f} MiB "
          f"(anonymous {before['RssAnon']:.0f}), after {after['VmRSS']:.0f} MiB (anonymous {after['RssAnon']:.0f}); "
          f"batches {queue['batches']} for {queue['batched_texts']} texts "
          f"(mean {queue['batched_texts'] / max(queue['batches'], 1):.1f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gallery", type=int, default=100_000, help="images in the generated gallery")
    parser.add_argument("--captions", type=int, default=1000, help="captions in the gallery")
    parser.add_argument("--embed", type=int, default=64, help="embed size of the models")
    parser.add_argument("--requests", type=int, default=1000, help="requests of the concurrent phase")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    parser.add_argument("--single", type=int, default=100, help="requests of the one-client phase")
    parser.add_argument("--warmup", type=int, default=20, help="requests before measuring")
    parser.add_argument("--shortlist", type=int, default=50)
    parser.add_argument("--server", nargs="+", default=[""], metavar="OPTIONS",
                        help='extra `sgraf serve` options, one server run per value (default: "", its defaults)')
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--first-stage", choices=("auto", "numpy", "faiss"), default="auto")
    parser.add_argument("--workdir", type=Path, help="where to keep the gallery between runs (default: temp, removed)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sgraf-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        index_dir = build_gallery(workdir, args.gallery, args.captions, args.embed)
        for options in args.server:
            bench(index_dir, args, options)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
