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
server's RSS (and its anonymous part) before and after, and how the server batched. The reference,
measured in the same run once the server has stopped: the same searches in this process through
the library (`open_index(..., in_memory=True)`, the server's first stage and torch threads), one
text at a time for phase 1 and in the server's largest batches (`search_texts`) for phase 2; the
ratio served / in-process is what HTTP, JSON and the queue leave of the library's speed. Each
--server value is one server run with those extra `sgraf serve` options (e.g. "--max-batch 1"
turns batching off, "--threads 2" two torch threads per operation, "--workers 2" two compute
threads).

    python benchmarks/bench_serve.py --workdir /tmp/serve-bench          # 100,000 images, 1,000 requests
    python benchmarks/bench_serve.py --gallery 20000 --requests 300 --server "" "--max-batch 1"

With --heavy, a second server runs over a gallery with region features on disk (--heavy-gallery
images, 5 captions each; explanations need the features) and is put under heavy work:

3. --heavy-clients clients keep asking for `/api/explain.png` of the longest text allowed (64
   words: the most a request may cost) while one client sends --heavy-searches searches one after
   the other: their p50/p99 say whether searches still answer while explanations keep the worker
   busy (the worker alternates between the two kinds);
4. meanwhile --leavers clients each send an explanation request and disconnect at once: the
   server's `dropped` count and its queue afterwards say whether their work was left queued;
5. the heavy clients start again, and SIGTERM is sent: the time until the server has exited
   (queued requests are answered 503 at once, the ones being computed get 3 s).

    python benchmarks/bench_serve.py --gallery 20000 --requests 300 --heavy

With --fairness, only a fairness phase, on the explanation gallery: --fair-script threads send
explanation requests (8-word texts) from one address (a script, named by `X-Forwarded-For`, which
the server trusts from 127.0.0.1) without pause, while a second address (a visitor) sends
--fair-visits of them one after the other. It prints each address's answers by status and the
visitor's median and longest wait; with --against CHECKOUT a server from that checkout's `src`
runs the same phase in turn (--rounds times each), and the ratio of the visitor's median waits is
printed.

    git worktree add /tmp/before COMMIT
    python benchmarks/bench_serve.py --fairness --gallery 1000 --max-queue 8 --heavy-gallery 200 \
        --against /tmp/before --rounds 3

Every loop is bounded (counts, or a deadline); everything runs on this machine (127.0.0.1),
clients included: they share its cores.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import signal
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


def build_explain_gallery(workdir: Path, n_images: int, embed: int) -> Path:
    """A precomp folder (`test_ims.npy` random regions, `test_caps.txt`, 5 captions per image) and
    its index by the same two models, built unless there; explanations read its features."""
    from sgraf.data.precomp import PrecompSplit

    data, index_dir = workdir / f"explain-data-{n_images}", workdir / f"explain-gallery-{n_images}-e{embed}"
    if (index_dir / "manifest.json").is_file():
        print(f"reusing {index_dir}")
        return index_dir
    data.mkdir(parents=True, exist_ok=True)
    features = np.lib.format.open_memmap(data / "test_ims.npy", mode="w+", dtype=np.float32,
                                         shape=(n_images, 36, 128))
    source = RandomFeatures(n_images, 36, 128, seed=3)
    for start in range(0, n_images, 1024):
        features[start:start + 1024] = source[start:start + 1024]
    features.flush()
    del features
    rng = np.random.default_rng(2)
    captions = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))) for _ in range(5 * n_images)]
    (data / "test_caps.txt").write_text("\n".join(captions) + "\n")
    matcher = Matcher.load([workdir / f"{module}-e{embed}.pt" for module in ("sgr", "saf")], batch_size=512)
    split = PrecompSplit(data, "test")
    build_index(matcher, split.images, split.captions, index_dir, caps_per_image=5,
                source={"data_dir": str(data.resolve()), "split": "test"})
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


