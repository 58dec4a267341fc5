"""The authors' own training step timed beside the stand-in for it and beside sgraf, in one process.

`bench_train.py` times sgraf against a stand-in for the authors' `train_emb`
(`sgraf.model.oracle.authors_forward` with their loss, clipping and Adam). A stand-in must run
within 20 % of the authors' code on the same machine (`../shared/reference/speed.md`), and how
fast their code runs depends on the processor, so this measures the three on this machine: their
`SGRAF.train_emb` from a checkout of their repository (`git clone -b python3.6
https://github.com/Paranioar/SGRAF`; nothing of it is copied here, it is imported from DIR), the
stand-in, and `sgraf.training.train_step`, taking one step each in turn per round (the order
rotating), on the paper-size model and the batch of `bench_train.py` (dropout off in all three,
so their first losses agree: printed as the check that the same weights compute the same thing).

All three share the process, so after sgraf's first step (`train_step` sets glibc to keep freed
memory for the whole process, `sgraf.kernels.memory`) their step and the stand-in's run with that
setting too, which their own runs do not have: the stand-in against their code is like for like
here, and `bench_train.py --theirs DIR` times sgraf against their code with each in a process of
its own (on a 2-core Intel Xeon their SAF step took 9.26 s there, 8.4-9.1 s here the same hour).

Their model is built by `authors_code.py` (their model.py with one edit that changes no math, our
weights loaded into it).

    python benchmarks/calibrate_authors.py /path/to/SGRAF --module saf --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from authors_code import authors_module, authors_step
    from bench_train import add_step_arguments, make_step, setup

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of Paranioar/SGRAF, branch python3.6")
    parser.add_argument("--module", choices=["sgr", "saf"], default="saf")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                        help="sgraf's (the authors' code and the stand-in run in fp32)")
    add_step_arguments(parser, rounds=3)
    args = parser.parse_args()

    import torch

    from sgraf.kernels.tuning import cpu_model

    module = authors_module(args.checkout)
    model, batch = setup(args.module, args.batch, args.threads, scale=args.scale)
    steps = {"authors": authors_step(module, model, batch, args.module),
             "stand-in": make_step(model, batch, args.module, "authors", "fp32")}
    for precision in args.precisions:
        steps[f"sgraf {precision}"] = make_step(model, batch, args.module, "ours", precision)
    print(f"{cpu_model()}, torch {torch.__version__}, {args.threads} threads, {args.module}, batch {args.batch}, "
          f"one warm-up and {args.rounds} timed rounds, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):
        shift = round_ % len(names)
        line = []
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            loss = steps[name]()
            elapsed = time.perf_counter() - start
            if round_:
                seconds[name].append(elapsed)
            line.append(f"{name} {elapsed:.2f} s (loss {loss:.4f})")
        print(f"round {round_}{' (warm-up)' if not round_ else ''}: " + ", ".join(line), flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    authors = medians["authors"]
    for name in names:
        print(f"{name}: median {medians[name]:.2f} s/step, the authors' code / this = {authors / medians[name]:.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
