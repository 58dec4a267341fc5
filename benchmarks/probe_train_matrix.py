"""Which scorer should a pair-trained step's score matrix go through?

An SGR (or AVE) training step scores its (B, B) matrix without autograd, then scores the pairs
the loss selects again with autograd (`SGRAF.train_scores`, `sgraf.training.pairs`). The matrix
goes through the training path's chunks (`SGRAF._train_block_scores`). Given the batch's
train-mode global vectors, its per-pair math is also the eval scorer's
(`SGRAF._eval_similarity_heads`): SGR has no dropout and no BatchNorm per pair. The eval scorer
launches fewer operations per chunk and takes the measured kernel routes, but pads a chunk's
captions to its longest. This probe scores one batch's matrix three ways, from the same
embeddings and global vectors:

- `train`: the training path, as a step does today (captions sorted by length into chunks of
  the training memory budget);
- `eval chunks`: the eval scorer on each of those chunks;
- `eval whole`: the eval scorer on the whole batch at once (every caption padded to the longest).

It prints each way's seconds (the median of `--rounds`, the ways interleaved), against `train`,
the largest difference from `train` as a fraction of the largest score, and the operations each
way launches under the GPU plan (`sgraf.kernels.launches`; on a CPU under `emulate_gpu`, where
the chunks are those of an idle 80 GB H100 at the paper's size). The model is the paper's SGR
with random weights, its feature sizes divided by `--scale`.

    python benchmarks/probe_train_matrix.py                          # CPU, paper size, fp32
    python benchmarks/probe_train_matrix.py --device cuda --precisions bf16 fp32
    python benchmarks/probe_train_matrix.py --scale 64 --rounds 1    # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_profile import sync
from launch_counts import batch_of, emulated_memory, scaled_model
from sgraf.kernels import plan
from sgraf.kernels.launches import LaunchCounter
from sgraf.kernels.tuning import cpu_model
from sgraf.model.sgraf import SGRAF, _host_lengths, _masked_words
from sgraf.precision import autocast

WAYS = ("train", "eval chunks", "eval whole")


def matrix_ways(model: SGRAF, batch: Any, device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways of scoring `batch`'s matrix (train mode, no autograd), from the same
    embeddings and train-mode global vectors: {way: a call returning the (B, B) scores}."""
    host = _host_lengths(batch.lengths)
    images, captions = batch.images.to(device), batch.captions.to(device)
    img_embs, cap_embs = model.encode_images(images), model.encode_captions(captions, batch.lengths)
    words, mask, lengths = _masked_words(cap_embs, batch.lengths.to(device))
    regions, centres = model.split_places(img_embs)
    img_glo, cap_glo, directions = model._train_batch_vectors(regions, words, mask, centres)
    head = model.heads[0]

    def train() -> torch.Tensor:
        return model._train_block_scores(regions, img_glo, words, mask, cap_glo, lengths, host, centres,
                                         directions)[head]

    def eval_chunks() -> torch.Tensor:
        chunks = model.train_chunks(regions.size(0), host)
        gram = model.region_grams(regions)
        scores = torch.empty(regions.size(0), words.size(0), device=device)
        with model.frozen_weights():
            for index in chunks:
                n_words = int(host[index].max())
                on_device = index.to(device)
                scores[:, on_device] = model._eval_similarity_heads(
                    regions, words[on_device, :n_words], mask[on_device, :n_words], lengths[on_device], img_glo,
                    None if cap_glo is None else cap_glo[on_device], gram, host[index], centres)[head]
        return scores

    def eval_whole() -> torch.Tensor:
        with model.frozen_weights():
            return model._eval_similarity_heads(regions, words, mask, lengths, img_glo, cap_glo,
                                                model.region_grams(regions), host, centres)[head]

    return dict(zip(WAYS, (train, eval_chunks, eval_whole)))


def launches(module: str, precision: str, batch_size: int, scale: int, device: torch.device) -> dict[str, int]:
    """Operations each way launches under the GPU plan (emulated on a CPU), at `scale`."""
    model = scaled_model(module, scale).to(device).train()
    batch = batch_of(model, batch_size)
    emulated = plan.emulate_gpu(emulated_memory(scale)) if device.type == "cpu" else contextlib.nullcontext()
    counts = {}
    with emulated, torch.no_grad(), autocast(precision, device):
        for way, score in matrix_ways(model, batch, device).items():
            score()                                    # the weight-only constants' first use, as in a run
            with LaunchCounter() as counter:
                counter.host(batch.lengths)
                score()
            counts[way] = counter.launches
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--module", default="sgr", choices=["sgr", "ave"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--scale", type=int, default=1, help="feature sizes divided by this (the timings)")
    parser.add_argument("--count-scale", type=int, default=64,
                        help="feature sizes divided by this for the launch counts (the same cuts)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()}, " \
        f"{torch.get_num_threads()} threads"
    print(f"{where}, torch {torch.__version__}: the {args.module.upper()} matrix of a batch of {args.batch} "
          f"(Flickr30K-like caption lengths), feature sizes / {args.scale}", flush=True)
    for precision in args.precisions:
        torch.manual_seed(0)
        model = scaled_model(args.module, args.scale).to(device).train()
        batch = batch_of(model, args.batch)
        with torch.no_grad(), autocast(precision, device):
            ways = matrix_ways(model, batch, device)
            reference = ways["train"]().float()
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            differences = {way: float((score().float() - reference).abs().max()) for way, score in ways.items()}
            for _ in range(args.rounds):
                for way, score in ways.items():
                    sync(device)
                    start = time.perf_counter()
                    score()
                    sync(device)
                    seconds[way].append(time.perf_counter() - start)
        counts = launches(args.module, precision, args.batch, args.count_scale, device)
        largest = float(reference.abs().max())
        base = statistics.median(seconds["train"])
        for way in ways:
            median = statistics.median(seconds[way])
            print(f"{args.module} {precision} {way:11s}: {median:.3f} s (per round "
                  f"{', '.join(f'{s:.3f}' for s in seconds[way])}), {base / median:.2f}x the train path, "
                  f"largest difference {differences[way] / largest:.1e} of the largest score, "
                  f"{counts[way]} launches under the GPU plan", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
