"""The matmul arithmetic of one training step, counted by what it multiplies (no timing).

Where a step's time is its matmuls (SAF's fp32 step on a 2-core CPU: 5.1 of 5.9 s, training
guide), the question is which of them the math needs. This runs one warm-up step of
`bench_train.py`'s paper-size model and Flickr30K-like batch, then counts the floating-point
operations (2 M K N) of every matmul dispatched in a second step, forward, backward and Adam,
grouped by their shapes:

- `d <-> m`: the similarity vectors' maps (`W_loc`, `W_glo`, 1,024 <-> 256) and their gradients;
- `batched`: the batched matmuls (the word-region attention and its gradients);
- `3d gates`: matmuls 3 x 1,024 wide (the caption GRU's gates);
- `the rest`: the encoders' other linear layers, the heads.

    python benchmarks/train_step_flops.py --modules saf sgr
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import make_step, setup  # noqa: E402

from sgraf.kernels.launches import MATMULS, matmul_flops  # noqa: E402


class MatmulFlops(TorchDispatchMode):
    """Matmul FLOPs per group (`group`), and the largest shapes of each."""

    def __init__(self, d: int, m: int) -> None:
        super().__init__()
        self.d, self.m = d, m
        self.flops: collections.Counter[str] = collections.Counter()
        self.shapes: collections.Counter[tuple[str, str]] = collections.Counter()

    def group(self, name: str, left: torch.Tensor, right: torch.Tensor) -> str:
        dims = {*left.shape[-2:], right.shape[-1]}
        if left.dim() == 3:
            return "batched"
        if 3 * self.d in dims:
            return "3d gates"
        if {self.d, self.m} <= dims:
            return "d <-> m"
        return "the rest"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        flops = matmul_flops(name, args)
        if flops:
            operands = MATMULS[name]
            left, right = args[operands[0]], args[operands[1]]
        elif name.startswith("mkldnn._linear_pointwise"):     # the CPU's oneDNN route: (..., K) x (N, K)^T
            left, right = args[0].reshape(-1, args[0].shape[-1]), args[1].t()
            flops = 2 * left.numel() * right.shape[-1]
        if flops:
            group = self.group(name, left, right)
            self.flops[group] += flops
            self.shapes[(group, f"{tuple(left.shape)} @ {tuple(right.shape)}")] += flops
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", default=["saf", "sgr"], choices=["sgr", "saf"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="feature sizes divided by this (a quick check)")
    parser.add_argument("--top", type=int, default=3, help="shapes shown per group")
    args = parser.parse_args()
    for module in args.modules:
        model, batch = setup(module, args.batch, args.threads, scale=args.scale)
        config = model.config
        step = make_step(model, batch, module, "ours", args.precision)
        step()                                   # warm-up: probes, Adam's state
        counter = MatmulFlops(config.embed_size, config.sim_dim)
        with counter:
            step()
        total = sum(counter.flops.values())
        print(f"{module} {args.precision}, batch {args.batch}, scale 1/{args.scale}: "
              f"{total / 1e9:.4g} GFLOP of matmuls")
        for group, flops in counter.flops.most_common():
            print(f"  {group:9s} {flops / 1e9:9.4g} GFLOP ({100 * flops / total:.0f} %)")
            shapes = [(shape, f) for (g, shape), f in counter.shapes.most_common() if g == group][:args.top]
            for shape, f in shapes:
                print(f"      {f / 1e9:9.4g}  {shape}")


if __name__ == "__main__":
    main()
