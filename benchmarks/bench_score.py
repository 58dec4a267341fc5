"""Image-caption pairs scored per second: the vectorised scorer vs the authors' per-caption loop.

First what users call: `SGRAF.score` on raw region features and token ids (--call-images x
--call-captions, 80 x 160 by default, Flickr30K-like caption lengths), against the authors'
algorithm as they run it (both encoders on the batch, then one caption at a time against all
images: `sgraf.model.oracle.authors_forward`) and against the padded single-block call that
`SGRAF.score` made before it shared the split scorer (every caption padded to the longest,
constants recomputed), in fp32, timed in turns in the same run.

Then, at the paper's size (2048-d regions, 1024-d embeddings, 256-d similarity, 36 regions) with
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
from sgraf.kernels.tuning import cpu_model
from sgraf.model.oracle import authors_forward, oracle_similarity
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


def timed_round_robin(runs: dict, repeats: int):
    """Median seconds, last result and peak added memory of each run, timed in turns.

    The runs alternate (a, b, c, a, b, c, ...) so that a change in the machine's load during
    the benchmark affects each of them alike; one untimed warm-up each first.
    """
    for fn in runs.values():
        fn()   # warm-up: first-touch page faults and thread-pool start are not throughput
    times = {name: [] for name in runs}
    results, peaks = {}, dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, fn in runs.items():
            with PeakRSS() as memory:
                start = time.perf_counter()
                results[name] = fn()
                times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], memory.added_mib)
    return {name: statistics.median(t) for name, t in times.items()}, results, peaks


def make_inputs(model: SGRAF, n_img: int, n_cap: int, seed: int):
    """Raw inputs: region features (n_img, K, img_dim) and `<start> w... <end>` token ids."""
    generator = torch.Generator().manual_seed(seed)
    cfg = model.config
    lengths = caption_lengths(n_cap, generator)
    images = torch.rand(n_img, cfg.num_regions, cfg.img_dim, generator=generator)
    captions = torch.randint(4, cfg.vocab_size, (n_cap, int(lengths.max())), generator=generator)
    for row, length in enumerate(lengths.tolist()):
        captions[row, length:] = 0
        captions[row, 0], captions[row, length - 1] = 1, 2
    return images, captions, lengths


def score_call(model: SGRAF, n_img: int, n_cap: int, repeats: int) -> None:
    """`SGRAF.score` against the authors' algorithm and the padded single block, fp32."""
    images, captions, lengths = make_inputs(model, n_img, n_cap, seed=3)
    module = model.config.module

    def authors():
        with torch.no_grad():
            return authors_forward(model.eval(), images, captions, lengths)[module]

    def padded():
        with torch.no_grad():
            return model.similarity(model.encode_images(images), model.encode_captions(captions, lengths), lengths)

    runs = {"authors": authors, "padded block": padded, "SGRAF.score": lambda: model.score(images, captions, lengths)}
    seconds, results, peaks = timed_round_robin(runs, repeats)
    pairs = n_img * n_cap
    print(f"{module.upper()} SGRAF.score, {n_img} x {n_cap} from raw inputs (mean caption length "
          f"{lengths.float().mean():.1f}, longest {int(lengths.max())}), fp32:")
    for name in runs:
        error = float((results[name] - results["authors"]).abs().max())
        print(f"  {name:<13} {seconds[name]:7.3f} s  {pairs / seconds[name]:8.0f} pairs/s  "
              f"x{seconds['authors'] / seconds[name]:5.2f} vs authors  peak +{peaks[name]:6.0f} MiB  "
              f"max |diff| vs authors {error:.1e}")


