"""The host side of `sgraf evaluate`: everything a GPU does not speed up, first and later runs.

On a GPU, a Flickr30K-size `sgraf evaluate` spends most of its wall time on the host: Python's
and PyTorch's imports, the checkpoint, the captions' tokenisation (nltk's import and its rules),
the metrics and the saved matrix (issue 20: 9.8 s on an H200, of which about 1.6 s scoring).
This times exactly that part on any machine: the real command in a fresh process, started and
ended as the `sgraf` script is (`command_child.py`), on a generated split of `bench_eval.py`,
with the device's work replaced by stand-ins (the encoders return at once, the scorer returns a
random matrix of the split's shape; the features are still read and checked, the captions padded
and bucketed). Runs alternate between a cold token cache (the captions
are tokenised, as in a first evaluation of a split) and a warm one (the ids an earlier run kept,
`sgraf.data.token_cache`); the medians and their ratio are printed, and each run's time inside
the tokenisation, and the command's own breakdown of its time (`sgraf evaluate --timings`).

    python benchmarks/bench_evaluate_host.py                   # 1,000 x 5,000 (Flickr30K test)
    python benchmarks/bench_evaluate_host.py --images 5000     # MSCOCO 5K
    git worktree add /tmp/before HEAD~3 && python benchmarks/bench_evaluate_host.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(out: Path, state: str, source: str | None = None) -> dict:
    """One `sgraf evaluate` with the token cache `state`: this checkout's, or with the `src` of
    `source` first on PYTHONPATH (an earlier sgraf, which may lack --timings)."""
    from bench_eval import set_token_cache

    set_token_cache(out, state)
    report = out / "report.json"
    argv = ["evaluate", "--checkpoint", str(checkpoint_for(out, source)), "--data", str(out / "data"),
            "--split", "test", "--json", "--quiet", "--save-sims", str(out / "sims.npy")]
    argv += ["--timings"] if timed(source) else []
    env = dict(os.environ, SGRAF_CACHE_DIR=str(out / "tuning"))
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(source) / "src"), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, str(HERE / "command_child.py"), str(report), "--stand-in", "--", *argv],
                               capture_output=True, text=True, env=env, cwd=HERE)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed:\n{completed.stderr[-3000:]}")
    timings = json.loads(completed.stdout.strip().splitlines()[-1]).get("timings")
    return {"wall_s": wall, "timings": timings, **json.loads(report.read_text())}


def checkpoint_for(out: Path, source: str | None) -> Path:
    """The split's checkpoint in a format the sgraf of `source` reads: for an sgraf from before
    version 2 of the checkpoint format, a copy in version 1 (the vocabulary as a dict)."""
    if source is None:
        return out / "model.pt"
    code = (Path(source) / "src" / "sgraf" / "checkpoint.py").read_text()
    version = int(re.search(r"^VERSION = (\d+)", code, re.M).group(1))
    if version >= 2:
        return out / "model.pt"
    old = out / "model-v1.pt"
    if not old.exists():
        import torch

        raw = torch.load(out / "model.pt", weights_only=True)
        torch.save({**raw, "version": 1, "vocab": json.loads(raw["vocab"])}, old)
    return old


def timed(source: str | None) -> bool:
    """Whether the sgraf of `source` (None: this checkout's) prints `--timings`."""
    return source is None or "--timings" in (Path(source) / "src" / "sgraf" / "cli" / "evaluate.py").read_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1000, help="images (x5 captions); Flickr30K test: 1000")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, interleaved (medians)")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also time another checkout's sgraf (its src/ first on PYTHONPATH), interleaved, "
                             "e.g. a `git worktree` of an earlier commit")
    args = parser.parse_args()

    from bench_eval import build

    from sgraf.kernels.tuning import cpu_model
    from sgraf.stopwatch import format_timings

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        build(out, args.images, "sgr", 0)
        print(f"{args.images} images x {args.images * 5} captions; {cpu_model()}, cpus {os.cpu_count()}", flush=True)
        sources = {"ours": None} | ({"baseline": args.baseline} if args.baseline else {})
        runs: dict[tuple[str, str], list[dict]] = {(who, state): [] for state in ("cold", "warm") for who in sources}
        run(out, "warm")                       # the page cache holds the split and Python's files
        for _ in range(args.repeats):
            for who, state in runs:
                runs[who, state].append(run(out, state, sources[who]))
        medians = {}
        for (who, state), measured in runs.items():
            medians[who, state] = statistics.median(r["wall_s"] for r in measured)
            walls = ", ".join(f"{r['wall_s']:.2f}" for r in measured)
            label = f"token cache {state}" if who == "ours" else f"baseline ({args.baseline}), token cache {state}"
            print(f"{label}: runs {walls} s, median {medians[who, state]:.2f} s; of which tokenisation (median) "
                  f"{statistics.median(r['tokenize_s'] for r in measured):.2f} s", flush=True)
            if measured[0]["timings"]:
                stages = {name: statistics.median(r["timings"][name] for r in measured)
                          for name in measured[0]["timings"]}
                print(f"{label}: stages (median s; the device's work stood in for): {format_timings(stages)}",
                      flush=True)
        print(f"warm / cold: {medians['ours', 'cold'] / medians['ours', 'warm']:.2f}x faster, "
              f"{medians['ours', 'cold'] - medians['ours', 'warm']:.2f} s less", flush=True)
        if args.baseline:
            for state in ("cold", "warm"):
                before, now = medians["baseline", state], medians["ours", state]
                print(f"token cache {state}: ours {before / now:.2f}x the baseline's speed, {before - now:.2f} s less",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