# every simulated client connects from 127.0.0.1: the server's limit per address would count them as one
# client, where they stand for many users
_ONE_ADDRESS = ["--max-per-client", str(2**31 - 1)]


def bench(index_dir: Path, args: argparse.Namespace, options: str) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "sgraf", "serve", "--index", str(index_dir), "--host", "127.0.0.1",
               "--port", str(port), "--shortlist", str(args.shortlist), "--max-queue", str(args.max_queue),
               *_ONE_ADDRESS, "--no-verify", "--first-stage", args.first_stage, *shlex.split(options)]
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
        warmup, single_texts, load_texts = make(args.warmup), make(args.single), make(args.requests)
        for text in warmup:
            client.search(text)
        before = _memory(server.pid)
        single = [client.search(text) for text in single_texts]
        single_ok = [s for status, s, _ in single if status == 200]
        client.close()       # idle through the load: the server may have closed it (keep-alive timeout)
        load = run_load(port, load_texts, args.concurrency)
        after = _memory(server.pid)
        client = Client(port)
        queue = client.get("/api/health")["queue"]
        client.close()
    finally:
        server.terminate()
        server.wait(30)
    reference = in_process(index_dir, args, health, queue["max_batch"], warmup, single_texts, load_texts)
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
    served_one = len(single_ok) / max(sum(single_ok), 1e-9)
    print(f"\nin this process through the library, the same searches after the server stopped: 1 text at a time "
          f"{reference['one']:.1f} q/s (p50 {reference['p50']:.0f} ms), in batches of up to {queue['max_batch']} "
          f"{reference['batched']:.1f} q/s; served / in-process: {served_one / reference['one']:.2f}x (1 client), "
          f"{load['throughput'] / reference['batched']:.2f}x ({args.concurrency} clients)")
    print(f"\nanswers by status: {load['statuses']}; server RSS before the load {before['VmRSS']:.0f} MiB "
          f"(anonymous {before['RssAnon']:.0f}), after {after['VmRSS']:.0f} MiB (anonymous {after['RssAnon']:.0f}); "
          f"batches {queue['batches']} for {queue['batched_texts']} texts "
          f"(mean {queue['batched_texts'] / max(queue['batches'], 1):.1f})")


def in_process(index_dir: Path, args: argparse.Namespace, health: dict, max_batch: int, warmup: list[str],
               single: list[str], load: list[str]) -> dict[str, float]:
    """The reference: the server's searches through the library in this process (its first stage
    and torch threads, the index in memory as `sgraf serve` reads it): q/s and p50 one text at a
    time, and q/s of the load's texts in batches of the server's largest."""
    from sgraf.search import open_index

    threads = torch.get_num_threads()
    torch.set_num_threads(int(health["torch_threads"]))
    try:
        index = open_index(index_dir, verify=False, first_stage=health["first_stage"], in_memory=True)
        for text in warmup:
            index.search_text(text, top_k=10, shortlist=args.shortlist)
        seconds = []
        for text in single:
            tic = time.perf_counter()
            index.search_text(text, top_k=10, shortlist=args.shortlist)
            seconds.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        for start in range(0, len(load), max_batch):
            index.search_texts(load[start:start + max_batch], top_k=10, shortlist=args.shortlist)
        batched = len(load) / (time.perf_counter() - tic)
    finally:
        torch.set_num_threads(threads)
    return {"one": len(seconds) / sum(seconds), "p50": _percentiles(seconds)["p50"], "batched": batched}


