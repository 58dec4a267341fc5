"""One method of sgraf timed against an earlier version of it, in one process, by training steps.

A change of a few per cent to a training step is below what separate processes can resolve on a
shared machine (`bench_train.py --against` runs each configuration in a process of its own).
This takes the earlier version of one method (`--method FILE:CLASS.NAME`, FILE under
src/sgraf/, default `kernels/train_chunks.py:block_scores`, a training step's chunks; `FILE:NAME`
for a function of the module, replaced wherever sgraf's modules imported it) from another checkout's file
(compiled into this tree's module namespace, so the method must need nothing the module no
longer has), builds two copies of the paper-size model of `bench_train.py` on the same batch,
and steps them in turn, the method switched before each step, the order alternating per round:
the ratio per round (earlier seconds / this tree's) and its median. The first losses of both
are printed (a forward-only change must keep them equal).

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab_train_method.py /tmp/before --module saf --precision bf16 --rounds 8
    python benchmarks/ab_train_method.py /tmp/before --method kernels/nodes.py:_LowPrecisionLocalNodes.backward
    python benchmarks/ab_train_method.py /tmp/before --method model/reasoning.py:train_graph_reasoning --module sgr
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from pathlib import Path


def split_target(target: str) -> tuple[str, str, str]:
    """'model/sgraf.py:SGRAF.name' -> ('model/sgraf.py', 'SGRAF', 'name'); 'FILE:name' (a function of
    the module) -> (FILE, '', 'name')."""
    path, _, qualified = target.partition(":")
    owner, _, name = qualified.rpartition(".")
    if not (path.endswith(".py") and name):
        raise SystemExit(f"--method must read FILE:CLASS.NAME or FILE:NAME (a file under src/sgraf/), got {target!r}")
    return path, owner, name


def earlier_version(checkout: Path, path: str, owner: str, name: str, namespace: dict) -> object:
    """`<owner>.<name>` (or the module's `<name>`) as `checkout`'s src/sgraf/<path> defines it,
    compiled in `namespace`."""
    source = (checkout / "src" / "sgraf" / path).read_text(encoding="utf-8")
    body = ast.parse(source).body
    if owner:
        cls = next((node for node in body if isinstance(node, ast.ClassDef) and node.name == owner), None)
        body = [] if cls is None else cls.body
    function = next((node for node in body if isinstance(node, ast.FunctionDef) and node.name == name), None)
    if function is None:
        raise SystemExit(f"{checkout} has no {owner + '.' if owner else ''}{name} in src/sgraf/{path}")
    function.decorator_list = []          # a staticmethod's decorator is put back by the caller
    scope = dict(namespace)
    exec(compile(ast.Module([function], type_ignores=[]), path, "exec"), scope)   # noqa: S102 (our own checkout)
    return scope[name]


def holders(module: object, owner: str, name: str) -> list[object]:
    """Where the version in use is looked up: the class, or for a function of the module every
    loaded sgraf module that imported it by name (`from ... import name`)."""
    if owner:
        return [getattr(module, owner)]
    current = getattr(module, name)
    return [held for key, held in list(sys.modules.items())
            if key.startswith("sgraf") and getattr(held, name, None) is current]


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train import add_step_arguments, make_step, setup

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--method", default="kernels/train_chunks.py:block_scores", metavar="FILE:CLASS.NAME")
    parser.add_argument("--module", choices=["sgr", "saf"], default="saf")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    add_step_arguments(parser, rounds=6)
    args = parser.parse_args()

    import importlib
    import inspect

    from sgraf.kernels.memory import keep_freed_memory
    from sgraf.kernels.tuning import cpu_model

    path, owner, name = split_target(args.method)
    importlib.import_module("sgraf.model.sgraf")     # the model's modules: every holder loaded
    module = importlib.import_module("sgraf." + path[:-3].replace("/", "."))
    where = f"{owner + '.' if owner else ''}{name}"
    place = getattr(module, owner, None) if owner else module
    if not callable(getattr(place, name, None)):
        raise SystemExit(f"this tree has no {where} in src/sgraf/{path}")
    static = bool(owner) and isinstance(inspect.getattr_static(place, name), staticmethod)
    earlier = earlier_version(args.checkout, path, owner, name, vars(module))
    versions = {"this": inspect.getattr_static(place, name), "earlier": staticmethod(earlier) if static else earlier}
    targets = holders(module, owner, name)
    keep_freed_memory()
    model, batch = setup(args.module, args.batch, args.threads, scale=args.scale)
    steps = {version: make_step(model, batch, args.module, "ours", args.precision) for version in versions}
    print(f"{cpu_model()}, {args.threads} threads: {where} of this tree against {args.checkout}'s, "
          f"{args.module} {args.precision}, batch {args.batch}, one warm-up and {args.rounds} timed rounds",
          flush=True)
    seconds: dict[str, list[float]] = {version: [] for version in versions}
    for round_ in range(args.rounds + 1):
        for version in (("this", "earlier") if round_ % 2 else ("earlier", "this")):
            for target in targets:
                setattr(target, name, versions[version])
            start = time.perf_counter()
            loss = steps[version]()
            elapsed = time.perf_counter() - start
            if round_:
                seconds[version].append(elapsed)
            else:
                print(f"{version}: first loss {loss:.4f}", flush=True)
    for target in targets:
        setattr(target, name, versions["this"])
    ratios = [before / now for before, now in zip(seconds["earlier"], seconds["this"])]
    print("medians: " + ", ".join(f"{version} {statistics.median(s):.3f} s" for version, s in seconds.items()))
    print(f"this tree {statistics.median(ratios):.3f}x the earlier one's speed (median of the rounds' ratios: "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
