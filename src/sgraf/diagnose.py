"""What a model tells apart in the benchmark's families: Winoground scores and truth-aware recall.

Every family of the embedded benchmark holds a base picture and its hard negatives
(`binding`, `attribute`, `relation`, `count`), and every caption carries `false_for`, the
pictures of its family of which it is false (`sgraf.data.scenes`). With `s(i, c)` the score of
picture i and caption c:

- Winoground (Thrush et al., 2022). For each negative n of kind k and its family's base b, let
  C_b be the captions of b false for n and C_n those of n false for b. For each pair
  (c_b, c_n) in C_b x C_n: **text** correct when s(b, c_b) > s(b, c_n) and s(n, c_n) > s(n, c_b)
  (each picture prefers its own caption); **image** correct when s(b, c_b) > s(n, c_b) and
  s(n, c_n) > s(b, c_n) (each caption prefers its own picture); **group** when both. Scores
  are the means over all pairs of a kind (and over all pairs, `all`); chance is 25 / 25 /
  16.7 %. Ties count as wrong.
- Truth-aware recall. A caption is often true of a twin too ("there are two circles" of a
  binding twin), which standard recall counts as a miss. Here a picture is a correct answer to
  a caption when it is the caption's own picture, or a picture of the same family that the
  caption is not false for. i2t R@K: the share of pictures with a correct caption among their
  K best-scored captions; t2i R@K: the share of captions with a correct picture among their K
  best-scored pictures. Ties count against the model: the rank of a query is the number of
  wrong answers scoring at least as high as its best correct answer, so a constant model
  (every score equal) gets R@K = 0 where it would get 100 with ties in its favour. Beside
  the recalls, `ties` is the share of queries (%) whose best correct answer ties a wrong one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from sgraf.data.benchmark import VARIANTS
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

SCORES = ("text", "image", "group")
RECALL_AT = (1, 5, 10)


def check_false_for(scenes: Sequence[Mapping[str, Any]], where: str) -> None:
    """InputError if the scenes' captions carry no `false_for` (a data set from an earlier sgraf)."""
    if any("false_for" not in row for row in scenes):
        raise InputError(f"{where}: the captions carry no false_for (written by an earlier sgraf); regenerate "
                         "the data with sgraf generate --overwrite")


def check_captions(scenes: Sequence[Mapping[str, Any]], captions: Sequence[str], scenes_path: str,
                   captions_path: str) -> None:
    """InputError unless the scenes' captions, in order, are the lines of the caption file: scenes of
    another generation beside the captions (and features) would be scored without a word.

    The message names both files and the first line where they differ.
    """
    described = [c.strip() for row in scenes for c in row["captions"]]
    for number, (scene_caption, caption) in enumerate(zip(described, captions), start=1):
        if scene_caption != caption:
            raise InputError(f"{scenes_path} does not describe {captions_path}: line {number} of the captions is "
                             f"{caption!r}, the scenes' caption {number} is {scene_caption!r}; both files must come "
                             "from the same sgraf generate run")
    if len(described) != len(captions):
        raise InputError(f"{scenes_path} does not describe {captions_path}: the scenes hold {len(described)} "
                         f"captions, the caption file {len(captions)} lines; both files must come from the same "
                         "sgraf generate run")


def open_scenes(data_dir: str | os.PathLike, split: str, needed_by: str = "diagnose") -> tuple[list[dict], Path]:
    """The split's scenes and their path, checked before any scoring (which takes the time): the
    file is there, its captions carry `false_for`, and they describe the split's caption file
    when it is there (else the scoring names the missing file). `needed_by` names the command or
    option in the message of a folder without scenes.

    Raises:
        InputError: one line naming the file, as `check_false_for` and `check_captions`.
    """
    from sgraf.data.benchmark import load_scenes
    from sgraf.data.layout import split_files
    from sgraf.data.precomp import read_captions

    scenes_path = Path(data_dir) / f"{split}_scenes.jsonl"
    if not scenes_path.is_file():
        found = sorted(path.name[:-len("_scenes.jsonl")] for path in Path(data_dir).glob("*_scenes.jsonl"))
        raise InputError(f"--data {data_dir}: no {scenes_path.name}; {needed_by} needs a data set written by "
                         f"sgraf generate (splits with scenes there: {', '.join(found) or 'none'})")
    scenes = load_scenes(data_dir, split)
    check_false_for(scenes, str(scenes_path))
    captions_path = split_files(data_dir, split)[1]
    if captions_path.is_file():
        check_captions(scenes, read_captions(captions_path), str(scenes_path), str(captions_path))
    return scenes, scenes_path