def _start(index_dir: Path, args: argparse.Namespace, options: list[str], one_address: bool = True,
           source: Path | None = None) -> tuple[subprocess.Popen, int, float]:
    """`sgraf serve` on `index_dir` (`one_address`: not limited per address; `source`: the `src`
    folder of another checkout to serve from, for `--against`)."""
    port = _free_port()
    command = [sys.executable, "-m", "sgraf", "serve", "--index", str(index_dir), "--host", "127.0.0.1",
               "--port", str(port), "--shortlist", str(args.shortlist), "--max-queue", str(args.max_queue),
               *(_ONE_ADDRESS if one_address else []), "--no-verify", "--first-stage", args.first_stage, *options]
    env = None if source is None else dict(os.environ, PYTHONPATH=str(source))
    tic = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"sgraf serve exited: {server.stderr.read()}")
        try:
            client = Client(port)
            client.get("/api/health")
            client.close()
            return server, port, time.perf_counter() - tic
        except (OSError, http.client.HTTPException, ValueError):
            time.sleep(0.2)
    server.kill()
    raise SystemExit("sgraf serve did not answer within 300 s")


def _explain_path(rng: np.random.Generator, n_images: int) -> str:
    text = "+".join(rng.choice(WORDS, size=64))           # the longest text a request may have
    return f"/api/explain.png?image_id={int(rng.integers(n_images))}&text={text}"


