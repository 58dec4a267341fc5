"""`torch.compile` (Inductor) against eager on the scorer's SGR reasoning, on this machine.

The eval SGR head (`sgraf.model.reasoning.fast_graph_reasoning`, three steps over the nodes of
every pair of a block) is the scorer's largest share of small operations, so it is where a
compiler's fusion could pay. The block: `--images` x `--captions` pairs of one caption width
(`--words` tokens: a length bucket), paper-size nodes (m = 256), fp32. A/B interleaved in one
run, medians; the compiled function's largest difference from eager and its recompilations
over `--widths` bucket widths (a split compiles one graph per width) are printed.

    python benchmarks/bench_compile.py                       # 16 x 128 pairs of 16 words
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch._dynamo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--captions", type=int, default=128)
    parser.add_argument("--words", type=int, default=16)
    parser.add_argument("--widths", type=int, nargs="+", default=[12, 16, 20])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    from sgraf.kernels.tuning import cpu_model
    from sgraf.model.reasoning import GraphReasoning, fast_graph_reasoning, fold_steps

    torch.manual_seed(0)
    steps = torch.nn.ModuleList(GraphReasoning(256) for _ in range(3))
    folded = fold_steps(steps, torch.float32)

    def nodes_of(width: int) -> tuple[torch.Tensor, torch.Tensor]:
        nodes = torch.nn.functional.normalize(torch.randn(args.images, args.captions, 1 + width, 256), dim=-1)
        return nodes, torch.ones(args.captions, 1 + width, dtype=torch.bool)

    def eager(nodes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fast_graph_reasoning(folded, nodes, mask, True)

    counters = torch._dynamo.utils.counters
    compiled = torch.compile(eager, dynamic=False)
    nodes, mask = nodes_of(args.words)
    with torch.no_grad():
        tic = time.perf_counter()
        result = compiled(nodes, mask)
        compile_s = time.perf_counter() - tic
        difference = float((result - eager(nodes, mask)).abs().max())
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for name, function in (("eager", eager), ("compiled", compiled)):
                tic = time.perf_counter()
                function(nodes, mask)
                times[name].append(time.perf_counter() - tic)
        before = counters["stats"]["unique_graphs"]
        for width in args.widths:
            compiled(*nodes_of(width))
        graphs = counters["stats"]["unique_graphs"] - before
    eager_s, compiled_s = (statistics.median(times[name]) for name in ("eager", "compiled"))
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads: SGR reasoning on "
          f"{args.images} x {args.captions} pairs of {args.words} words, fp32")
    print(f"eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms (median of {args.repeats}, interleaved): "
          f"{eager_s / compiled_s:.2f}x; first call (compiling) {compile_s:.1f} s; max |compiled - eager| "
          f"{difference:.2e}")
    print(f"widths {args.widths}: {graphs} more graphs compiled (one per new width)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