def check_scenes(scenes: Sequence[Mapping[str, Any]], n_images: int, n_captions: int, where: str) -> int:
    """Captions per image, after checking that the scenes describe this (n_images, n_captions) split.

    Raises:
        InputError: scenes without `false_for`, or not one per picture in order, or a caption count
            that differs from the matrix's.
    """
    if not scenes:
        raise InputError(f"{where}: no scenes; diagnose needs a data set written by sgraf generate")
    check_false_for(scenes, where)
    if len(scenes) != n_images or [row.get("index") for row in scenes] != list(range(n_images)):
        raise InputError(f"{where}: {len(scenes)} scenes, but the score matrix has {n_images} images; expected "
                         "one scene per image, in order")
    per_image = {len(row["false_for"]) for row in scenes}
    if len(per_image) != 1 or n_captions != n_images * next(iter(per_image)):
        raise InputError(f"{where}: the scenes hold {sum(len(r['false_for']) for r in scenes)} captions, but the "
                         f"score matrix has {n_captions}")
    return per_image.pop()


def twin_pairs(scenes: Sequence[Mapping[str, Any]], per: int) -> Iterator[tuple[str, int, int, list[int], list[int]]]:
    """Each twin of a base picture: (kind, base b, twin n, the captions of b false of n, those of n
    false of b), caption indices in file order (`per` captions per picture). Families whose base
    another split holds are skipped."""
    bases = {row["family"]: row["index"] for row in scenes if row["variant"] == "base"}
    for row in scenes:
        n, kind = row["index"], row["variant"]
        b = bases.get(row["family"])
        if kind not in VARIANTS or b is None:  # a base, or a family whose base another split holds
            continue
        yield (kind, b, n, [b * per + j for j, wrong in enumerate(scenes[b]["false_for"]) if n in wrong],
               [n * per + j for j, wrong in enumerate(row["false_for"]) if b in wrong])


def winoground(sims: Any, scenes: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Winoground text / image / group scores per kind of negative and overall (module docstring).

    Args:
        sims: (n_images, n_captions) scores, captions in file order (image i owns captions
            i * per, ..., i * per + per - 1).
        scenes: the split's rows of `{split}_scenes.jsonl` (`index`, `family`, `variant`,
            `false_for`).

    Returns:
        ``{kind: {"text", "image", "group": fraction in 0..1 or None without pairs, "pairs": n}}``
        for each of `VARIANTS` and ``"all"``.
    """
    _, correct, pairs = winoground_counts(sims, scenes)
    correct, pairs = correct.sum(axis=0), pairs.sum(axis=0)
    return {key: {**{score: (float(correct[k, i]) / pairs[k] if pairs[k] else None)
                     for i, score in enumerate(SCORES)}, "pairs": int(pairs[k])}
            for k, key in enumerate((*VARIANTS, "all"))}


def winoground_counts(sims: Any, scenes: Sequence[Mapping[str, Any]]) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """`winoground`'s counts per family: ``(families, correct, pairs)``, `correct` of shape
    (families, kinds, 3) (text, image, group) and `pairs` (families, kinds), kinds `VARIANTS` then
    ``"all"``. A family (a base picture and its twins) is the unit its pairs share pictures in,
    which `diagnose_sims`' intervals resample."""
    sims = np.asarray(sims)
    per = check_scenes(scenes, sims.shape[0], sims.shape[1], "scenes")
    families = list(dict.fromkeys(row["family"] for row in scenes))
    slot = {family: f for f, family in enumerate(families)}
    kinds = {kind: k for k, kind in enumerate(VARIANTS)}
    correct = np.zeros((len(families), len(VARIANTS) + 1, len(SCORES)), dtype=np.int64)
    pairs = np.zeros((len(families), len(VARIANTS) + 1), dtype=np.int64)
    for kind, b, n, c_b, c_n in twin_pairs(scenes, per):
        c_b, c_n = np.array(c_b, dtype=np.int64), np.array(c_n, dtype=np.int64)
        if not (len(c_b) and len(c_n)):
            continue
        b_cb, n_cb = sims[b, c_b][:, None], sims[n, c_b][:, None]  # (|C_b|, 1)
        b_cn, n_cn = sims[b, c_n][None, :], sims[n, c_n][None, :]  # (1, |C_n|)
        text = (b_cb > b_cn) & (n_cn > n_cb)
        image = (b_cb > n_cb) & (n_cn > b_cn)
        counts = np.array([text.sum(), image.sum(), (text & image).sum()])
        f = slot[scenes[b]["family"]]
        for k in (kinds[kind], len(VARIANTS)):
            correct[f, k] += counts
            pairs[f, k] += text.size
    return families, correct, pairs


