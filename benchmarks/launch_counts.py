"""Kernel launches of a scoring block and of a training step under the GPU plan, counted on a CPU.

`sgraf.kernels.launches.LaunchCounter` counts the ATen operations a piece of work dispatches;
`sgraf.kernels.plan.emulate_gpu` gives CPU tensors the plan a CUDA device gets (device-sized
scoring blocks, one chunk per block, training chunks from the free memory, PyTorch's own
matmuls, Adam's multi-tensor path as on CUDA). The count does not depend on the feature sizes,
only on how the work is cut, so the model's feature sizes (region features, embedding, nodes)
are divided by `scale` and the emulated free memory with them: the cuts are those of the paper's
size on an idle 80 GB H100, the arithmetic 1/scale^2 of it. Captions keep Flickr30K-like lengths.

    python benchmarks/launch_counts.py                 # SGR and SAF, fp32 and bf16, batch 128
    python benchmarks/launch_counts.py --precisions fp32 --scale 64   # quicker (same cuts)
    python benchmarks/launch_counts.py --traffic       # a block's bytes and roofline on an H100

`--traffic` weighs every launch of a scoring block at the paper's sizes (`LaunchCounter`'s
traffic: bytes read and written, matmul operations, by place in sgraf's code) and gives its
roofline floor on an H100: blocks of 2 and 4 images are weighed and the 256-image block
extrapolated from them launch by launch, so this takes about a minute on a CPU (bf16 most of it).
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

import torch

from sgraf.config import ModelConfig
from sgraf.kernels import plan
from sgraf.kernels.tuning import cpu_model
from sgraf.kernels.launches import H100, LaunchCounter, Traffic
from sgraf.model import blocks
from sgraf.model.sgraf import SGRAF
from sgraf.training.config import preset
from sgraf.training.step import build_optimizer, train_step

PAPER = dict(img_dim=2048, word_dim=300, embed_size=1024, sim_dim=256, num_regions=36)
SCALE = 16


def caption_lengths(n: int, seed: int = 1) -> torch.Tensor:
    """Flickr30K-like token counts with <start>/<end>: right-skewed, min 3, mean about 14."""
    torch.manual_seed(seed)
    words = torch.distributions.Gamma(torch.tensor(5.0), torch.tensor(5.0 / 12.0)).sample((n,))
    return (words.round().clamp(1, 80) + 2).long()


def scaled_model(module: str, scale: int = SCALE, seed: int = 0) -> SGRAF:
    """A paper-shaped model with its feature sizes divided by `scale` (regions, steps, heads kept)."""
    torch.manual_seed(seed)
    sizes = {key: (value if key == "num_regions" else max(4, value // scale)) for key, value in PAPER.items()}
    return SGRAF(ModelConfig(vocab_size=8500, module=module, dropout=0.0, **sizes))


def emulated_memory(scale: int) -> int:
    """The free memory whose cuts at 1/scale of the feature sizes are the H100's at full size."""
    return plan.EMULATED_FREE_BYTES // scale


def batch_of(model: SGRAF, size: int, seed: int = 1, width: int | None = None, images: int | None = None) -> Any:
    """`size` captions (Flickr30K-like lengths, or every caption `width` tokens) and as many images,
    or `images` of them (the first `images` of the same draw)."""
    torch.manual_seed(seed)
    lengths = caption_lengths(size, seed) if width is None else torch.full((size,), width)
    generator = torch.Generator().manual_seed(seed)
    captions = torch.randint(4, model.config.vocab_size, (size, int(lengths.max())), generator=generator)
    captions[torch.arange(captions.size(1)) >= lengths.unsqueeze(1)] = 0
    n_images = size if images is None else images
    features = torch.randn(n_images, model.config.num_regions, model.config.img_dim, generator=generator)
    return SimpleNamespace(images=features, captions=captions, lengths=lengths, image_ids=torch.arange(n_images))


def train_step_launches(module: str, precision: str = "fp32", batch_size: int = 128, scale: int = SCALE,
                        steps: int = 2) -> LaunchCounter:
    """The launches of one `train_step` (the last of `steps`; the first ones warm Adam's state)."""
    model = scaled_model(module, scale)
    config = preset(f"f30k-{module}").replace(precision=precision)
    batch = batch_of(model, batch_size)
    with plan.emulate_gpu(emulated_memory(scale)):
        optimizer = build_optimizer(model, config)
        for _ in range(steps - 1):
            train_step(model, optimizer, batch, config)
        with LaunchCounter() as counter:
            # Adam keeps its step counts on the host (not `capturable`), as on CUDA
            counter.host(batch.lengths, *(state["step"] for state in optimizer.state.values()))
            train_step(model, optimizer, batch, config)
    return counter


