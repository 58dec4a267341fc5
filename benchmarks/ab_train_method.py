"""One method of `SGRAF` timed against an earlier version of it, in one process, by training steps.

A change of a few per cent to a training step is below what separate processes can resolve on a
shared machine (`bench_train.py --against` runs each configuration in a process of its own). This
takes the earlier version of one method of `sgraf.model.sgraf.SGRAF` from another checkout's
`src/sgraf/model/sgraf.py` (compiled into this tree's module namespace, so the method must need
nothing the module no longer has), builds two copies of the paper-size model of `bench_train.py`
on the same batch, and steps them in turn, the method switched before each step, the order
alternating per round: the ratio per round (earlier seconds / this tree's) and its median.
The first losses of both are printed (a forward-only change must keep them equal).

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab_train_method.py /tmp/before --module saf --precision bf16 --rounds 8
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path


def earlier_method(checkout: Path, name: str, namespace: dict) -> object:
    """`SGRAF.<name>` as `checkout`'s model file defines it, compiled in `namespace`."""
    source = (checkout / "src" / "sgraf" / "model" / "sgraf.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SGRAF")
    function = next((node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name), None)
    if function is None:
        raise SystemExit(f"{checkout} has no SGRAF.{name}")
    scope = dict(namespace)
    exec(textwrap.dedent(ast.get_source_segment(source, function)), scope)   # noqa: S102 (our own checkout)
    return scope[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--method", default="_train_block_scores")
    parser.add_argument("--module", choices=["sgr", "saf"], default="saf")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="feature sizes divided by this (a quick check)")
    args = parser.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train import setup, make_step

    import sgraf.model.sgraf as model_module
    from sgraf.kernels.memory import keep_freed_memory
    from sgraf.kernels.tuning import cpu_model

    if not callable(getattr(model_module.SGRAF, args.method, None)):
        raise SystemExit(f"this tree has no SGRAF.{args.method}")
    versions = {"this": getattr(model_module.SGRAF, args.method),
                "earlier": earlier_method(args.checkout, args.method, vars(model_module))}
    keep_freed_memory()
    model, batch = setup(args.module, args.batch, args.threads, scale=args.scale)
    steps = {name: make_step(model, batch, args.module, "ours", args.precision) for name in versions}
    print(f"{cpu_model()}, {args.threads} threads: SGRAF.{args.method} of this tree against {args.checkout}'s, "
          f"{args.module} {args.precision}, batch {args.batch}, one warm-up and {args.rounds} timed rounds",
          flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in versions}
    for round_ in range(args.rounds + 1):
        for name in (("this", "earlier") if round_ % 2 else ("earlier", "this")):
            setattr(model_module.SGRAF, args.method, versions[name])
            start = time.perf_counter()
            loss = steps[name]()
            elapsed = time.perf_counter() - start
            if round_:
                seconds[name].append(elapsed)
            else:
                print(f"{name}: first loss {loss:.4f}", flush=True)
    setattr(model_module.SGRAF, args.method, versions["this"])
    ratios = [before / now for before, now in zip(seconds["earlier"], seconds["this"])]
    print("medians: " + ", ".join(f"{name} {statistics.median(s):.3f} s" for name, s in seconds.items()))
    print(f"this tree {statistics.median(ratios):.3f}x the earlier one's speed (median of the rounds' ratios: "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
