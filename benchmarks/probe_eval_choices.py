"""Whole `sgraf evaluate` runs with the CPU's measured eval choices as stored, against the same
store with the probe's fastest candidates forced: does a probe difference under the keep
threshold (`sgraf.kernels.tuning.KEEP_DEFAULT`) survive into whole runs?

A generated split (`bench_eval.build`: paper-size model, random weights) is evaluated in fp32,
A (the store as measured) and B (the fp32 thread mode and/or chunk budget set to the probe's
fastest) in turn, after one untimed run of each; medians and each round's ratio are printed.
The store is copied from the `measured ...` lines that `bench_eval.py` prints (its own split must
be large enough to measure, `sgraf.model.blocks.TUNE_MIN_PAIRS`); a split under that size then
reads the stored choices without measuring.

    python benchmarks/bench_eval.py --module sgr > eval.txt
    python benchmarks/probe_eval_choices.py eval.txt --images 500 --rounds 3
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import bench_eval


def stored_choices(printed: Path) -> dict:
    """The tuning store (`sgraf.kernels.tuning`) that `bench_eval.py`'s `measured KEY: CHOICE
    (CANDIDATE MS, ...)` lines describe."""
    store = {}
    for line in printed.read_text().splitlines():
        found = re.match(r"measured (.*): (.*) \((.*)\)$", line.strip())
        if not found:
            continue
        key, choice, times = found.groups()
        seconds = {}
        for part in times.split(", "):
            candidate, milliseconds, _ = part.rsplit(" ", 2)
            value = ast.literal_eval(candidate) if candidate[0] in "'\"" or candidate.isdigit() else candidate
            seconds[json.dumps(value)] = float(milliseconds) / 1e3
        store[key] = {"choice": ast.literal_eval(choice), "seconds": seconds, "measured": "copied"}
    return store


def forced(store: dict, what: str) -> dict:
    """`store` with the fp32 thread mode and/or chunk budget set to the probe's fastest candidate."""
    out = {}
    for key, entry in store.items():
        entry = dict(entry)
        fastest = json.loads(min(entry["seconds"], key=entry["seconds"].get))
        if ("cpu scoring threads|fp32" in key and what in ("both", "threads")) or \
                ("eval chunk bytes|torch.float32" in key and what in ("both", "chunk")):
            entry["choice"] = fastest
        out[key] = entry
    return out


def evaluate(work: Path, cache: Path) -> float:
    """Seconds of one whole `sgraf evaluate` (fp32) with `cache` as its store."""
    argv = [sys.executable, "-m", "sgraf", "evaluate", "--checkpoint", str(work / "model.pt"), "--data",
            str(work / "data"), "--split", "test", "--precision", "fp32", "--json", "--quiet",
            "--save-sims", str(cache / "sims.npy")]
    start = time.perf_counter()
    done = subprocess.run(argv, env=dict(os.environ, SGRAF_CACHE_DIR=str(cache)), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("printed", type=Path, help="bench_eval.py's output, with its 'measured' lines")
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--module", default="sgr", choices=["sgr", "saf"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--force", default="both", choices=["both", "threads", "chunk"])
    args = parser.parse_args()
    store = stored_choices(args.printed)
    other = forced(store, args.force)
    changed = [key for key in store if store[key]["choice"] != other[key]["choice"]]
    if not changed:
        raise SystemExit(f"{args.printed}: the probe's fastest is already the stored choice; nothing to force")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        bench_eval.build(work, args.images, args.module, 0)
        caches = {"A": work / "A", "B": work / "B"}
        for label, store_of in (("A", store), ("B", other)):
            caches[label].mkdir()
            (caches[label] / "tuning.json").write_text(json.dumps(store_of))
        for key in changed:
            print(f"B: {key} -> {other[key]['choice']!r} (A: {store[key]['choice']!r}; probe {store[key]['seconds']})")
        print(f"untimed first runs: A {evaluate(work, caches['A']):.1f} s, B {evaluate(work, caches['B']):.1f} s",
              flush=True)
        walls: dict[str, list[float]] = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                walls[label].append(evaluate(work, caches[label]))
                print(f"{label} {walls[label][-1]:.1f} s", flush=True)
        same = np.array_equal(np.load(caches["A"] / "sims.npy"), np.load(caches["B"] / "sims.npy"))
    ratio = statistics.median(walls["A"]) / statistics.median(walls["B"])
    rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(walls["A"], walls["B"]))
    print(f"{args.images} images, {args.module} fp32: A median {statistics.median(walls['A']):.1f} s, B median "
          f"{statistics.median(walls['B']):.1f} s -> B {ratio:.3f}x A's speed (per round {rounds}); "
          f"the same matrix: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
