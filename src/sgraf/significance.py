"""How sure a recall is: bootstrap intervals, and whether one model beats another on a split.

A test split is a sample: Flickr30K's 1,000 test images give R@1 figures whose run-to-run and
split-to-split spread is often larger than the gaps papers report. This module answers two
questions from score matrices alone (no scoring again):

- `recall_intervals`: a percentile bootstrap interval of every recall and of rsum.
- `compare`: two models' matrices of the same split, paired: each metric's difference, a
  bootstrap interval of the difference, and the p-value of a paired randomization test.
- `ratio_intervals`: the same bootstrap for shares of items grouped in clusters (`sgraf
  diagnose`'s Winoground pairs, grouped by the benchmark's families).
- `chance_rsum`: what scores drawn at random give on a split of that size, and how high
  such scores can reach by luck: a model not above that has learnt nothing measurable.

The unit resampled is an image with its captions: an image is one image-to-text query and its
captions (five) are text-to-image queries, and they are not independent of each other. Every
recall is a mean over the images of a per-image quantity (`query_hits`): whether the image's
first true caption is within the top K, and the share of its captions whose image is within
the top K. So a resample is a vector of counts (how often each image is drawn) times that
(images x 6) table, and thousands of resamples are one matrix product. The gallery stays the
split: ranks are those of the whole matrix (or of each fold's block, with `folds`, where the
images are drawn within each fold, as MSCOCO 1K averages over its folds).

The randomization test flips, for each image independently, which model's row of the table it
counts (the paired null hypothesis: the two models are exchangeable on every image), and gives
p = (1 + #{flipped |difference| >= observed |difference|}) / (1 + resamples), never 0.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import numpy as np

from sgraf import metrics
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

KEYS = ("r1", "r5", "r10")
BATCH = 256   # resamples drawn at once: 256 x n_images counts (5,000 images: 10 MB)


def query_hits(sims: Any, folds: int = 1, caps_per_image: int | None = None) -> np.ndarray:
    """Per image, what its queries contribute to each recall: an (n_images, 6) float64 table,
    columns i2t R@1, R@5, R@10 (1 where the image's best true caption ranks within K, else 0)
    and t2i R@1, R@5, R@10 (the share of its captions whose image ranks within K). 100 x the
    column means are `metrics.evaluate_sims`'s recalls (with `folds`, ranks within each fold).

    Raises:
        InputError: a malformed matrix, or images that do not split into `folds` equal folds.
    """
    sims = metrics.as_score_matrix(sims)
    n_img, n_cap = sims.shape
    cpi = metrics.infer_caps_per_image(n_img, n_cap, caps_per_image)
    folds = _folds(folds, n_img)
    size = n_img // folds
    table = np.empty((n_img, 6), dtype=np.float64)
    for k in range(folds):
        rows, cols = slice(k * size, (k + 1) * size), slice(k * size * cpi, (k + 1) * size * cpi)
        block = sims[rows, cols]
        i2t = np.asarray(metrics.i2t_ranks(block, cpi)[0])
        t2i = np.asarray(metrics.t2i_ranks(block, cpi)[0]).reshape(size, cpi)
        for j, limit in enumerate((1, 5, 10)):
            table[rows, j] = i2t < limit
            table[rows, 3 + j] = (t2i < limit).mean(axis=1)
    return table


def _folds(folds: Any, n_img: int) -> int:
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 1:
        raise InputError(f"folds must be a positive integer, got {folds!r}")
    if n_img % folds:
        raise InputError(f"folds: {n_img} images do not split into {folds} equal folds")
    return int(folds)


def check_resamples(resamples: Any, level: Any = None) -> None:
    """InputError for a resample count that is not a positive integer, a `level` not in (0, 1), or
    fewer resamples than a `level` interval needs (`min_resamples`); a warning below `FEW_RESAMPLES`.
    Commands call it before any work (a 1-resample interval, one draw that need not hold the
    estimate, had been printed after a whole evaluation)."""
    if isinstance(resamples, bool) or not isinstance(resamples, (int, np.integer)) or resamples < 1:
        raise InputError(f"resamples must be a positive integer, got {resamples!r}")
    if level is not None:
        _check_level(level)
        if resamples < min_resamples(level):
            raise InputError(f"{resamples} resamples are too few for a {100 * level:g} % interval: each of its tails "
                             f"should hold at least one resample (N (1 - level) / 2 >= 1), so at least "
                             f"{min_resamples(level)} ({FEW_RESAMPLES} or more is usual)")
    if resamples < FEW_RESAMPLES:
        _warn_few(int(resamples))


def min_resamples(level: float) -> int:
    """The fewest resamples N whose percentile interval at `level` expects at least one resample in
    each tail beyond its ends, N (1 - level) / 2 >= 1: 2 / (1 - level), 40 for 95 %. With fewer,
    the ends are interpolated between the outermost draws alone, and one resample makes the
    interval a point."""
    return math.ceil(2.0 / (1.0 - level) - 1e-9)


def _check_level(level: Any) -> None:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise InputError(f"level must be a number between 0 and 1 (0.95 for 95 %), got {level!r}")


FEW_RESAMPLES = 1000    # below: an interval's ends, and a p-value, move with the seed
LEVEL = 0.95            # the intervals' coverage unless one is asked for (`sgraf evaluate/diagnose --bootstrap`)


@functools.lru_cache(maxsize=None)
def _warn_few(resamples: int) -> None:
    """Once per count: with few resamples the figures are rough (1 gives an interval of one draw,
    which need not hold the estimate)."""
    logger.warning("%d resample%s: the intervals' ends (and a comparison's p-value, at least 1/%d) move from one "
                   "seed to another; %d or more is usual", resamples, "" if resamples == 1 else "s",
                   resamples + 1, FEW_RESAMPLES)


def _draws(rng: np.random.Generator, count: int, n: int, folds: int = 1) -> np.ndarray:
    """(count, n) bootstrap weights: how often each of `n` units is drawn in each of `count`
    resamples, each of `folds` equal consecutive folds drawn within itself (`n // folds` draws
    among its units). Counted by one bincount over (resample, unit) slots: 8x faster than
    numpy's multinomial."""
    size = n // folds
    drawn = rng.integers(0, size, size=(count, folds, size)) + (np.arange(folds) * size)[:, None]
    slots = drawn.reshape(count, -1) + (np.arange(count) * n)[:, None]
    return np.bincount(slots.ravel(), minlength=count * n).reshape(count, n)


def _resampled_means(table: np.ndarray, folds: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, columns) means of `table`'s rows over bootstrap resamples of its images,
    drawn within each of `folds` equal consecutive folds."""
    rng = np.random.default_rng(seed)
    n = len(table)
    out = np.empty((resamples, table.shape[1]), dtype=np.float64)
    for start in range(0, resamples, BATCH):
        count = min(BATCH, resamples - start)
        out[start:start + count] = _draws(rng, count, n, folds) @ table / n
    return out


def ratio_intervals(numerators: Any, denominators: Any, resamples: int = 1000, level: float = LEVEL,
                    seed: int = 0) -> list[list[float] | None]:
    """Percentile bootstrap intervals of ratios of sums over clusters, the clusters resampled.

    For scores that are a share of items grouped in clusters (`sgraf diagnose`: Winoground pairs
    and truth-aware queries, grouped by the benchmark's families, whose pictures they share):
    the score of column j is sum(numerators[:, j]) / sum(denominators[:, j]).

    Args:
        numerators: (clusters, columns) counts (e.g. correct pairs per family and kind).
        denominators: (clusters, columns) totals (pairs per family and kind).
        resamples: bootstrap resamples of the clusters.
        level: the intervals' coverage.
        seed: the resampling's seed.

    Returns:
        per column [low, high] (as fractions, like the scores), or None for a column without
        items; resamples that draw no item of a column are left out of its interval.
    """
    check_resamples(resamples, level)
    numerators = np.asarray(numerators, dtype=np.float64)
    denominators = np.asarray(denominators, dtype=np.float64)
    if numerators.ndim != 2 or numerators.shape != denominators.shape:
        raise InputError(f"numerators and denominators must be (clusters, columns) arrays of one shape, got "
                         f"{numerators.shape} and {denominators.shape}")
    rng = np.random.default_rng(seed)
    n, columns = numerators.shape
    ratios = np.empty((resamples, columns), dtype=np.float64)
    for start in range(0, resamples, BATCH):
        count = min(BATCH, resamples - start)
        weights = _draws(rng, count, n)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios[start:start + count] = (weights @ numerators) / (weights @ denominators)
    tail = 100.0 * (1.0 - level) / 2.0
    out: list[list[float] | None] = []
    for j in range(columns):
        values = ratios[:, j][np.isfinite(ratios[:, j])]
        out.append(None if not len(values) or not denominators[:, j].any()
                   else [float(v) for v in np.percentile(values, [tail, 100.0 - tail])])
    return out


def paired_ratio_p(differences: Any, denominators: Any, resamples: int = 10000,
                   seed: int = 0) -> list[float | None]:
    """Randomization-test p-values of two models' shares of the same clustered items.

    Column j's difference of the shares is sum(differences[:, j]) / sum(denominators[:, j]), with
    `differences` the per-cluster counts of model A minus model B on the same items (their
    bootstrap interval is `ratio_intervals(differences, denominators)`). Each cluster's difference
    is counted with a random sign, as `compare` flips images; p = (1 + reached) / (1 + flips),
    None for a column without items.
    """
    check_resamples(resamples)
    differences = np.asarray(differences, dtype=np.float64)
    totals = np.asarray(denominators, dtype=np.float64).sum(axis=0)
    if differences.ndim != 2 or differences.shape[1] != totals.shape[0]:
        raise InputError(f"differences and denominators must be (clusters, columns) arrays of one shape, got "
                         f"{differences.shape} and {np.shape(denominators)}")
    rng = np.random.default_rng([seed, 1])
    reference = np.abs(differences.sum(axis=0))
    beyond = np.zeros(differences.shape[1], dtype=np.int64)
    for start in range(0, resamples, BATCH):
        count = min(BATCH, resamples - start)
        signs = rng.integers(0, 2, size=(count, len(differences)), dtype=np.int8) * 2.0 - 1.0
        # a tolerance, so that a flip equal to the observed value up to rounding counts as reaching it
        beyond += (np.abs(signs @ differences) >= reference - 1e-9).sum(axis=0)
    return [None if total == 0 else float((1.0 + reached) / (1.0 + resamples))
            for reached, total in zip(beyond, totals)]


def _summary(values: np.ndarray) -> dict[str, Any]:
    """{"i2t": {r1, r5, r10}, "t2i": {...}, "rsum"} of a (..., 6) array's last axis, x 100."""
    values = 100.0 * np.asarray(values)
    return {"i2t": {key: values[..., j] for j, key in enumerate(KEYS)},
            "t2i": {key: values[..., 3 + j] for j, key in enumerate(KEYS)},
            "rsum": values.sum(axis=-1)}


def _figures(table: np.ndarray, folds: int, cpi: int) -> dict[str, Any]:
    """The recalls and rsum of a `query_hits` table in `metrics.evaluate_sims`'s arithmetic (the
    authors': 100 x hits / queries per fold, rsum summed in their order, then the folds' mean),
    so that A and B read as `sgraf evaluate` prints them, without counting the ranks again."""
    size = len(table) // folds
    rows = []
    for k in range(folds):
        part = table[k * size:(k + 1) * size]
        i2t = [100.0 * int(round(part[:, j].sum())) / size for j in range(3)]
        t2i = [100.0 * int(round(part[:, 3 + j].sum() * cpi)) / (size * cpi) for j in range(3)]
        rows.append(i2t + t2i + [i2t[0] + i2t[1] + i2t[2] + t2i[0] + t2i[1] + t2i[2]])
    means = rows[0] if folds == 1 else np.array(rows, dtype=np.float64).mean(axis=0)
    return {"i2t": {key: float(means[j]) for j, key in enumerate(KEYS)},
            "t2i": {key: float(means[3 + j]) for j, key in enumerate(KEYS)}, "rsum": float(means[6])}


def _interval(samples: np.ndarray, level: float) -> list[float]:
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return [float(low), float(high)]


def _map(summary: dict[str, Any], function: Any) -> dict[str, Any]:
    return {"i2t": {k: function(v) for k, v in summary["i2t"].items()},
            "t2i": {k: function(v) for k, v in summary["t2i"].items()},
            "rsum": function(summary["rsum"])}


def recall_intervals(sims: Any, folds: int = 1, resamples: int = 1000, level: float = LEVEL, seed: int = 0,
                     caps_per_image: int | None = None) -> dict[str, Any]:
    """Percentile bootstrap intervals of the recalls and rsum of a score matrix (see the module).

    Args:
        sims: (n_images, n_captions) scores.
        folds: as `metrics.evaluate_sims` (images drawn within each fold).
        resamples: bootstrap resamples of the images.
        level: the intervals' coverage (0.95: the 2.5 and 97.5 percentiles).
        seed: the resampling's seed (same seed, same intervals).
        caps_per_image: captions per image (default: n_captions // n_images).

    Returns:
        ``{"i2t": {"r1": [low, high], ...}, "t2i": {...}, "rsum": [low, high], "resamples",
        "level", "seed", "unit": "image"}``.
    """
    check_resamples(resamples, level)
    table = query_hits(sims, folds, caps_per_image)
    samples = _summary(_resampled_means(table, _folds(folds, len(table)), resamples, seed))
    return {**_map(samples, lambda s: _interval(s, level)), "resamples": resamples, "level": level, "seed": seed,
            "unit": "image"}


def compare(sims_a: Any, sims_b: Any, folds: int = 1, resamples: int = 10000, level: float = LEVEL, seed: int = 0,
            caps_per_image: int | None = None) -> dict[str, Any]:
    """Model A against model B on one split, paired by image (see the module).

    Args:
        sims_a: model A's (n_images, n_captions) scores.
        sims_b: model B's scores of the same split.
        folds: as `recall_intervals`.
        resamples: bootstrap resamples, and flips of the randomization test.
        level: the interval's coverage.
        seed: the resampling's seed.
        caps_per_image: captions per image (default: n_captions // n_images).

    Returns:
        ``{"a": metrics, "b": metrics, "difference": A - B, "interval": [low, high] of the
        difference, "p": two-sided p-value, ..., "resamples", "level", "seed", "unit"}``, each
        metrics entry shaped ``{"i2t": {"r1", "r5", "r10"}, "t2i": {...}, "rsum"}``.

    Raises:
        InputError: matrices of different shapes, or a bad argument.
    """
    check_resamples(resamples, level)
    a = metrics.as_score_matrix(sims_a, "the first score matrix")
    b = metrics.as_score_matrix(sims_b, "the second score matrix")
    if tuple(a.shape) != tuple(b.shape):
        raise InputError(f"score matrices of shapes {tuple(a.shape)} and {tuple(b.shape)}: two models are compared "
                         "on one split")
    table_a, table_b = query_hits(a, folds, caps_per_image), query_hits(b, folds, caps_per_image)
    n = len(table_a)
    folds = _folds(folds, n)
    difference = table_a - table_b
    cpi = metrics.infer_caps_per_image(a.shape[0], a.shape[1], caps_per_image)
    figures = [_figures(table, folds, cpi) for table in (table_a, table_b)]
    # bootstrap of the difference: the same images drawn for both models
    boot = _summary(_resampled_means(difference, folds, resamples, seed))
    # randomization: each image's row of the difference (the six recalls and rsum) counted with a
    # random sign; every image is one item of each column
    p = paired_ratio_p(np.column_stack([difference, difference.sum(axis=1)]), np.ones((n, 7)), resamples, seed)
    p_summary = {"i2t": {key: float(p[j]) for j, key in enumerate(KEYS)},
                 "t2i": {key: float(p[3 + j]) for j, key in enumerate(KEYS)}, "rsum": float(p[6])}
    return {
        "a": figures[0],
        "b": figures[1],
        "difference": {"i2t": {k: figures[0]["i2t"][k] - figures[1]["i2t"][k] for k in KEYS},
                       "t2i": {k: figures[0]["t2i"][k] - figures[1]["t2i"][k] for k in KEYS},
                       "rsum": figures[0]["rsum"] - figures[1]["rsum"]},
        "interval": _map(boot, lambda s: _interval(s, level)),
        "p": p_summary,
        "n_images": int(a.shape[0]), "n_captions": int(a.shape[1]), "folds": folds,
        "resamples": resamples, "level": level, "seed": seed, "unit": "image",
    }


def format_intervals(intervals: dict[str, Any]) -> str:
    """The intervals of `recall_intervals` as lines under `metrics.format_table`'s table."""
    level = f"{100 * intervals['level']:g} %"
    lines = [f"{level} bootstrap intervals ({intervals['resamples']} resamples of the images, seed "
             f"{intervals['seed']}):"]
    for direction in ("i2t", "t2i"):
        lines.append(f"{direction:<8}" + "  ".join(f"R@{key[1:]} [{low:.1f}, {high:.1f}]"
                                                  for key, (low, high) in intervals[direction].items()))
    low, high = intervals["rsum"]
    lines.append(f"rsum    [{low:.1f}, {high:.1f}]")
    return "\n".join(lines)


def format_comparison(result: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    """A table of `compare`: each metric for A and B, A - B, its interval and its p-value."""
    level = f"{100 * result['level']:g} %"
    first, second = names
    lines = [f"{result['n_images']} images x {result['n_captions']} captions"
             + (f", mean over {result['folds']} folds" if result["folds"] > 1 else ""),
             f"A: {first}", f"B: {second}",
             f"{'':<12}{'A':>8}{'B':>8}{'A - B':>8}  {level + ' interval':<18}{'p':>9}"]
    rows = [(f"{d} R@{k[1:]}", d, k) for d in ("i2t", "t2i") for k in KEYS] + [("rsum", "rsum", None)]
    for label, direction, key in rows:
        def pick(part: str) -> Any:
            return result[part][direction] if key is None else result[part][direction][key]
        low, high = pick("interval")
        lines.append(f"{label:<12}{pick('a'):>8.1f}{pick('b'):>8.1f}{pick('difference'):>+8.1f}  "
                     f"{f'[{low:+.1f}, {high:+.1f}]':<18}{p_text(pick('p'), result['resamples']):>9}")
    lines.append(f"(paired by image: bootstrap interval of A - B and randomization-test p over "
                 f"{result['resamples']} resamples, seed {result['seed']})")
    return "\n".join(lines)


def p_text(p: float, resamples: int) -> str:
    """A p-value; at its floor 1 / (1 + resamples) (no flip reached the observed difference) '<='."""
    text = f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"
    return "<=" + text if p <= 1.0000001 / (1.0 + resamples) else text


def chance_rsum(n_images: int, caps_per_image: int = 5, draws: int = 2000, level: float = LEVEL,
                seed: int = 0) -> dict[str, float]:
    """rsum of random scores on a split of `n_images` images with `caps_per_image` captions each
    (ranked as one gallery, ``folds=1``): its expectation, and the `level` quantile of `draws`
    random draws (``{"mean", "high", "level", "draws"}``).

    The expectation is exact: an image's first true caption is the best of `caps_per_image`
    places among the `M` captions (``P(best > r) = C(M - 1 - r, c) / C(M, c)``) and a caption's
    image is anywhere among the images alike. The draws keep what links the two directions: the
    true pairs' scores are drawn (uniform), and given them an image's rank is the number of its
    `M - c` other captions scoring above its best true one, binomial, and a caption's the number
    of the `n_images - 1` other images above it, binomial. Each such pair of counts shares one
    score, taken as independent: the quantiles agree with those of whole random matrices ranked
    by `sgraf.metrics` (tests/test_significance.py) at a fraction of the cost (2,000 draws of
    300 images: 0.5 s).
    """
    n_images, c = int(n_images), int(caps_per_image)
    if n_images < 1 or c < 1:
        raise InputError(f"chance_rsum needs at least one image and one caption per image, got {n_images} "
                         f"and {c}")
    if isinstance(draws, bool) or not isinstance(draws, (int, np.integer)) or draws < 1:
        raise InputError(f"draws must be a positive integer, got {draws!r}")
    _check_level(level)
    m = n_images * c
    ks = np.array([1, 5, 10])
    beyond = np.ones(len(ks))                  # P(best >= k) for the image's first true caption
    for i in range(c):
        beyond *= np.clip(m - ks - i, 0, None) / (m - i)
    mean = 100.0 * float((1.0 - beyond).sum() + (np.minimum(ks, n_images) / n_images).sum())
    rng = np.random.default_rng(seed)
    totals = np.empty(draws)
    for start in range(0, draws, BATCH):
        count = min(BATCH, draws - start)
        own = rng.random((count, n_images, c))
        best = rng.binomial(m - c, 1.0 - own.max(axis=2))               # 0-based rank of each image's best
        ranks = rng.binomial(n_images - 1, 1.0 - own.reshape(count, m))  # 0-based rank of each caption's image
        totals[start:start + count] = sum(100.0 * ((best < k).mean(axis=1) + (ranks < k).mean(axis=1))
                                          for k in ks)
    return {"mean": mean, "high": float(np.quantile(totals, level)), "level": float(level), "draws": int(draws)}