def truth_matrix(scenes: Sequence[Mapping[str, Any]], per: int) -> np.ndarray:
    """(n_images, n_captions) bool: caption c is true of picture i as far as the data set knows
    (its own picture, or one of its family it is not false for; pictures of other families: no)."""
    n = len(scenes)
    family = np.array([row["family"] for row in scenes])
    owner = np.repeat(np.arange(n), per)
    truth = family[:, None] == family[owner][None, :]
    for row in scenes:
        for j, wrong in enumerate(row["false_for"]):
            truth[list(wrong), row["index"] * per + j] = False
    truth[owner, np.arange(n * per)] = True
    return truth


def truth_recall(sims: Any, scenes: Sequence[Mapping[str, Any]],
                 ks: Sequence[int] = RECALL_AT) -> dict[str, dict[str, float]]:
    """Truth-aware R@K in percent, ties counted against the model, and the share of queries with
    such a tie: ``{"i2t": {"r1", "r5", "r10", "ties"}, "t2i": {...}}`` (module docstring)."""
    return {name: {**{f"r{k}": float(100.0 * np.mean(hits[:, j])) for j, k in enumerate(ks)},
                   "ties": float(100.0 * np.mean(tied))}
            for name, (hits, tied) in truth_hits(sims, scenes, ks).items()}