def score_block_launches(module: str, precision: str = "fp32", n_img: int = blocks.GPU_IMAGE_BLOCK,
                         n_cap: int = 128, scale: int = SCALE, width: int | None = None,
                         traffic: bool = False) -> LaunchCounter:
    """The launches of one scoring block: `n_img` images against `n_cap` captions of one length
    bucket (as `score_encoded` hands it to the model, global vectors and Gram matrices given);
    every caption `width` tokens if given; `traffic` weighs them (`LaunchCounter.traffic`)."""
    model = scaled_model(module, scale).eval()
    batch = batch_of(model, max(n_img, n_cap), width=width)
    with plan.emulate_gpu(emulated_memory(scale)), torch.no_grad():
        encoded = blocks.encode(model, batch.images[:n_img], batch.captions[:n_cap], batch.lengths[:n_cap],
                                batch_size=n_cap, precision=precision)
        bucket = max(encoded.buckets, key=lambda b: len(b.index))
        grams = model.region_grams(encoded.img_embs)
        with model.frozen_weights():
            block = lambda: blocks._score_block([model], [encoded], slice(0, n_img), encoded.buckets.index(bucket),
                                                slice(0, len(bucket.index)), precision, None, [grams])
            block()   # the weight-only constants, once per split
            with LaunchCounter(traffic=traffic) as counter:
                counter.host(bucket.lengths)
                block()
    return counter


def score_block_traffic(module: str, precision: str = "fp32", n_img: int = blocks.GPU_IMAGE_BLOCK,
                        n_cap: int = 1024, width: int = 13, scale: int = 1, measured: tuple[int, int] = (2, 4)
                        ) -> Traffic:
    """The weighed launches of a scoring block of `n_img` images x `n_cap` captions of `width`
    tokens (`gpu_profile.py`'s block: 256 x 1,024 of 13), at the paper's feature sizes: counted
    on blocks of `measured` images and extrapolated launch by launch (every launch of a block
    grows in proportion to its images), so that a CPU weighs a block it could not score quickly."""
    small, large = (score_block_launches(module, precision, n_img=images, n_cap=n_cap, scale=scale, width=width,
                                         traffic=True).traffic for images in measured)
    return small.extrapolated(large, (n_img - measured[0]) / (measured[1] - measured[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--scale", type=int, default=SCALE, help="feature sizes divided by this")
    parser.add_argument("--captions", type=int, nargs="+", default=[128, 1024], help="captions of the scoring blocks")
    parser.add_argument("--images", type=int, default=blocks.GPU_IMAGE_BLOCK, help="images of the scoring blocks")
    parser.add_argument("--traffic", action="store_true",
                        help="only the scoring blocks' bytes, operations and roofline floor on an H100, at the "
                             "paper's sizes (--images x 1,024 captions of 13 tokens, gpu_profile.py's block)")
    args = parser.parse_args(argv)
    if args.traffic:
        print(f"{cpu_model()}, torch {torch.__version__}: a scoring block of {args.images} x 1,024 captions of 13 "
              f"tokens at the paper's sizes, weighed on the CPU under the GPU plan (the word nodes and the "
              f"edges by their default routes); floors on an H100 SXM as specified "
              f"({H100['bandwidth'] / 1e12:.2f} TB/s, {H100['bf16'] / 1e12:.0f} TFLOP/s bf16, "
              f"{H100['fp32'] / 1e12:.0f} TFLOP/s fp32)", flush=True)
        for module in args.modules:
            for precision in args.precisions:
                traffic = score_block_traffic(module, precision, n_img=args.images)
                print(f"scoring block, {module} {precision}: {traffic.summary(8)}", flush=True)
        return 0
    print(f"{cpu_model()}, torch {torch.__version__}: the GPU plan of an idle 80 GB H100 emulated on CPU tensors, "
          f"feature sizes / {args.scale}", flush=True)
    for module in args.modules:
        for precision in args.precisions:
            step = train_step_launches(module, precision, args.batch, args.scale)
            print(f"train step, batch {args.batch}, {module} {precision}: {step.summary()}", flush=True)
            for n_cap in args.captions:
                block = score_block_launches(module, precision, n_img=args.images, n_cap=n_cap, scale=args.scale)
                print(f"scoring block {args.images} x {n_cap}, {module} {precision}: {block.summary()}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
