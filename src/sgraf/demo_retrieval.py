"""The demo's retrieval pictures: results framed by caption truth, queries picked by a stated rule.

A retrieved picture is a **hit** when the caption is true of it: it is the caption's own
picture, or a picture of the caption's family that the caption is not false for (`false_for`
in `{split}_scenes.jsonl`; `sgraf.diagnose.truth_matrix`). That is the truth-aware recall's
notion of a correct result, so a twin that fits the caption ("the diamond is red and the
square is orange" of a twin with the same colours) is framed as a hit, not as a miss.

Which queries are shown: every test caption (text -> image) and every test picture (image ->
text) is ranked by the rank of its first hit in the score matrix the demo's table is computed
from (the truth-aware rank, ties in the model's favour as `sgraf.diagnose.truth_recall` counts
them); the rows are the queries at evenly spaced quantiles of that order (for 4 rows: 12.5,
37.5, 62.5 and 87.5 %, ties by index). The rows therefore show hits at rank 1, lower hits and
misses about as often as the recall counts them. Their results come from the gallery index
with every picture or caption re-ranked (no shortlist), the ranking the recall measures.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sgraf.atomic_write import atomic_path

# what a result is to its query; the frame's colour and line style say it (colour-blind safe)
OWN, TRUE, FALSE = "own", "true", "false"
STYLE = {OWN: ("#1a9850", "solid"), TRUE: ("#1a9850", "dashed"), FALSE: ("#d73027", "dotted")}
MEANING = {OWN: "hit: the caption's own picture",
           TRUE: "hit: a twin the caption is also true of",
           FALSE: "miss: the caption is false of it"}
RULE = ("queries at the 12.5/37.5/62.5/87.5 % quantiles of the rank of their first hit "
        "over all test queries, every candidate scored (as the table's recall)")


def result_kind(truth: np.ndarray, image: int, caption: int, per: int) -> str:
    """OWN, TRUE or FALSE: what picture `image` is to caption `caption`.

    Args:
        truth: (n_images, n_captions) bool, `sgraf.diagnose.truth_matrix`.
        image: a picture of the split.
        caption: a caption of the split (caption c belongs to picture c // per).
        per: captions per picture.
    """
    if caption // per == image:
        return OWN
    return TRUE if truth[image, caption] else FALSE


def first_hit_rank(kinds: Sequence[str]) -> float:
    """1-based rank of the first hit among a query's results in order; inf when none is a hit."""
    return next((rank for rank, kind in enumerate(kinds, start=1) if kind != FALSE), float("inf"))


def truth_ranks(sims: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-based rank of each query's first hit in a score matrix (ties in the model's favour).

    Args:
        sims: (n_images, n_captions) scores.
        truth: (n_images, n_captions) bool, `sgraf.diagnose.truth_matrix`.

    Returns:
        (per caption: the rank of its best-scored true picture, per picture: of its best true caption).
    """
    from sgraf.metrics import score_array

    sims = score_array(sims)
    best_image = np.where(truth, sims, -np.inf).max(axis=0)      # (n_captions,)
    best_caption = np.where(truth, sims, -np.inf).max(axis=1)    # (n_images,)
    return (sims > best_image[None, :]).sum(axis=0) + 1, (sims > best_caption[:, None]).sum(axis=1) + 1


def pick_queries(ranks: Sequence[float], count: int) -> list[int]:
    """The queries at evenly spaced quantiles of their first-hit rank (module docstring).

    Args:
        ranks: per query, `first_hit_rank` of its results.
        count: rows wanted (at most len(ranks)).

    Returns:
        Query indices, best rank first.
    """
    order = sorted(range(len(ranks)), key=lambda q: (ranks[q], q))
    count = min(count, len(order))
    return [order[int((2 * row + 1) * len(order) / (2 * count))] for row in range(count)]


@dataclass
class Row:
    """One query of a picture: what was asked and its results, each with its kind."""

    query: Any          # the caption text (text -> image) or the picture id (image -> text)
    own: int            # the caption's picture, or the picture itself
    results: list[tuple[int, float, str, str]]   # (id, score, kind, text: caption or "")
    quantile: float     # where the query sits in the order of first-hit ranks (0..1)


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))


def _legend(figure: Any, kinds: Sequence[str]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=STYLE[k][0], linestyle=STYLE[k][1], linewidth=3, label=MEANING[k])
               for k in kinds]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)


def draw_text_to_image(rows: Sequence[Row], pictures: Sequence[np.ndarray | None], path: Path,
                       title: str) -> str:
    """Each row: the caption, then its top results framed by caption truth (`pictures[i]`: the
    thumbnail of each result, in row order; None draws a grey square)."""
    from sgraf.plotting import pyplot

    plt = pyplot()

    top_k = max(len(row.results) for row in rows)
    figure, axes = plt.subplots(len(rows), 1 + top_k, figsize=(13, 2.5 * len(rows) + 1.0), squeeze=False,
                                gridspec_kw={"width_ratios": [2.2] + [1] * top_k})
    thumbnails = iter(pictures)
    for r, row in enumerate(rows):
        axes[r, 0].axis("off")
        rank = first_hit_rank([kind for _, _, kind, _ in row.results])
        said = f"first hit at #{rank}" if rank != float("inf") else f"no hit in the top {top_k}"
        axes[r, 0].text(0, 0.5, f"{_wrap(row.query, 34)}\n\n({said}; quantile {100 * row.quantile:.1f} %)",
                        fontsize=9, va="center", ha="left")
        for c in range(top_k):
            axis = axes[r, 1 + c]
            if c >= len(row.results):
                axis.axis("off")
                continue
            image, score, kind, _ = row.results[c]
            picture = next(thumbnails)
            axis.imshow(picture if picture is not None else np.full((8, 8, 3), 230, np.uint8))
            axis.set_xticks([])
            axis.set_yticks([])
            colour, style = STYLE[kind]
            for spine in axis.spines.values():
                spine.set_edgecolor(colour)
                spine.set_linestyle(style)
                spine.set_linewidth(3.5)
            axis.set_title(f"#{c + 1}  image {image}\nscore {score:.3f}", fontsize=8, color=colour)
    figure.suptitle(title, fontsize=11)
    _legend(figure, (OWN, TRUE, FALSE))
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=80)
    plt.close(figure)
    return path.name


def draw_image_to_text(rows: Sequence[Row], pictures: Sequence[np.ndarray | None], path: Path,
                       title: str) -> str:
    """Each row: the picture (`pictures[i]`), then its top captions coloured by caption truth."""
    from sgraf.plotting import pyplot

    plt = pyplot()

    figure, axes = plt.subplots(len(rows), 2, figsize=(12, 2.4 * len(rows) + 0.9), squeeze=False,
                                gridspec_kw={"width_ratios": [1, 4.5]})
    marks = {OWN: "\u25cf own", TRUE: "\u25cb true", FALSE: "\u00d7 false"}
    for r, (row, picture) in enumerate(zip(rows, pictures)):
        axes[r, 0].imshow(picture if picture is not None else np.full((8, 8, 3), 230, np.uint8))
        axes[r, 0].set_xticks([])
        axes[r, 0].set_yticks([])
        rank = first_hit_rank([kind for _, _, kind, _ in row.results])
        said = f"first hit #{rank}" if rank != float("inf") else "no hit in the top 5"
        axes[r, 1].axis("off")
        # the query's line heads its captions (as a title over the picture it ran into the row above)
        lines = len(row.results) + 1
        axes[r, 1].text(0, 1 - 0.5 / lines, f"image {row.query}: {said}; quantile {100 * row.quantile:.1f} %",
                        fontsize=9, fontweight="bold", va="center", transform=axes[r, 1].transAxes)
        for position, (_, score, kind, text) in enumerate(row.results):
            axes[r, 1].text(0, 1 - (position + 1.5) / lines,
                            f"#{position + 1}  {score:.3f}  {marks[kind]:8}  {text}", fontsize=9,
                            color=STYLE[kind][0], va="center", family="monospace",
                            transform=axes[r, 1].transAxes)
    figure.suptitle(title, fontsize=11)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=STYLE[k][0], marker=m, linestyle="none", label=f"{MEANING[k]}")
               for k, m in ((OWN, "o"), (TRUE, "$\u25cb$"), (FALSE, "x"))]
    figure.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=80)
    plt.close(figure)
    return path.name


def thumbnail(data: Path, split: str, image_id: int) -> np.ndarray | None:
    """The rendered picture of the embedded benchmark (None when the data folder has none)."""
    from PIL import Image

    from sgraf.data.benchmark import image_path

    path = image_path(data, split, image_id)
    if not path.is_file():
        return None
    with Image.open(path) as handle:
        return np.asarray(handle.convert("RGB"))


def text_to_image_rows(index: Any, captions: Sequence[str], truth: np.ndarray, per: int, ranks: Sequence[float],
                       rows: int = 4, top_k: int = 5, shortlist: int | None = None) -> list[Row]:
    """The `rows` captions `pick_queries` picks from `ranks` (per caption), searched through `index`."""
    chosen = pick_queries(ranks, rows)
    found = index.search_texts([captions[c] for c in chosen], top_k=top_k, shortlist=shortlist, allow_unknown=True)
    return [Row(captions[c], c // per, [(hit.id, hit.score, result_kind(truth, hit.id, c, per), "") for hit in hits],
                _quantile(row, len(chosen))) for row, (c, hits) in enumerate(zip(chosen, found))]


def image_to_text_rows(index: Any, truth: np.ndarray, per: int, ranks: Sequence[float], rows: int = 4,
                       top_k: int = 5, shortlist: int | None = None) -> list[Row]:
    """The `rows` pictures `pick_queries` picks from `ranks` (per picture), searched through `index`."""
    chosen = pick_queries(ranks, rows)
    return [Row(i, i, [(hit.id, hit.score, result_kind(truth, i, hit.id, per), hit.text)
                       for hit in index.search_image(image_id=i, top_k=top_k, shortlist=shortlist)],
                _quantile(row, len(chosen))) for row, i in enumerate(chosen)]


def _quantile(row: int, rows: int) -> float:
    return (2 * row + 1) / (2 * rows)


def retrieval_pictures(index: Any, test: Any, scenes: Sequence[dict[str, Any]], sims: np.ndarray, data: Path,
                       out: Path, rows: int = 4, top_k: int = 5) -> dict[str, str]:
    """`retrieval_t2i.png` and `retrieval_i2t.png` of the demo's gallery index (module docstring).

    Args:
        index: the `GalleryIndex` of the test split.
        test: the test `PrecompSplit`.
        scenes: its rows of `test_scenes.jsonl`.
        sims: the (n_images, n_captions) score matrix of the index's models (the table's).
        data: the data folder (for the rendered pictures).
        out: the folder the pictures are written to.
        rows: queries per picture.
        top_k: results shown per query.

    Returns:
        {"retrieval_t2i": file name, "retrieval_i2t": file name}.
    """
    from sgraf.diagnose import truth_matrix

    per = test.caps_per_image
    truth = truth_matrix(scenes, per)
    caption_ranks, image_ranks = truth_ranks(sims, truth)
    t2i = text_to_image_rows(index, test.captions, truth, per, caption_ranks, rows, top_k)
    names = {"retrieval_t2i": draw_text_to_image(
        t2i, [thumbnail(data, "test", image) for row in t2i for image, _, _, _ in row.results],
        out / "retrieval_t2i.png",
        f"text \u2192 image: top {top_k} of {test.n_images} pictures, framed by caption truth\n{RULE}")}
    i2t = image_to_text_rows(index, truth, per, image_ranks, rows, top_k)
    names["retrieval_i2t"] = draw_image_to_text(
        i2t, [thumbnail(data, "test", row.own) for row in i2t], out / "retrieval_i2t.png",
        f"image \u2192 text: top {top_k} of {test.n_captions} captions, coloured by caption truth\n{RULE}")
    return names