def truth_hits(sims: Any, scenes: Sequence[Mapping[str, Any]],
               ks: Sequence[int] = RECALL_AT) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per query, whether truth-aware R@K counts it: ``{"i2t": (hits (n_images, len(ks)) bool,
    ties (n_images,) bool), "t2i": (hits (n_captions, len(ks)), ties (n_captions,))}``."""
    from sgraf.metrics import score_array

    sims = score_array(sims)
    per = check_scenes(scenes, sims.shape[0], sims.shape[1], "scenes")
    truth = truth_matrix(scenes, per)
    result = {}
    for name, axis in (("i2t", 1), ("t2i", 0)):
        best = np.expand_dims(np.where(truth, sims, -np.inf).max(axis=axis), axis)   # best correct answer
        ranks = ((sims >= best) & ~truth).sum(axis=axis)      # wrong answers at or above it
        tied = ((sims == best) & ~truth).any(axis=axis)
        result[name] = (ranks[:, None] < np.asarray(ks)[None, :], tied)
    return result


def diagnose_sims(sims: Any, scenes: Sequence[Mapping[str, Any]], bootstrap: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """Winoground scores per kind, plus standard and truth-aware recall, of a score matrix.

    Args:
        sims: (n_images, n_captions) scores.
        scenes: the split's scenes (`winoground`).
        bootstrap: resamples of the families for 95 % intervals of every score (None: none).
        seed: the resampling's seed.

    Returns:
        `winoground`'s dict, with ``"recall"``: ``{"standard": {"i2t", "t2i"}, "truth": {"i2t",
        "t2i"}}`` (R@1/5/10 in percent; standard as `sgraf.metrics.evaluate_sims`); with
        `bootstrap`, ``"intervals"``: ``{kind: {"text", "image", "group": [low, high] or None},
        "truth": {"i2t": {"r1", "r5", "r10"}, "t2i": {...}}, "resamples", "level", "seed",
        "unit": "family"}`` (Winoground as fractions, recall in percent, like the figures).
    """
    from sgraf import metrics

    result: dict[str, Any] = winoground(sims, scenes)
    per = check_scenes(scenes, *np.shape(sims), "scenes")
    standard = metrics.evaluate_sims(sims, caps_per_image=per)
    result["recall"] = {
        "standard": {d: {f"r{k}": standard[d][f"r{k}"] for k in RECALL_AT} for d in ("i2t", "t2i")},
        "truth": truth_recall(sims, scenes),
    }
    if bootstrap is not None:
        result["intervals"] = family_intervals(sims, scenes, bootstrap, seed)
    return result


def family_intervals(sims: Any, scenes: Sequence[Mapping[str, Any]], resamples: int = 1000,
                     seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """Bootstrap intervals of the Winoground scores and the truth-aware recall, the families
    resampled (`sgraf.significance.ratio_intervals`): a family's pictures appear in all of its
    pairs and queries, so they are drawn together. See `diagnose_sims` for the shape."""
    from sgraf.significance import ratio_intervals

    bounds = ratio_intervals(*_family_columns(sims, scenes), resamples, level, seed)
    kinds = (*VARIANTS, "all")
    out: dict[str, Any] = {kind: {score: bounds[k * len(SCORES) + i] for i, score in enumerate(SCORES)}
                           for k, kind in enumerate(kinds)}
    recall = bounds[len(kinds) * len(SCORES):]
    out["truth"] = {name: {f"r{k}": None if recall[d * 3 + j] is None else [100.0 * v for v in recall[d * 3 + j]]
                           for j, k in enumerate(RECALL_AT)} for d, name in enumerate(("i2t", "t2i"))}
    return {**out, "resamples": resamples, "level": level, "seed": seed, "unit": "family"}


def _family_columns(sims: Any, scenes: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(families, columns) numerators and denominators of every score: (kind, score) for each kind
    and score (correct pairs, pairs), then truth-aware i2t and t2i R@K (hits, queries)."""
    families, correct, pairs = winoground_counts(sims, scenes)
    numerators = [correct.reshape(len(families), -1)]
    denominators = [np.repeat(pairs, len(SCORES), axis=1)]
    per = len(scenes[0]["false_for"])
    slot = {family: f for f, family in enumerate(families)}
    image_family = np.array([slot[row["family"]] for row in scenes])
    owners = {"i2t": image_family, "t2i": np.repeat(image_family, per)}
    for name, (hits, _) in truth_hits(sims, scenes).items():
        for j in range(len(RECALL_AT)):
            numerators.append(np.bincount(owners[name], weights=hits[:, j], minlength=len(families))[:, None])
            denominators.append(np.bincount(owners[name], minlength=len(families))[:, None])
    return np.hstack(numerators), np.hstack(denominators)


