"""Two-stage gallery search: what the shortlist costs in recall, and how fast a query is.

Part 1 (recall), on a trained SGR + SAF pair and a precomp split (e.g. a finished `sgraf demo`
folder): for shortlist sizes N, each query keeps the N best gallery items by the global-vector
first stage, the full ensemble score re-ranks them, and R@1/5/10 are computed as the
standard protocol does; the reference is exhaustive scoring (N = the whole gallery), measured
in the same run. "first stage R@N" is the share of queries whose match survives the shortlist.

Part 2 (latency), on a generated gallery of random region features (default 100,000 images,
36 regions): builds an index with a randomly initialised SGR + SAF ensemble (embed size 64,
float16 storage, to keep the index at about 1 GB), then times text -> image queries for each
shortlist size against exhaustive scoring of the whole gallery (medians over repeats).

    python benchmarks/bench_search.py --demo sgraf-demo            # both parts
    python benchmarks/bench_search.py --demo sgraf-demo --skip-latency
    python benchmarks/bench_search.py --skip-recall --gallery 100000

Figures are medians; on a machine shared with other work, rerun if they look noisy.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sgraf.api import Matcher, shortlist_keys
from sgraf.search import build_index, open_index

SHORTLISTS = (20, 50, 100, 200)


# --------------------------------------------------------------------------------- recall
def _ranks_after_shortlist(full: np.ndarray, coarse: np.ndarray, truth: list[np.ndarray], shortlist: int) -> np.ndarray:
    """Rank (0-based) of the best true item per query after shortlist + re-rank; inf if cut.

    Args:
        full: (n_query, n_gallery) full scores; coarse: same shape, first-stage scores.
        truth: per query, the gallery ids that count as a match.
    """
    n_query, n_gallery = full.shape
    ranks = np.full(n_query, np.inf)
    for q in range(n_query):
        if shortlist >= n_gallery:
            kept = np.arange(n_gallery)
        else:
            kept = np.argpartition(-coarse[q], shortlist - 1)[:shortlist]
        order = kept[np.lexsort((kept, -full[q, kept]))]
        position = {int(item): r for r, item in enumerate(order)}
        found = [position[int(t)] for t in truth[q] if int(t) in position]
        if found:
            ranks[q] = min(found)
    return ranks


def _recalls(ranks: np.ndarray) -> dict[str, float]:
    return {f"R@{k}": 100.0 * float(np.mean(ranks < k)) for k in (1, 5, 10)}


def recall_cost(demo: Path, split: str, shortlists: tuple[int, ...]) -> None:
    from sgraf.data.precomp import PrecompSplit
    from sgraf.scoring import encode_split, score_matrix

    matcher = Matcher.load([demo / "runs" / "sgr" / "best.pt", demo / "runs" / "saf" / "best.pt"])
    data = PrecompSplit(demo / "data", split)
    cpi = data.caps_per_image
    tic = time.perf_counter()
    encoded = [encode_split(m, data, matcher.vocab) for m in matcher.models]
    full = score_matrix(matcher.models, encoded)                                   # (n_img, n_cap)
    exhaustive_s = time.perf_counter() - tic
    images = matcher.encode_images(data.images)
    texts = matcher.encode_texts(data.captions, allow_unknown=True)
    coarse = shortlist_keys(images.global_vectors) @ shortlist_keys(texts.global_vectors).T
    n_img, n_cap = full.shape
    print(f"\n## Recall cost of the shortlist: {demo} [{split}], {n_img} images x {n_cap} captions, "
          f"SGR + SAF ensemble (exhaustive scoring took {exhaustive_s:.1f} s)\n")
    t2i_truth = [np.array([c // cpi]) for c in range(n_cap)]
    i2t_truth = [np.arange(i * cpi, (i + 1) * cpi) for i in range(n_img)]
    rows = []
    for shortlist in (*[n for n in shortlists if n < max(n_img, n_cap)], max(n_img, n_cap)):
        t2i = _ranks_after_shortlist(full.T, coarse.T, t2i_truth, shortlist)
        i2t = _ranks_after_shortlist(full, coarse, i2t_truth, shortlist)
        label = "exhaustive" if shortlist >= max(n_img, n_cap) else str(shortlist)
        rows.append((label, _recalls(i2t), _recalls(t2i), 100.0 * np.mean(np.isfinite(i2t)),
                     100.0 * np.mean(np.isfinite(t2i))))
    print("| shortlist N | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | first stage keeps a match (i2t / t2i) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, i2t, t2i, kept_i2t, kept_t2i in rows:
        print(f"| {label} | {i2t['R@1']:.1f} | {i2t['R@5']:.1f} | {i2t['R@10']:.1f} | {t2i['R@1']:.1f} | "
              f"{t2i['R@5']:.1f} | {t2i['R@10']:.1f} | {kept_i2t:.1f}% / {kept_t2i:.1f}% |")
    first_i2t = _recalls(_first_stage_ranks(coarse, i2t_truth))
    first_t2i = _recalls(_first_stage_ranks(coarse.T, t2i_truth))
    print(f"| first stage alone | {first_i2t['R@1']:.1f} | {first_i2t['R@5']:.1f} | {first_i2t['R@10']:.1f} | "
          f"{first_t2i['R@1']:.1f} | {first_t2i['R@5']:.1f} | {first_t2i['R@10']:.1f} | |")


def _first_stage_ranks(coarse: np.ndarray, truth: list[np.ndarray]) -> np.ndarray:
    order = np.argsort(-coarse, axis=1, kind="stable")
    ranks = np.empty(coarse.shape[0])
    for q in range(coarse.shape[0]):
        ranks[q] = np.flatnonzero(np.isin(order[q], truth[q])).min()
    return ranks


# --------------------------------------------------------------------------------- latency
class RandomFeatures:
    """A (n, K, D) float32 array-like generated chunk by chunk (deterministic per chunk start)."""

    def __init__(self, n: int, regions: int, dim: int, seed: int = 0) -> None:
        self.shape = (n, regions, dim)
        self.seed = seed

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(self.shape[0])
        rng = np.random.default_rng([self.seed, start])
        return rng.standard_normal((stop - start, *self.shape[1:]), dtype=np.float32)


def latency(n_images: int, n_captions: int, embed: int, shortlists: tuple[int, ...], repeats: int,
            workdir: Path, exhaustive_repeats: int) -> None:
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    words = ("a red blue green yellow square circle triangle diamond cross small large left right of the "
             "above below and there is are two three picture with on in").split()
    vocab = Vocabulary.from_words(words)
    models = []
    for seed, module in enumerate(("sgr", "saf")):
        torch.manual_seed(seed)
        model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=128, word_dim=32, embed_size=embed,
                                  sim_dim=embed // 2, module=module))
        model.vocab = vocab
        models.append(model.eval())
    matcher = Matcher(models, batch_size=512)
    rng = np.random.default_rng(1)
    captions = [" ".join(rng.choice(words, size=int(rng.integers(6, 14)))) for _ in range(n_captions)]
    index_dir = workdir / "gallery"
    tic = time.perf_counter()
    build_index(matcher, RandomFeatures(n_images, 36, 128), captions, index_dir, dtype="float16",
                batch_size=1024)
    build_s = time.perf_counter() - tic
    size_mb = sum(p.stat().st_size for p in index_dir.iterdir()) / 2**20
    index = open_index(index_dir, matcher=matcher, verify=False, first_stage="numpy")
    queries = [" ".join(rng.choice(words, size=10)) for _ in range(repeats)]
    print(f"\n## Query latency: text -> image over {n_images:,} generated images (36 regions, embed {embed}, "
          f"SGR + SAF ensemble, float16 index of {size_mb:,.0f} MiB built in {build_s:.0f} s; "
          f"torch threads {torch.get_num_threads()})\n")

    def timed(shortlist: int | None, count: int, first_stage: str = "numpy") -> float:
        index.first_stage = first_stage
        times = []
        for query in queries[:count]:
            tic = time.perf_counter()
            index.search_text(query, top_k=10, shortlist=shortlist)
            times.append(time.perf_counter() - tic)
        return statistics.median(times)

    timed(20, 2)  # warm-up: page in the keys, first allocations
    # Exhaustive scoring of the whole gallery would take minutes per query: its cost is linear in
    # the images re-ranked, so it is extrapolated from two shortlists measured here.
    small, large = 20, min(n_images, 2000)
    t_small, t_large = timed(small, exhaustive_repeats), timed(large, exhaustive_repeats)
    per_image = max(t_large - t_small, 0.0) / (large - small)
    exhaustive = t_small + per_image * (n_images - small)
    print("| shortlist N | median latency | vs exhaustive |")
    print("|---|---|---|")
    for shortlist in shortlists:
        seconds = timed(shortlist, repeats)
        print(f"| {shortlist} | {seconds * 1000:.0f} ms | {exhaustive / seconds:,.0f}x faster |")
    try:
        import faiss  # noqa: F401

        seconds = timed(100, repeats, first_stage="faiss")
        print(f"| 100, FAISS flat first stage | {seconds * 1000:.0f} ms | {exhaustive / seconds:,.0f}x faster |")
    except ImportError:
        pass
    print(f"| {large:,} (measured) | {t_large:.2f} s | {exhaustive / t_large:,.0f}x faster |")
    print(f"| exhaustive, all {n_images:,} images re-ranked (extrapolated: {per_image * 1000:.2f} ms per image) "
          f"| {exhaustive:.1f} s | 1x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, help="a finished `sgraf demo` folder (runs/sgr, runs/saf, data/)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--skip-recall", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--gallery", type=int, default=100_000, help="images in the latency gallery")
    parser.add_argument("--captions", type=int, default=1000, help="captions in the latency gallery")
    parser.add_argument("--embed", type=int, default=64, help="embed size of the latency models")
    parser.add_argument("--repeats", type=int, default=15, help="queries timed per shortlist size")
    parser.add_argument("--exhaustive-repeats", type=int, default=3,
                        help="queries timed for the extrapolation of exhaustive scoring")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: robust on a machine shared with other work)")
    parser.add_argument("--workdir", type=Path, help="where to write the gallery (default: a temp folder, removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if not args.skip_recall:
        if args.demo is None:
            parser.error("--demo DIR is needed for the recall part (or pass --skip-recall)")
        recall_cost(args.demo, args.split, SHORTLISTS)
    if not args.skip_latency:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sgraf-bench-search-"))
        try:
            latency(args.gallery, args.captions, args.embed, SHORTLISTS, args.repeats, workdir,
                    args.exhaustive_repeats)
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
