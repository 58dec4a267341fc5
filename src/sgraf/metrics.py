"""Retrieval metrics exactly as the authors define them, vectorised, with folds.

The score matrix has images as rows and captions as columns; caption ``j`` belongs to image
``j // caps_per_image`` (the precomp layout, five captions per image in the standard splits).

- Image-to-text rank of image ``i``: the best (smallest) 0-based rank of any of its captions in
  row ``i`` sorted by decreasing score.
- Text-to-image rank of caption ``j``: the 0-based rank of its image in column ``j``.
- ``R@K = 100 * #(rank < K) / n``, ``medr = floor(median(rank)) + 1``, ``meanr = mean(rank) + 1``,
  ``rsum`` = the six recalls summed in the authors' order.

Ties are broken deterministically, as a *stable* descending argsort
(``np.argsort(row, kind="stable")[::-1]``) would: among equal scores the later index ranks
first. The authors' ``np.argsort`` is not stable for long rows, so their tie order is arbitrary;
this rule equals theirs whenever the scores have no ties.

Ranks are computed by counting, ``rank = #(s > s_gt) + #(s == s_gt and index > gt)``, over
bounded chunks of whole rows: no per-row sort and no float64 copy of the matrix.

A matrix held on a GPU (a CUDA tensor, as `sgraf evaluate` scores there) is counted there with
the same comparisons, so the ranks are the same integers; only the ranks come to the host.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from sgraf.data.arrays import first_non_finite, map_row_chunks, row_chunks
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

RECALL_KEYS = ("r1", "r5", "r10", "medr", "meanr")

# Elements compared at once while counting ranks (bounds the temporary boolean matrices).
_CHUNK_ELEMENTS = 1 << 23


def score_array(sims: Any) -> np.ndarray:
    """`sims` as numpy scores: float64 as it is (an ensemble's exact mean,
    `sgraf.model.blocks.ENSEMBLE_DTYPE`, or the authors' arrays), anything else as float32."""
    sims = sims.detach().cpu().numpy() if isinstance(sims, torch.Tensor) else np.asarray(sims)
    return sims if sims.dtype == np.float64 else sims.astype(np.float32, copy=False)


def as_score_matrix(sims: Any, name: str = "score matrix") -> np.ndarray | torch.Tensor:
    """A 2-d finite float numpy view of `sims` (numpy array or tensor), without copying floats; a
    tensor on a GPU stays there (`_stays_on_device`), checked there.

    Raises:
        InputError: not 2-d, empty, or containing NaN/inf.
    """
    if isinstance(sims, torch.Tensor):
        sims = sims.detach()
        if sims.dtype not in (torch.float32, torch.float64):
            sims = sims.float()
        if not _stays_on_device(sims):
            sims = sims.cpu().numpy()
    else:
        sims = np.asarray(sims)
    if sims.ndim != 2 or sims.shape[0] == 0 or sims.shape[1] == 0:
        raise InputError(f"{name}: expected a non-empty 2-d (n_images, n_captions) matrix, got shape "
                         f"{tuple(sims.shape)}")
    if isinstance(sims, torch.Tensor):
        finite = bool(torch.isfinite(sims).all())
    else:
        sims = score_array(sims)
        finite = first_non_finite(sims) is None
    if not finite:
        raise InputError(f"{name}: contains NaN or infinite scores")
    return sims


def infer_caps_per_image(n_images: int, n_captions: int, caps_per_image: int | None = None) -> int:
    """Captions per image: `caps_per_image` if given, else ``n_captions // n_images``; checked.

    Raises:
        InputError: if ``n_captions != n_images * caps_per_image``.
    """
    given = caps_per_image is not None
    if caps_per_image is None:
        caps_per_image = n_captions // n_images if n_images else 0
    if caps_per_image < 1 or n_images * caps_per_image != n_captions:
        expected = (f"{n_images} x {caps_per_image} = {n_images * caps_per_image} captions (caps_per_image="
                    f"{caps_per_image})" if given else "a caption count that is a whole multiple of the image count")
        raise InputError(f"score matrix of shape ({n_images}, {n_captions}): expected {expected}, with each "
                         "image's captions in consecutive columns")
    return caps_per_image


def _stays_on_device(sims: torch.Tensor) -> bool:
    """Whether a tensor's ranks are counted where it lies (a GPU's) rather than in NumPy."""
    return sims.device.type != "cpu"


def _last_argmax(values: np.ndarray | torch.Tensor, axis: int) -> np.ndarray | torch.Tensor:
    """Index of the maximum along `axis`, the LAST one among equal maxima (a stable ascending
    sort read backwards)."""
    if isinstance(values, torch.Tensor):   # torch.argmax returns the first of equal maxima, as NumPy's
        return values.shape[axis] - 1 - torch.argmax(values.flip(axis), dim=axis)
    flipped = np.flip(values, axis=axis)
    return values.shape[axis] - 1 - np.argmax(flipped, axis=axis)


def i2t_ranks(sims: Any, caps_per_image: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Image-to-text ranks and top-1 captions.

    Args:
        sims: (n_img, n_cap) scores.
        caps_per_image: captions per image (default: ``n_cap // n_img``).

    Returns:
        ``(ranks, top1)``, each (n_img,) int64: the best 0-based rank among the image's captions,
        and the index of the highest-scored caption.
    """
    sims = as_score_matrix(sims)
    return _i2t_ranks(sims, infer_caps_per_image(*sims.shape, caps_per_image))


def _i2t_ranks(sims: np.ndarray | torch.Tensor, cpi: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(sims, torch.Tensor):
        return _i2t_ranks_tensor(sims, cpi)
    n_img, n_cap = sims.shape
    caption_index = np.arange(n_cap)

    def chunk(rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        start, stop = rows
        block = sims[start:stop]  # (b, n_cap)
        b = block.shape[0]
        images = np.arange(start, stop)
        own = block.reshape(b, n_img, cpi)[np.arange(b), images]  # (b, cpi): each image's captions
        # The image's best caption (the last one among tied scores) decides its rank.
        best = images * cpi + _last_argmax(own, axis=1)  # (b,)
        best_score = block[np.arange(b), best][:, None]  # (b, 1)
        ahead = (block > best_score) | ((block == best_score) & (caption_index[None, :] > best[:, None]))
        return ahead.sum(axis=1), _last_argmax(block, axis=1)

    parts = _map_row_chunks(chunk, n_img, n_cap)
    return (np.concatenate([ranks for ranks, _ in parts]).astype(np.int64, copy=False),
            np.concatenate([top1 for _, top1 in parts]).astype(np.int64, copy=False))


def _i2t_ranks_tensor(sims: torch.Tensor, cpi: int) -> tuple[np.ndarray, np.ndarray]:
    """`_i2t_ranks` counted with PyTorch where the tensor lies (the same comparisons)."""
    n_img, n_cap = sims.shape
    caption_index = torch.arange(n_cap, device=sims.device)
    ranks, top1 = [], []
    for start, stop in _row_chunks(n_img, n_cap):
        block = sims[start:stop]
        b = stop - start
        images = torch.arange(start, stop, device=sims.device)
        own = block.reshape(b, n_img, cpi)[torch.arange(b, device=sims.device), images]
        best = images * cpi + _last_argmax(own, 1)
        best_score = block.gather(1, best[:, None])
        ahead = (block > best_score) | ((block == best_score) & (caption_index[None, :] > best[:, None]))
        ranks.append(ahead.sum(dim=1))
        top1.append(_last_argmax(block, 1))
    return torch.cat(ranks).cpu().numpy(), torch.cat(top1).cpu().numpy()


def _row_chunks(n_img: int, n_cap: int) -> list[tuple[int, int]]:
    """(start, stop) of chunks of about `_CHUNK_ELEMENTS` scores, whole rows."""
    return row_chunks(n_img, n_cap, _CHUNK_ELEMENTS)


def _map_row_chunks(function: Any, n_img: int, n_cap: int) -> list[Any]:
    """`function((start, stop))` of every chunk of `_row_chunks`, in order, on PyTorch's number
    of threads (`sgraf.data.arrays.map_row_chunks`), so MSCOCO's 125 million scores take a
    fraction of a second on a many-core host."""
    return map_row_chunks(function, n_img, n_cap, _CHUNK_ELEMENTS)


def t2i_ranks(sims: Any, caps_per_image: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Text-to-image ranks and top-1 images.

    Args:
        sims: (n_img, n_cap) scores.
        caps_per_image: captions per image (default: ``n_cap // n_img``).

    Returns:
        ``(ranks, top1)``, each (n_cap,) int64: the 0-based rank of the caption's image in its
        column, and the index of the highest-scored image.
    """
    sims = as_score_matrix(sims)
    return _t2i_ranks(sims, infer_caps_per_image(*sims.shape, caps_per_image))


def _t2i_ranks(sims: np.ndarray | torch.Tensor, cpi: int) -> tuple[np.ndarray, np.ndarray]:
    # Counted over chunks of rows (contiguous in memory), then each column's counts summed and
    # its maxima merged in row order: about 3x faster than strided chunks of columns.
    if isinstance(sims, torch.Tensor):
        return _t2i_ranks_tensor(sims, cpi)
    n_img, n_cap = sims.shape
    captions = np.arange(n_cap)
    truth = captions // cpi  # (n_cap,)
    truth_score = sims[truth, captions]  # (n_cap,)

    def chunk(rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start, stop = rows
        block = sims[start:stop]  # (b, n_cap)
        images = np.arange(start, stop)[:, None]  # (b, 1)
        ahead = block > truth_score
        ahead |= (block == truth_score) & (images > truth)
        chunk_top = _last_argmax(block, axis=0)  # (n_cap,)
        return ahead.sum(axis=0), block[chunk_top, captions], start + chunk_top

    ranks = np.zeros(n_cap, dtype=np.int64)
    best = np.full(n_cap, -np.inf, dtype=sims.dtype)
    top1 = np.zeros(n_cap, dtype=np.int64)
    for counts, chunk_best, chunk_top in _map_row_chunks(chunk, n_img, n_cap):
        ranks += counts
        later = chunk_best >= best  # a later image wins a tie (the last maximum)
        best = np.where(later, chunk_best, best)
        top1 = np.where(later, chunk_top, top1)
    return ranks, top1


def _t2i_ranks_tensor(sims: torch.Tensor, cpi: int) -> tuple[np.ndarray, np.ndarray]:
    """`_t2i_ranks` counted with PyTorch where the tensor lies (the same comparisons)."""
    n_img, n_cap = sims.shape
    captions = torch.arange(n_cap, device=sims.device)
    truth = captions // cpi
    truth_score = sims[truth, captions]
    ranks = torch.zeros(n_cap, dtype=torch.int64, device=sims.device)
    best = torch.full((n_cap,), -torch.inf, dtype=sims.dtype, device=sims.device)
    top1 = torch.zeros(n_cap, dtype=torch.int64, device=sims.device)
    for start, stop in _row_chunks(n_img, n_cap):
        block = sims[start:stop]
        images = torch.arange(start, stop, device=sims.device)[:, None]
        ahead = (block > truth_score) | ((block == truth_score) & (images > truth))
        ranks += ahead.sum(dim=0)
        chunk_top = _last_argmax(block, 0)
        chunk_best = block.gather(0, chunk_top[None, :])[0]
        later = chunk_best >= best   # a later image wins a tie (the last maximum)
        best = torch.where(later, chunk_best, best)
        top1 = torch.where(later, start + chunk_top, top1)
    return ranks.cpu().numpy(), top1.cpu().numpy()


def recall_metrics(ranks: np.ndarray) -> dict[str, float]:
    """R@1, R@5, R@10, medr and meanr of 0-based ranks, with the authors' float arithmetic."""
    ranks = np.asarray(ranks, dtype=np.float64)
    n = len(ranks)
    metrics = {f"r{k}": 100.0 * int((ranks < k).sum()) / n for k in (1, 5, 10)}
    metrics["medr"] = float(np.floor(np.median(ranks)) + 1)
    metrics["meanr"] = float(ranks.mean() + 1)
    return metrics


def i2t(sims: Any, caps_per_image: int | None = None) -> dict[str, float]:
    """Image-to-text metrics ``{"r1", "r5", "r10", "medr", "meanr"}`` of a score matrix."""
    return recall_metrics(i2t_ranks(sims, caps_per_image)[0])


def t2i(sims: Any, caps_per_image: int | None = None) -> dict[str, float]:
    """Text-to-image metrics ``{"r1", "r5", "r10", "medr", "meanr"}`` of a score matrix."""
    return recall_metrics(t2i_ranks(sims, caps_per_image)[0])


def rsum(i2t_metrics: dict[str, float], t2i_metrics: dict[str, float]) -> float:
    """The six recalls summed, in the authors' order (i2t R@1, 5, 10, then t2i)."""
    r, ri = i2t_metrics, t2i_metrics
    return r["r1"] + r["r5"] + r["r10"] + ri["r1"] + ri["r5"] + ri["r10"]


def _evaluate_one(sims: np.ndarray | torch.Tensor, cpi: int) -> dict[str, Any]:
    """`evaluate_sims` of a matrix `as_score_matrix` checked, `cpi` captions per image."""
    forward = recall_metrics(_i2t_ranks(sims, cpi)[0])
    backward = recall_metrics(_t2i_ranks(sims, cpi)[0])
    return {
        "n_images": int(sims.shape[0]),
        "n_captions": int(sims.shape[1]),
        "i2t": forward,
        "t2i": backward,
        "rsum": rsum(forward, backward),
    }


def evaluate_sims(sims: Any, folds: int = 1, caps_per_image: int | None = None) -> dict[str, Any]:
    """The standard protocol on a score matrix: recalls both ways and rsum, over `folds` folds.

    With ``folds=K > 1`` the images and their captions are split into K consecutive equal folds
    (MSCOCO 1K is ``testall`` with 5 folds); each metric is the true mean over the folds,
    computed as the authors do (``np.mean`` over the per-fold rows), and ``"folds"`` lists the
    per-fold results. (The authors' script prints some of these means under the wrong labels:
    its "rsum" is 6x the mean i2t recall, its "Average i2t Recall" the t2i one and its
    "Average t2i Recall" the rsum. The values returned here are correctly named.)

    Args:
        sims: (n_img, n_cap) scores (numpy or tensor, float32 or float64); a tensor on a GPU
            is counted there.
        folds: number of consecutive equal folds.
        caps_per_image: captions per image (default: ``n_cap // n_img``).

    Returns:
        ``{"n_images", "n_captions", "i2t": {...}, "t2i": {...}, "rsum"}`` plus ``"folds"``
        (a list of the same per fold) when ``folds > 1``.

    Raises:
        InputError: a malformed matrix, or images that do not split into `folds` equal folds.
    """
    sims = as_score_matrix(sims)
    n_img, n_cap = sims.shape
    cpi = infer_caps_per_image(n_img, n_cap, caps_per_image)
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 1:
        raise InputError(f"folds must be a positive integer, got {folds!r}")
    if folds == 1:
        return _evaluate_one(sims, cpi)
    if n_img % folds:
        raise InputError(f"folds: {n_img} images do not split into {folds} equal folds")
    fold_images = n_img // folds
    fold_captions = fold_images * cpi
    return evaluate_fold_blocks(
        [sims[k * fold_images:(k + 1) * fold_images, k * fold_captions:(k + 1) * fold_captions]
         for k in range(folds)], cpi)


def evaluate_fold_blocks(blocks: Sequence[Any], caps_per_image: int | None = None) -> dict[str, Any]:
    """`evaluate_sims` with K folds, from the K diagonal blocks of the matrix (fold k's images
    against fold k's captions, as scored alone: `sgraf.evaluate` scores no more than these)."""
    blocks = [as_score_matrix(block) for block in blocks]
    if not blocks:
        raise InputError("evaluate_fold_blocks: no folds given; expected the K diagonal blocks of a matrix")
    if len({tuple(block.shape) for block in blocks}) != 1:
        raise InputError(f"folds of different shapes: {sorted({tuple(block.shape) for block in blocks})}")
    cpi = infer_caps_per_image(*blocks[0].shape, caps_per_image)
    per_fold = [_evaluate_one(block, cpi) for block in blocks]
    n_img, n_cap = (len(blocks) * size for size in blocks[0].shape)
    # One row per fold, averaged over axis 0 like the authors' np.array(results).mean(axis=0).
    table = np.array(
        [[fold["i2t"][key] for key in RECALL_KEYS] + [fold["t2i"][key] for key in RECALL_KEYS] + [fold["rsum"]]
         for fold in per_fold],
        dtype=np.float64,
    )
    means = table.mean(axis=0)
    return {
        "n_images": n_img,
        "n_captions": n_cap,
        "i2t": {key: float(means[i]) for i, key in enumerate(RECALL_KEYS)},
        "t2i": {key: float(means[5 + i]) for i, key in enumerate(RECALL_KEYS)},
        "rsum": float(means[10]),
        "folds": per_fold,
    }


def format_table(result: dict[str, Any]) -> str:
    """A readable table of an `evaluate_sims` result, laid out like the paper's."""
    header = f"{'':<8}{'R@1':>8}{'R@5':>8}{'R@10':>8}{'medr':>8}{'meanr':>9}"

    def row(label: str, metrics: dict[str, float]) -> str:
        return (f"{label:<8}{metrics['r1']:>8.1f}{metrics['r5']:>8.1f}{metrics['r10']:>8.1f}"
                f"{metrics['medr']:>8.1f}{metrics['meanr']:>9.2f}")

    lines = [f"{result['n_images']} images x {result['n_captions']} captions"]
    if "folds" in result:      # the fold size said: 5 folds of a 1,000-image split are not MSCOCO 1K's
        folds = len(result["folds"])
        size = result["n_images"] // folds
        lines[0] += f", mean over {folds} folds of {size} images"
        if size <= 10:
            lines[0] += f" (R@10 is 100 in a fold of {size})"
    lines += [header, row("i2t", result["i2t"]), row("t2i", result["t2i"]), f"rsum {result['rsum']:.1f}"]
    if "folds" in result:
        for k, fold in enumerate(result["folds"]):
            lines.append(f"fold {k}: i2t R@1 {fold['i2t']['r1']:.1f}  t2i R@1 {fold['t2i']['r1']:.1f}  "
                         f"rsum {fold['rsum']:.1f}")
    return "\n".join(lines)
