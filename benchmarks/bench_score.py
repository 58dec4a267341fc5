"""Image-caption pairs scored per second: the vectorised scorer vs the authors' per-caption loop.

At the paper's size (2048-d regions, 1024-d embeddings, 256-d similarity, 36 regions) with
caption lengths distributed like Flickr30K's (mean about 14 tokens with <start>/<end>), from
precomputed embeddings, for SGR and SAF: ours in fp32 and under bf16 autocast against the
oracle in fp32, measured in the same run (medians of --repeats), with the maximum absolute
score difference and the peak resident memory added during each run. Then a ranking check:
the fp32 and bf16 score matrices of --rank-images x --rank-captions (1000 x 5000 by default)
must rank the same top-1 everywhere except near-ties.

    python benchmarks/bench_score.py                 # full: throughput + 1000 x 5000 ranking check
    python benchmarks/bench_score.py --small         # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from sgraf.config import ModelConfig
from sgraf.model.oracle import oracle_similarity
from sgraf.model.sgraf import SGRAF
from sgraf.precision import autocast


def caption_lengths(n: int, generator: torch.Generator) -> torch.Tensor:
    """Flickr30K-like token counts with <start>/<end>: right-skewed, min 3, mean about 14."""
    words = torch.distributions.Gamma(torch.tensor(5.0), torch.tensor(5.0 / 12.0)).sample((n,))
    return (words.round().clamp(1, 80) + 2).long()


class PeakRSS:
    """Peak resident memory (MiB) above the starting level while the block runs, sampled every 2 ms."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * 4096

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def make_embeddings(model: SGRAF, n_img: int, n_cap: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    d = model.config.embed_size
    lengths = caption_lengths(n_cap, generator)
    img = torch.nn.functional.normalize(torch.randn(n_img, model.config.num_regions, d, generator=generator), dim=-1)
    cap = torch.nn.functional.normalize(torch.randn(n_cap, int(lengths.max()), d, generator=generator), dim=-1)
    cap = cap * (torch.arange(cap.size(1)) < lengths.unsqueeze(1)).unsqueeze(2)
    return img, cap, lengths


def score_blocks(model: SGRAF, img, cap, lengths, precision: str, img_block: int, cap_block: int) -> torch.Tensor:
    """The (n_img, n_cap) matrix, block by block (the way a streaming scorer calls the model)."""
    out = torch.empty(img.size(0), cap.size(0))
    with torch.no_grad(), autocast(precision):
        for c0 in range(0, cap.size(0), cap_block):
            sub_len = lengths[c0 : c0 + cap_block]
            sub_cap = cap[c0 : c0 + cap_block, : int(sub_len.max())]
            for i0 in range(0, img.size(0), img_block):
                out[i0 : i0 + img_block, c0 : c0 + cap_block] = model.similarity(img[i0 : i0 + img_block], sub_cap, sub_len).float()
    return out


def oracle_matrix(model: SGRAF, img, cap, lengths) -> torch.Tensor:
    with torch.no_grad():
        return oracle_similarity(model, img, cap, lengths)[model.config.module]


def timed(fn, repeats: int):
    fn()   # warm-up: first-touch page faults and thread-pool start are not throughput
    times, result, peak = [], None, 0.0
    for _ in range(repeats):
        with PeakRSS() as memory:
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        peak = max(peak, memory.added_mib)
    return statistics.median(times), result, peak


def ranking_check(model: SGRAF, n_img: int, n_cap: int, args) -> str:
    img, cap, lengths = make_embeddings(model, n_img, n_cap, seed=7)
    start = time.perf_counter()
    fp32 = score_blocks(model, img, cap, lengths, "fp32", args.img_block, args.cap_block)
    bf16 = score_blocks(model, img, cap, lengths, "bf16", args.img_block, args.cap_block)
    seconds = time.perf_counter() - start
    lines = []
    for name, dim in (("image->text (rows)", 1), ("text->image (cols)", 0)):
        top32, top16 = fp32.argmax(dim), bf16.argmax(dim)
        changed = (top32 != top16).nonzero().flatten()
        # a change is a near-tie when the fp32 scores of the two choices differ by less than the bf16 error
        best = fp32.max(dim).values
        chosen = fp32.gather(dim, top16.unsqueeze(dim)).squeeze(dim)
        gaps = (best - chosen)[changed]
        tie = float((bf16 - fp32).abs().max()) * 2
        real = int((gaps > tie).sum())
        lines.append(f"  {name}: top-1 changed for {changed.numel()} of {top32.numel()} queries, "
                     f"{real} with an fp32 gap above the near-tie threshold {tie:.2e}")
    return (f"ranking check {n_img} x {n_cap} ({seconds:.0f} s): max |bf16 - fp32| = "
            f"{float((bf16 - fp32).abs().max()):.2e}\n" + "\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100, help="images in the throughput run")
    parser.add_argument("--captions", type=int, default=500, help="captions in the throughput run")
    parser.add_argument("--rank-images", type=int, default=1000)
    parser.add_argument("--rank-captions", type=int, default=5000)
    parser.add_argument("--img-block", type=int, default=50)
    parser.add_argument("--cap-block", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"], choices=["sgr", "saf"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--small", action="store_true",
                        help="40 x 200 throughput, 200 x 1000 ranking check, 2 repeats (a few minutes)")
    args = parser.parse_args(argv)
    if args.small:
        args.images, args.captions, args.rank_images, args.rank_captions, args.repeats = 40, 200, 200, 1000, 2
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; throughput {args.images} x {args.captions} pairs, "
          f"blocks {args.img_block} x {args.cap_block}, medians of {args.repeats}")
    for module in args.modules:
        torch.manual_seed(0)
        model = SGRAF(ModelConfig(vocab_size=8481, module=module)).eval()
        img, cap, lengths = make_embeddings(model, args.images, args.captions, seed=1)
        pairs = args.images * args.captions
        t_oracle, reference, m_oracle = timed(lambda: oracle_matrix(model, img, cap, lengths), args.repeats)
        print(f"{module.upper()}: mean caption length {lengths.float().mean():.1f}")
        print(f"  oracle fp32: {pairs / t_oracle:9.0f} pairs/s  peak +{m_oracle:7.0f} MiB")
        for precision in ("fp32", "bf16"):
            t_ours, ours, m_ours = timed(lambda: score_blocks(model, img, cap, lengths, precision, args.img_block,
                                                              args.cap_block), args.repeats)
            diff = float((ours - reference).abs().max())
            print(f"  ours {precision}:   {pairs / t_ours:9.0f} pairs/s  peak +{m_ours:7.0f} MiB  "
                  f"x{t_oracle / t_ours:5.2f} vs oracle  max |diff| {diff:.2e}")
        if args.rank_images and args.rank_captions:
            print(ranking_check(model, args.rank_images, args.rank_captions, args))


if __name__ == "__main__":
    main()
