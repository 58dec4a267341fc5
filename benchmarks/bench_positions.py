"""What region positions cost: a training step and a test-split scoring, with and without them.

At the demo's model size (embed 64, sim 32, word 32; 36 regions of 1280-d CNN grid features,
batch 32), in the same run and interleaved so that the machine's load falls on every variant
alike, times for each head (SGR, SAF) and each `positions` (none, box, relation, place):

- a training step (forward, backward, Adam) on a random batch with captions of the benchmark's
  length (about 12 tokens);
- encoding and scoring a test split (default 300 images x 1,500 captions, as the demo's).

It prints the median of `--repeats` rounds and each variant's ratio to `positions=none` of the
same head. The demo with `--positions` trains SAF and SGR a second time with positions, so its
extra training time is about these step ratios times the paper's SAF and SGR training.

    python benchmarks/bench_positions.py                  # the demo's sizes
    python benchmarks/bench_positions.py --repeats 3 --images 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

POSITIONS = ("none", "box", "relation", "place")
HEADS = ("sgr", "saf")


def build(module: str, positions: str, vocab: int = 60):
    from sgraf.config import ModelConfig
    from sgraf.model.sgraf import SGRAF

    torch.manual_seed(0)
    return SGRAF(ModelConfig(vocab_size=vocab, img_dim=1280, word_dim=32, embed_size=64, sim_dim=32,
                             num_regions=36, module=module, positions=positions))


def random_inputs(n_img: int, n_cap: int, generator: torch.Generator, vocab: int = 60):
    images = torch.randn(n_img, 36, 1280, generator=generator).clamp_min(0)   # post-ReLU-like features
    corner = torch.rand(n_img, 36, 2, generator=generator) * 0.8
    boxes = torch.cat([corner, corner + 0.2], dim=-1)
    lengths = torch.randint(8, 17, (n_cap,), generator=generator)
    captions = torch.randint(4, vocab, (n_cap, int(lengths.max())), generator=generator)
    return images, boxes, captions, lengths


def time_step(model, optimizer, images, boxes, captions, lengths) -> float:
    model.train()
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    scores = model(images, captions, lengths, boxes=boxes if model.needs_boxes else None)
    scores.sum().backward()
    optimizer.step()
    return time.perf_counter() - started


def time_scoring(model, images, boxes, captions, lengths) -> float:
    model.eval()
    started = time.perf_counter()
    model.score(images, captions, lengths, boxes=boxes)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (medians are printed)")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed per round and variant")
    parser.add_argument("--images", type=int, default=300, help="test images scored (5 captions each)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    batch = random_inputs(32, 32, generator)
    split = random_inputs(args.images, 5 * args.images, generator)
    variants = [(head, positions) for head in HEADS for positions in POSITIONS]
    models = {v: build(*v) for v in variants}
    optimizers = {v: torch.optim.Adam(models[v].parameters(), lr=1e-4) for v in variants}
    for v in variants:   # warm-up: first calls, measured choices
        time_step(models[v], optimizers[v], *batch)
    steps: dict = {v: [] for v in variants}
    scoring: dict = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            steps[v].append(sum(time_step(models[v], optimizers[v], *batch) for _ in range(args.steps)) / args.steps)
            scoring[v].append(time_scoring(models[v], *split))
    print(f"{torch.get_num_threads()} threads, {args.repeats} rounds; medians; ratio to positions=none of the "
          "same head")
    print(f"{'head':<5} {'positions':<9} {'train step (ms)':>16} {'ratio':>6} "
          f"{f'score {args.images} x {5 * args.images} (s)':>24} {'ratio':>6}")
    for head, positions in variants:
        step = statistics.median(steps[(head, positions)])
        score = statistics.median(scoring[(head, positions)])
        step_ref = statistics.median(steps[(head, "none")])
        score_ref = statistics.median(scoring[(head, "none")])
        print(f"{head:<5} {positions:<9} {1000 * step:>16.1f} {step / step_ref:>6.2f} {score:>24.2f} "
              f"{score / score_ref:>6.2f}")


if __name__ == "__main__":
    main()