def _heavy_clients(port: int, n: int, n_images: int, stop: threading.Event,
                   statuses: dict[object, int], lock: threading.Lock, limit: int = 10_000) -> list[threading.Thread]:
    """`n` clients asking for explanation pictures until `stop` (at most `limit` requests each)."""
    def loop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        client = Client(port)
        for _ in range(limit):
            if stop.is_set():
                break
            gone = False
            try:
                client.connection.request("GET", _explain_path(rng, n_images))
                response = client.connection.getresponse()
                response.read()
                status: object = response.status
            except (OSError, http.client.HTTPException) as error:
                status = type(error).__name__
                client.close()
                client = Client(port)
                gone = stop.is_set() or isinstance(error, ConnectionRefusedError)   # the server is gone
                time.sleep(0.05)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
            if gone:
                break
        client.close()

    threads = [threading.Thread(target=loop, args=(100 + i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    return threads


def bench_heavy(index_dir: Path, args: argparse.Namespace) -> None:
    n_images = args.heavy_gallery
    server, port, started = _start(index_dir, args, shlex.split(args.server[0]))
    rng = np.random.default_rng(11)
    try:
        client = Client(port)
        for text in [" ".join(rng.choice(WORDS, size=8)) for _ in range(args.warmup)]:
            client.search(text)
        tic = time.perf_counter()            # one explanation alone (the first also loads matplotlib)
        client.connection.request("GET", _explain_path(rng, n_images))
        client.connection.getresponse().read()
        first = time.perf_counter() - tic
        alone = []
        for _ in range(3):
            tic = time.perf_counter()
            client.connection.request("GET", _explain_path(rng, n_images))
            client.connection.getresponse().read()
            alone.append(time.perf_counter() - tic)
        client.close()

        # 3 + 4: searches and clients that leave, while explanations keep the worker busy
        stop, lock, heavy = threading.Event(), threading.Lock(), {}
        threads = _heavy_clients(port, args.heavy_clients, n_images, stop, heavy, lock)
        time.sleep(1.0)
        left = []
        def leave() -> None:
            for _ in range(args.leavers):
                with socket.create_connection(("127.0.0.1", port)) as connection:
                    connection.sendall(f"GET {_explain_path(rng, n_images)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                    time.sleep(0.05)
                left.append(1)
        leaver = threading.Thread(target=leave, daemon=True)
        leaver.start()
        searcher = Client(port)
        latencies, search_statuses, waiting_seen = [], {}, []
        for q in range(args.heavy_searches):
            status, seconds, _ = searcher.search(" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))))
            search_statuses[status] = search_statuses.get(status, 0) + 1
            if status == 200:
                latencies.append(seconds)
            if q % 10 == 0:
                waiting_seen.append(searcher.get("/api/health")["queue"]["waiting"])
        searcher.close()
        leaver.join(60)
        stop.set()
        for thread in threads:
            thread.join(120)
        deadline, queue = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            probe = Client(port)
            queue = probe.get("/api/health")["queue"]
            probe.close()
            if queue["waiting"] == 0:
                break
            time.sleep(0.2)

        # 5: shutdown under load
        stop2, lock2, last = threading.Event(), threading.Lock(), {}
        threads = _heavy_clients(port, 2 * args.heavy_clients, n_images, stop2, last, lock2)
        time.sleep(2.0)
        probe = Client(port)
        queued_at_signal = probe.get("/api/health")["queue"]["waiting"]
        probe.close()
        tic = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        shutdown = time.perf_counter() - tic
        stop2.set()
        for thread in threads:
            thread.join(30)
        stderr = server.stderr.read().strip().splitlines()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
    ms = _percentiles(latencies or [0.0])
    print(f"\n## sgraf serve under heavy work: explanation gallery of {n_images:,} images, {args.heavy_clients} "
          f"clients asking for 64-word explanation pictures, {os.cpu_count()} CPUs (server up in {started:.1f} s)\n")
    print(f"one 64-word explanation picture alone: {1000 * statistics.median(alone):.0f} ms (the first, loading "
          f"matplotlib: {1000 * first:.0f} ms)\n")
    print("| phase | requests | p50 | p95 | p99 | max | answers |")
    print("|---|---|---|---|---|---|---|")
    print(f"| searches, one after the other, while explanations run | {args.heavy_searches} | {ms['p50']:.0f} ms | "
          f"{ms['p95']:.0f} ms | {ms['p99']:.0f} ms | {ms['max']:.0f} ms | {search_statuses} |")
    print(f"\nexplanations answered meanwhile: {heavy}; queue length seen by the search client: max "
          f"{max(waiting_seen or [0])}")
    print(f"clients that sent an explanation and left: {len(left)}; jobs dropped unrun: {queue['dropped']}; "
          f"waiting once the clients stopped: {queue['waiting']}")
    print(f"SIGTERM with {queued_at_signal} requests queued and {2 * args.heavy_clients} clients asking: exit "
          f"{code} after {shutdown:.1f} s (answers: {last}); last line: {stderr[-1] if stderr else ''!r}")


def _fair_phase(index_dir: Path, args: argparse.Namespace, source: Path | None) -> dict[str, object]:
    """One server (this checkout's, or `source`'s): `--fair-script` threads from one address (a
    script) ask for explanation pictures without pause while another address (a visitor) asks for
    `--fair-visits` of them one after the other; their answers and the visitor's waits."""
    server, port, _ = _start(index_dir, args, [], one_address=False, source=source)
    n_images, lock, script, stop = args.heavy_gallery, threading.Lock(), {}, threading.Event()

    def path(rng: np.random.Generator) -> str:
        return f"/api/explain.png?image_id={int(rng.integers(n_images))}&text={'+'.join(rng.choice(WORDS, size=8))}"

    def ask(client: Client, address: str, rng: np.random.Generator) -> tuple[int, float]:
        tic = time.perf_counter()
        client.connection.request("GET", path(rng), headers={"X-Forwarded-For": address})
        response = client.connection.getresponse()
        response.read()
        return response.status, time.perf_counter() - tic

    def script_loop(seed: int) -> None:
        rng, client = np.random.default_rng(seed), Client(port)
        while not stop.is_set():
            status, _ = ask(client, "198.51.100.1", rng)
            with lock:
                script[status] = script.get(status, 0) + 1
            if status != 200:
                time.sleep(0.05)          # a refused client retries after a moment, as the page does
        client.close()

    try:
        warm = Client(port)
        ask(warm, "198.51.100.3", np.random.default_rng(0))    # matplotlib loaded before timing
        warm.close()
        threads = [threading.Thread(target=script_loop, args=(200 + i,), daemon=True) for i in range(args.fair_script)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        visitor, rng, waits, visits = Client(port), np.random.default_rng(7), [], {}
        for _ in range(args.fair_visits):
            status, seconds = ask(visitor, "198.51.100.2", rng)
            visits[status] = visits.get(status, 0) + 1
            if status == 200:
                waits.append(seconds)
            time.sleep(0.2)
        visitor.close()
        stop.set()
        for thread in threads:
            thread.join(120)
    finally:
        server.kill()
        server.wait(30)
    return {"visitor": visits, "script": script, "waits": waits}


def bench_fairness(index_dir: Path, args: argparse.Namespace) -> None:
    """`--fairness`: `_fair_phase` on this checkout's server and, with `--against`, another's, in
    turns (`--rounds`); the visitor's median wait of each and their ratio."""
    runs: dict[str, list[dict[str, object]]] = {"this checkout": [], "against": []}
    for _ in range(args.rounds):
        runs["this checkout"].append(_fair_phase(index_dir, args, None))
        if args.against is not None:
            runs["against"].append(_fair_phase(index_dir, args, args.against / "src"))
    print(f"\n## one address asking for explanation pictures in {args.fair_script} threads, another asking for "
          f"{args.fair_visits} one after the other: --max-queue {args.max_queue}, explanation gallery of "
          f"{args.heavy_gallery:,} images, {os.cpu_count()} CPUs, {args.rounds} round(s)\n")
    print("| server | visitor's answers | visitor's median wait | visitor's longest | script's answers |")
    print("|---|---|---|---|---|")
    for name, phases in runs.items():
        for phase in phases:
            waits = phase["waits"]
            shown = (f"{1000 * statistics.median(waits):.0f} ms | {1000 * max(waits):.0f} ms" if waits
                     else "never answered | -")
            print(f"| {name if name != 'against' else args.against} | {phase['visitor']} | {shown} | "
                  f"{phase['script']} |")
    answered = {name: sum(len(p["waits"]) for p in phases) for name, phases in runs.items() if phases}
    print("\nthe visitor's explanations answered: " + "; ".join(
        f"{answered[name]} of {args.fair_visits * len(runs[name])} on {name if name != 'against' else args.against}"
        for name in answered))
    if runs["against"] and all(answered.values()):
        ours, theirs = (statistics.median(w for p in runs[name] for w in p["waits"]) for name in ("this checkout",
                                                                                                 "against"))
        print(f"the visitor's median wait: {theirs / ours:.2f}x shorter on this checkout than on {args.against}")


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
    parser.add_argument("--heavy", action="store_true", help="also the heavy-work phases (3-5) on their own server")
    parser.add_argument("--heavy-only", action="store_true", help="only the heavy-work phases")
    parser.add_argument("--heavy-gallery", type=int, default=2000, help="images of the explanation gallery")
    parser.add_argument("--heavy-clients", type=int, default=4, help="clients asking for explanations")
    parser.add_argument("--heavy-searches", type=int, default=200, help="searches sent during the heavy work")
    parser.add_argument("--leavers", type=int, default=20, help="clients that send an explanation request and leave")
    parser.add_argument("--fairness", action="store_true",
                        help="only the fairness phase: a script's address and a visitor's on the explanation gallery")
    parser.add_argument("--fair-script", type=int, default=12, help="threads of the script's address")
    parser.add_argument("--fair-visits", type=int, default=10, help="the visitor's explanations, one after the other")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="with --fairness: also a server from this checkout (git worktree add DIR COMMIT)")
    parser.add_argument("--rounds", type=int, default=1, help="with --fairness: server runs per checkout, in turns")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sgraf-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.fairness:      # the search gallery's build also saves the models the explanation gallery takes
            build_gallery(workdir, args.gallery, args.captions, args.embed)
            bench_fairness(build_explain_gallery(workdir, args.heavy_gallery, args.embed), args)
            return 0
        index_dir = build_gallery(workdir, args.gallery, args.captions, args.embed)
        if not args.heavy_only:
            for options in args.server:
                bench(index_dir, args, options)
        if args.heavy or args.heavy_only:
            bench_heavy(build_explain_gallery(workdir, args.heavy_gallery, args.embed), args)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