def structured_embeddings(model: SGRAF, n_img: int, n_cap: int, seed: int):
    """Captions that describe an image: caption c's words are noisy copies of regions of image c // 5."""
    img, cap, lengths = make_embeddings(model, n_img, n_cap, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    owner = torch.arange(n_cap) % n_img if n_cap < 5 * n_img else torch.arange(n_cap) // 5
    picks = torch.randint(model.config.num_regions, cap.shape[:2], generator=generator)
    words = img[owner.unsqueeze(1), picks] + 0.8 * cap                   # (n_cap, L, d)
    words = torch.nn.functional.normalize(words, dim=-1)
    return img, words * (torch.arange(cap.size(1)) < lengths.unsqueeze(1)).unsqueeze(2), lengths


def spread_model(model: SGRAF, scale: float) -> SGRAF:
    """A copy whose score FC is scaled by `scale`: scores spread like a trained model's."""
    from sgraf.model.blocks import copied

    spread = copied(model)
    with torch.no_grad():
        spread.sim_enc.sim_eval_w.weight.mul_(scale)
    return spread


def ranking_check(model: SGRAF, n_img: int, n_cap: int, args, tie: float, structured: bool = False) -> str:
    """Top-1 agreement of bf16 with fp32 in both directions.

    A query's top-1 change is a near-tie when the fp32 scores of the two candidates differ by
    less than `tie`: twice the largest |bf16 - fp32| measured on the throughput matrix (other
    images and captions), so the bound is not taken from the matrix it judges.
    """
    make = structured_embeddings if structured else make_embeddings
    img, cap, lengths = make(model, n_img, n_cap, seed=7)
    start = time.perf_counter()
    fp32 = score_blocks(model, img, cap, lengths, "fp32", args.img_block, args.cap_block)
    bf16 = score_blocks(model, img, cap, lengths, "bf16", args.img_block, args.cap_block)
    seconds = time.perf_counter() - start
    lines = []
    for name, dim in (("image->text (rows)", 1), ("text->image (cols)", 0)):
        top32, top16 = fp32.argmax(dim), bf16.argmax(dim)
        changed = (top32 != top16).nonzero().flatten()
        best = fp32.max(dim).values
        chosen = fp32.gather(dim, top16.unsqueeze(dim)).squeeze(dim)
        gaps = (best - chosen)[changed]
        second = fp32.topk(2, dim).values
        close = int(((second.select(dim, 0) - second.select(dim, 1)) < tie).sum())
        real = int((gaps >= tie).sum())
        lines.append(f"  {name}: top-1 changed for {changed.numel()} of {top32.numel()} queries; "
                     f"{real} of them outside near-ties (fp32 gap >= {tie:.2e}); "
                     f"{close} queries have an fp32 top-2 gap below it")
    kind = "structured captions" if structured else "random captions"
    return (f"ranking check {n_img} x {n_cap}, {kind} ({seconds:.0f} s): fp32 score std {float(fp32.std()):.2e}, "
            f"max |bf16 - fp32| = {float((bf16 - fp32).abs().max()):.2e}\n" + "\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--call-images", type=int, default=80, help="images of the SGRAF.score call (0: skip)")
    parser.add_argument("--call-captions", type=int, default=160, help="captions of the SGRAF.score call")
    parser.add_argument("--images", type=int, default=100, help="images in the throughput run (0: skip)")
    parser.add_argument("--captions", type=int, default=500, help="captions in the throughput run")
    parser.add_argument("--rank-images", type=int, default=1000)
    parser.add_argument("--rank-captions", type=int, default=5000)
    parser.add_argument("--img-block", type=int, default=50)
    parser.add_argument("--cap-block", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"], choices=["sgr", "saf"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spread-scale", type=float, default=30.0,
                        help="also rank-check a copy with the score FC scaled by this (0: skip)")
    parser.add_argument("--small", action="store_true",
                        help="40 x 200 throughput, 200 x 1000 ranking check, 2 repeats (a few minutes)")
    args = parser.parse_args(argv)
    if args.small:
        args.images, args.captions, args.rank_images, args.rank_captions, args.repeats = 40, 200, 200, 1000, 2
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, torch {torch.__version__}, {args.threads} threads; medians of {args.repeats}")
    for module in args.modules:
        torch.manual_seed(0)
        model = SGRAF(ModelConfig(vocab_size=8481, module=module)).eval()
        if args.call_images:
            score_call(model, args.call_images, args.call_captions, args.repeats)
        if not args.images:
            continue
        print(f"throughput {args.images} x {args.captions} pairs from embeddings, blocks {args.img_block} x "
              f"{args.cap_block}")
        img, cap, lengths = make_embeddings(model, args.images, args.captions, seed=1)
        pairs = args.images * args.captions
        runs = {"oracle": lambda: oracle_matrix(model, img, cap, lengths),
                "fp32": lambda: score_blocks(model, img, cap, lengths, "fp32", args.img_block, args.cap_block),
                "bf16": lambda: score_blocks(model, img, cap, lengths, "bf16", args.img_block, args.cap_block)}
        seconds, results, peaks = timed_round_robin(runs, args.repeats)
        reference = results["oracle"]
        print(f"{module.upper()}: mean caption length {lengths.float().mean():.1f}")
        print(f"  oracle fp32: {pairs / seconds['oracle']:9.0f} pairs/s  peak +{peaks['oracle']:7.0f} MiB")
        diffs = {}
        for precision in ("fp32", "bf16"):
            diffs[precision] = float((results[precision] - reference).abs().max())
            print(f"  ours {precision}:   {pairs / seconds[precision]:9.0f} pairs/s  peak +{peaks[precision]:7.0f} MiB  "
                  f"x{seconds['oracle'] / seconds[precision]:5.2f} vs oracle  max |diff| {diffs[precision]:.2e}")
        if args.rank_images and args.rank_captions:
            tie = 2 * diffs["bf16"]
            print(ranking_check(model, args.rank_images, args.rank_captions, args, tie))
            if args.spread_scale:
                # the bf16 error grows with the FC scale: measure the bound again on the throughput data
                spread = spread_model(model, args.spread_scale)
                s_img, s_cap, s_len = structured_embeddings(spread, args.images, args.captions, seed=1)
                ref = oracle_matrix(spread, s_img, s_cap, s_len)
                low = score_blocks(spread, s_img, s_cap, s_len, "bf16", args.img_block, args.cap_block)
                tie = 2 * float((low - ref).abs().max())
                print(f"score FC x{args.spread_scale:g}:")
                print(ranking_check(spread, args.rank_images, args.rank_captions, args, tie, structured=True))


if __name__ == "__main__":
    main()
