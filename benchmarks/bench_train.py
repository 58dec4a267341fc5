"""Seconds per training step and peak memory at the paper's size: ours vs the authors' algorithm.

One optimisation step = train-mode scores of a batch of 128 pairs, the hinge loss with hardest
negatives, backward, clipping at 2.0, Adam (2048-d features of 36 regions, embed 1024, sim 256,
word 300, vocabulary 8,500, caption lengths like Flickr30K's). "authors" is the authors'
algorithm as they run it (`sgraf.model.oracle.authors_forward`): both encoders once over the
batch (the GRU on packed sequences), then each caption scored against all images on its own,
in float32; "ours" is `sgraf.training.train_step` (vectorised over captions,
scored in length-sorted caption chunks whose intermediates are recomputed in backward;
`--chunk N` fixes the captions per chunk, `--no-checkpoint` keeps every chunk's intermediates).
Dropout is off so both compute the same first loss (printed: a correctness check).

Each configuration runs in its own subprocess, so its peak resident memory (ru_maxrss: the
interpreter, torch, the model, Adam's moments and the step) is clean. Medians over --steps
timed steps after one warm-up step.

    python benchmarks/bench_train.py                     # SGR and SAF, authors fp32 vs ours fp32/bf16
    python benchmarks/bench_train.py --batch 32 --steps 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def caption_lengths(n: int, generator):
    """Flickr30K-like token counts with <start>/<end>: right-skewed, min 3, mean about 14."""
    import torch

    words = torch.distributions.Gamma(torch.tensor(5.0), torch.tensor(5.0 / 12.0)).sample((n,))
    return (words.round().clamp(1, 80) + 2).long()


def child(module: str, impl: str, precision: str, batch_size: int, steps: int, threads: int,
          chunk: int | None = None, checkpoint: bool = True, device: str = "cpu") -> dict:
    import torch
    from types import SimpleNamespace

    from sgraf.config import ModelConfig
    from sgraf.model.oracle import authors_forward
    from sgraf.model.sgraf import SGRAF
    from sgraf.precision import autocast
    from sgraf.training.config import preset
    from sgraf.training.loop import batch_loss, build_optimizer, train_step

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = preset(f"f30k-{module}").replace(precision=precision)
    model = SGRAF(ModelConfig(vocab_size=8500, img_dim=2048, word_dim=300, embed_size=1024, sim_dim=256,
                              num_regions=36, module=module, dropout=0.0))
    model.train_chunk, model.train_checkpoint = chunk, checkpoint
    model.to(device)
    optimizer = build_optimizer(model, config)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    lengths = caption_lengths(batch_size, gen)
    captions = torch.randint(4, 8500, (batch_size, int(lengths.max())), generator=gen)
    for i, n in enumerate(lengths.tolist()):
        captions[i, n:] = 0
        captions[i, 0], captions[i, n - 1] = 1, 2
    batch = SimpleNamespace(images=torch.randn(batch_size, 36, 2048, generator=gen).to(device),
                            captions=captions.to(device), lengths=lengths, image_ids=torch.arange(batch_size))
    cuda = torch.device(device).type == "cuda"
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def authors_step() -> float:
        # The authors' train_emb: encoders on the batch, per-caption similarity, loss, backward,
        # clip, Adam step.
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision, device):
            scores = authors_forward(model, batch.images, batch.captions, batch.lengths)[module]
        loss = batch_loss(scores, config)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        return loss.item()

    def ours_step() -> float:
        return train_step(model, optimizer, batch, config, device=device).loss

    step = authors_step if impl == "authors" else ours_step
    times, losses = [], []
    for k in range(steps + 1):
        tic = time.perf_counter()
        losses.append(step())
        if k:
            times.append(time.perf_counter() - tic)
    # the peak memory of the device that computed: the GPU's allocator, else the process's RSS
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"module": module, "impl": impl, "precision": precision, "seconds_per_step": statistics.median(times),
            "times": times, "peak_rss_gib": peak, "device": device,
            "rss_after_setup_gib": rss_setup, "first_loss": losses[0], "threads": threads,
            "batch_size": batch_size}


def torch_device_name(device: str) -> str:
    """The processor or GPU the benchmark runs on, for the printed figures."""
    import torch

    from sgraf.kernels.tuning import cpu_model

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"], choices=["sgr", "saf"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-authors", action="store_true", help="skip the slow reference (the authors' algorithm)")
    parser.add_argument("--chunk", type=int, help="ours: captions per chunk (default: from a memory budget)")
    parser.add_argument("--no-checkpoint", action="store_true", help="ours: keep every chunk's intermediates")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (peak memory: the GPU allocator's there)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=3, metavar=("MODULE", "IMPL", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch, args.steps, args.threads, args.chunk,
                               not args.no_checkpoint, args.device)))
        return

    runs = [("authors", "fp32"), ("ours", "fp32"), ("ours", "bf16")]
    if args.no_authors:
        runs = runs[1:]
    results = []
    where = torch_device_name(args.device)
    print(f"{where}: batch {args.batch}, {args.steps} timed steps, {args.threads} threads, "
          f"torch in a fresh process each")
    print(f"{'module':<6} {'impl':<7} {'prec':<5} {'s/step':>8} {'peak GiB':>13} {'first loss':>11}")
    for module in args.modules:
        for impl, precision in runs:
            proc = subprocess.run([sys.executable, __file__, "--child", module, impl, precision,
                                   "--batch", str(args.batch), "--steps", str(args.steps),
                                   "--threads", str(args.threads), "--device", args.device]
                                  + (["--chunk", str(args.chunk)] if args.chunk else [])
                                  + (["--no-checkpoint"] if args.no_checkpoint else []),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{module:<6} {impl:<7} {precision:<5} FAILED: {proc.stderr.strip().splitlines()[-1]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{module:<6} {impl:<7} {precision:<5} {r['seconds_per_step']:>8.2f} {r['peak_rss_gib']:>13.2f} "
                  f"{r['first_loss']:>11.4f}", flush=True)
    print()
    for module in args.modules:
        ref = next((r for r in results if r["module"] == module and r["impl"] == "authors"), None)
        if ref is None:
            continue
        for r in results:
            if r["module"] == module and r["impl"] == "ours":
                print(f"{module} ours {r['precision']}: {ref['seconds_per_step'] / r['seconds_per_step']:.2f}x faster, "
                      f"{r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}x the authors' peak memory "
                      f"(first loss {r['first_loss']:.4f} vs {ref['first_loss']:.4f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
