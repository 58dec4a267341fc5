"""`torch.compile` (Inductor) against eager scoring on this machine: is the compiled path faster?

Two measurements, each eager and compiled timed in turns in one run (A/B interleaved), medians:

1. What users call: `SGRAF.score` at the paper's sizes (2048-d regions, 1024-d embeddings,
   256-d similarity, 36 regions) on `--images` x `--captions` raw features and token ids with
   Flickr30K-like caption lengths, for each `--modules`, eager against
   `sgraf.kernels.compiled.compiling()` (the scoring chunks compiled, widths rounded to
   multiples of `WIDTH_STEP`, chunks padded to a fixed grid). The first compiled call compiles
   one graph per width bucket: its time, the graphs, and the number of calls after which the
   compiled path would have paid for its compilation (if it is faster) are printed, with the
   largest score difference from eager.
2. The SGR reasoning alone (`fast_graph_reasoning`, three steps over the nodes of every pair of
   a block) on `--block` pairs of `--words` tokens: the scorer's largest share of small
   operations, so where fusion could pay most (eager: oneDNN where this CPU's route is oneDNN;
   compiled: PyTorch's matmuls, as inside the compiled chunk).

    python benchmarks/bench_compile.py                     # about 10 minutes on 2 busy cores
    python benchmarks/bench_compile.py --smoke             # tiny sizes: the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def caption_lengths(n: int, generator: torch.Generator) -> torch.Tensor:
    """Flickr30K-like token counts with <start>/<end> (as `bench_score.py`): mean about 14."""
    words = torch.distributions.Gamma(torch.tensor(5.0), torch.tensor(5.0 / 12.0)).sample((n,))
    return (words.round().clamp(1, 40) + 2).long()


def interleaved(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turns `repeats` times."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            tic = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(values) for name, values in times.items()}


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def header() -> str:
    from sgraf.kernels.tuning import cpu_model

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, commit {commit}, "
            f"load average {load}")


def bench_score(args: argparse.Namespace, module: str) -> None:
    from sgraf.config import ModelConfig
    from sgraf.kernels import compiled
    from sgraf.model.sgraf import SGRAF

    torch.manual_seed(0)
    sizes = {} if not args.smoke else {"img_dim": 64, "word_dim": 16, "embed_size": 32, "sim_dim": 16,
                                       "num_regions": 6}
    model = SGRAF(ModelConfig(vocab_size=1000, module=module, **sizes)).eval()
    generator = torch.Generator().manual_seed(1)
    cfg = model.config
    images = torch.randn(args.images, cfg.num_regions, cfg.img_dim, generator=generator)
    lengths = caption_lengths(args.captions, generator)
    captions = torch.randint(4, cfg.vocab_size, (args.captions, int(lengths.max())), generator=generator)
    # SGRAF.score buckets captions by length, 128 to a bucket; the scorer cuts a bucket into caption
    # blocks, each as wide as its longest caption, rounded up to a multiple of WIDTH_STEP: at most
    # one graph per rounded width up to the longest
    most_graphs = compiled.bucket_width(int(lengths.max())) // compiled.WIDTH_STEP

    def eager() -> torch.Tensor:
        return model.score(images, captions, lengths)

    def compiled_score() -> torch.Tensor:
        with compiled.compiling():
            return model.score(images, captions, lengths)

    expected = eager()
    before = graphs()
    tic = time.perf_counter()
    first = compiled_score()
    first_s = time.perf_counter() - tic
    new_graphs = graphs() - before
    difference = float((first - expected).abs().max())
    medians = interleaved({"eager": eager, "compiled": compiled_score}, args.repeats)
    assert graphs() - before == new_graphs, "the same shapes compiled again"
    eager_s, compiled_s = medians["eager"], medians["compiled"]
    print(f"SGRAF.score, {module}, fp32, {args.images} x {args.captions} captions of {int(lengths.min())}-"
          f"{int(lengths.max())} tokens:")
    print(f"  eager {eager_s * 1e3:.0f} ms, compiled {compiled_s * 1e3:.0f} ms (median of {args.repeats}, "
          f"interleaved): eager / compiled = {eager_s / compiled_s:.2f}x")
    if compiled_s < eager_s:
        paid = f"pays for its compilation after {first_s / (eager_s - compiled_s):.0f} calls"
    else:
        paid = "never pays for its compilation"
    print(f"  first compiled call {first_s:.1f} s ({new_graphs} graphs, at most {most_graphs}: one per width rounded to {compiled.WIDTH_STEP}); {paid}; "
          f"max |compiled - eager| {difference:.2e}")


def bench_reasoning(args: argparse.Namespace) -> None:
    from sgraf.kernels import cpu
    from sgraf.kernels.graph_steps import fast_graph_reasoning, fold_steps
    from sgraf.model.reasoning import GraphReasoning

    torch.manual_seed(0)
    dim = 16 if args.smoke else 256
    steps = torch.nn.ModuleList(GraphReasoning(dim) for _ in range(3))
    folded = fold_steps(steps, torch.float32)
    n_img, n_cap = args.block
    nodes = torch.nn.functional.normalize(torch.randn(n_img, n_cap, 1 + args.words, dim), dim=-1)
    mask = torch.ones(n_cap, 1 + args.words, dtype=torch.bool)

    def eager() -> torch.Tensor:
        return fast_graph_reasoning(folded, nodes, mask, True)

    compiled = torch.compile(eager, dynamic=False, fullgraph=True)
    tic = time.perf_counter()
    result = compiled()
    compile_s = time.perf_counter() - tic
    difference = float((result - eager()).abs().max())
    medians = interleaved({"eager": eager, "compiled": compiled}, args.repeats)
    print(f"SGR reasoning alone, {n_img} x {n_cap} pairs of {args.words} words, m = {dim}, fp32 (eager route: "
          f"{cpu.float32_route()}):")
    print(f"  eager {medians['eager'] * 1e3:.1f} ms, compiled {medians['compiled'] * 1e3:.1f} ms (median of "
          f"{args.repeats}, interleaved): eager / compiled = {medians['eager'] / medians['compiled']:.2f}x; "
          f"compiling {compile_s:.1f} s; max |compiled - eager| {difference:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--captions", type=int, default=640)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"], choices=["sgr", "saf", "joint"])
    parser.add_argument("--block", type=int, nargs=2, default=[8, 16], help="images x captions (one chunk)")
    parser.add_argument("--words", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.captions, args.repeats, args.block, args.words = 4, 12, 2, [2, 3], 5
    import torch._dynamo

    print(header())
    with torch.no_grad():
        for module in args.modules:
            bench_score(args, module)
        bench_reasoning(args)
    print(f"after: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