def compare_families(sims_a: Any, sims_b: Any, scenes: Sequence[Mapping[str, Any]], resamples: int = 10000,
                     seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """Two models' Winoground scores and truth-aware recall on the same split, paired by family
    (`sgraf compare --diagnose`): for every score, A, B, A - B, a bootstrap interval of A - B
    (`significance.ratio_intervals` over the families' differences) and a randomization-test p
    (`significance.paired_ratio_p`, each family's difference counted with a random sign).

    Returns:
        ``{kind: {score: {"a", "b", "difference", "interval", "p"} or None without pairs}, "truth":
        {"i2t": {"r1", "r5", "r10"}, "t2i": {...}}, "resamples", "level", "seed", "unit": "family"}``,
        Winoground as fractions, recall in percent.
    """
    from sgraf.significance import paired_ratio_p, ratio_intervals

    columns = [_family_columns(sims, scenes) for sims in (sims_a, sims_b)]
    (num_a, den), (num_b, _) = columns
    bounds = ratio_intervals(num_a - num_b, den, resamples, level, seed)
    ps = paired_ratio_p(num_a - num_b, den, resamples, seed)
    totals = den.sum(axis=0)

    def entry(j: int, scale: float) -> dict[str, Any] | None:
        if not totals[j]:
            return None
        a, b = scale * num_a[:, j].sum() / totals[j], scale * num_b[:, j].sum() / totals[j]
        return {"a": float(a), "b": float(b), "difference": float(a - b),
                "interval": [scale * v for v in bounds[j]], "p": ps[j]}

    out: dict[str, Any] = {kind: {score: entry(k * len(SCORES) + i, 1.0) for i, score in enumerate(SCORES)}
                           for k, kind in enumerate((*VARIANTS, "all"))}
    first = (len(VARIANTS) + 1) * len(SCORES)
    out["truth"] = {name: {f"r{k}": entry(first + d * len(RECALL_AT) + j, 100.0) for j, k in enumerate(RECALL_AT)}
                    for d, name in enumerate(("i2t", "t2i"))}
    return {**out, "resamples": resamples, "level": level, "seed": seed, "unit": "family"}


def format_family_comparison(result: Mapping[str, Any]) -> str:
    """The main rows of `compare_families` (each kind's group score, all pairs' text and image
    scores, truth-aware R@1) as a table like `significance.format_comparison`'s; `--json` has all."""
    from sgraf.significance import p_text

    level = f"{100 * result['level']:g} %"
    lines = [f"paired by family ({result['resamples']} resamples, seed {result['seed']}):",
             f"{'':<16}{'A':>8}{'B':>8}{'A - B':>8}  {level + ' interval':<18}{'p':>9}"]
    rows = [(f"{kind} group", result[kind]["group"], 100.0) for kind in (*VARIANTS, "all")]
    rows += [(f"all {score}", result["all"][score], 100.0) for score in ("text", "image")]
    rows += [(f"truth {d} R@1", result["truth"][d]["r1"], 1.0) for d in ("i2t", "t2i")]
    for label, row, scale in rows:
        if row is None:
            lines.append(f"{label:<16}{'-':>8}{'-':>8}{'-':>8}  (no pairs)")
            continue
        low, high = (scale * v for v in row["interval"])
        lines.append(f"{label:<16}{scale * row['a']:>8.1f}{scale * row['b']:>8.1f}{scale * row['difference']:>+8.1f}  "
                     f"{f'[{low:+.1f}, {high:+.1f}]':<18}{p_text(row['p'], result['resamples']):>9}")
    return "\n".join(lines)


def format_report(result: Mapping[str, Any]) -> str:
    """A plain-text table of `diagnose_sims`' result."""

    def percent(value: float | None) -> str:
        return "   -" if value is None else f"{100 * value:5.1f}"

    lines = [f"{'kind':<10} {'text':>6} {'image':>6} {'group':>6} {'pairs':>7}"]
    for kind in (*VARIANTS, "all"):
        row = result[kind]
        lines.append(f"{kind:<10} {percent(row['text']):>6} {percent(row['image']):>6} "
                     f"{percent(row['group']):>6} {row['pairs']:>7}")
    lines.append(f"{'chance':<10} {25.0:>6.1f} {25.0:>6.1f} {16.7:>6.1f}")
    if "recall" in result:
        lines.append("")
        lines.append(f"{'recall':<16} {'R@1':>6} {'R@5':>6} {'R@10':>6}")
        for name, recall in result["recall"].items():
            for direction in ("i2t", "t2i"):
                r = recall[direction]
                lines.append(f"{name + ' ' + direction:<16} {r['r1']:6.1f} {r['r5']:6.1f} {r['r10']:6.1f}")
        truth = result["recall"].get("truth", {})
        if any(truth.get(d, {}).get("ties") for d in ("i2t", "t2i")):
            lines.append(f"truth-aware recall counts ties against the model; queries whose best correct answer "
                         f"ties a wrong one: i2t {truth['i2t']['ties']:.1f} %, t2i {truth['t2i']['ties']:.1f} %")
    if "intervals" in result:
        lines += ["", _format_intervals(result["intervals"])]
    return "\n".join(lines)


def _format_intervals(intervals: Mapping[str, Any]) -> str:
    def bounds(value: list[float] | None, scale: float) -> str:
        return "-" if value is None else f"[{scale * value[0]:.1f}, {scale * value[1]:.1f}]"

    lines = [f"{100 * intervals['level']:g} % intervals ({intervals['resamples']} resamples of the families, seed "
             f"{intervals['seed']}):", f"{'kind':<10} {'text':>14} {'image':>14} {'group':>14}"]
    for kind in (*VARIANTS, "all"):
        lines.append(f"{kind:<10} " + " ".join(f"{bounds(intervals[kind][score], 100):>14}" for score in SCORES))
    for direction in ("i2t", "t2i"):
        lines.append(f"truth {direction:<4} " + "  ".join(f"R@{k} {bounds(intervals['truth'][direction][f'r{k}'], 1)}"
                                                        for k in RECALL_AT))
    return "\n".join(lines)
