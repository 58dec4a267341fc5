"""Evaluation engine: checkpoints (or saved score matrices) on a split -> a dict of metrics.

The standard protocols: Flickr30K ``test`` and MSCOCO 5K (``testall``) with one fold, MSCOCO
1K with ``testall`` in 5 folds. Several checkpoints are evaluated on the average of their score
matrices (the paper's SGRAF is an SGR and a SAF model together). The encoding and scoring go
through `sgraf.scoring`, the same path as validation during training.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from sgraf import distributed, metrics, score_record, scoring
from sgraf.atomic_write import atomic_path
from sgraf.data.arrays import first_non_finite, open_npy
from sgraf.data.vocab import warn_unknown_share
from sgraf.devices import resolve_device
from sgraf.errors import InputError
from sgraf.io_paths import path_list
from sgraf.kernels import plan
from sgraf.model.blocks import model_device, score_dtype
from sgraf.model.host_copy import HostCopy
from sgraf.precision import validation_precision
from sgraf.signals import signals_deferred
from sgraf.stopwatch import Stopwatch, stage

logger = logging.getLogger(__name__)


def load_ensemble(checkpoints: str | os.PathLike | Sequence[str | os.PathLike], vocab: str | os.PathLike | Any = None,
                  device: torch.device | str = "cpu") -> tuple[list[torch.nn.Module], Any]:
    """Load one or several checkpoints that share one vocabulary.

    Args:
        checkpoints: a path, or several, of our checkpoints or the authors' ``.pth.tar`` files.
        vocab: a vocabulary (its JSON path, a `Vocabulary` or its dict) for every model; needed
            for the authors' checkpoints, which carry none. Default: the one stored in each
            checkpoint.
        device: where to put the models ('auto': CUDA when available).

    Returns:
        ``(models, vocabulary)``, models in eval mode on `device`.

    Raises:
        InputError: no vocabulary, a vocabulary whose size is not the checkpoint's embedding
            rows, or checkpoints whose vocabularies differ.
    """
    from sgraf.checkpoint import load_model, resolve_vocab, vocabulary_conflict
    from sgraf.data.vocab import Vocabulary

    checkpoints = path_list("checkpoints", checkpoints)   # one path is one checkpoint, not its characters
    device = resolve_device(device)     # 'auto': CUDA when available
    given = resolve_vocab(vocab, source="the vocabulary given")     # a path, a Vocabulary or its dict
    named = f"--vocab {vocab}" if isinstance(vocab, (str, os.PathLike)) else "the vocabulary given"
    loaded = [load_model(path, map_location="cpu") for path in checkpoints]
    stored = [Vocabulary.from_dict(model.vocab, source=str(path)) if isinstance(model.vocab, dict) else model.vocab
              for path, model in zip(checkpoints, loaded)]
    bare = [path for path, own in zip(checkpoints, stored) if own is None]
    carrying = [(path, own) for path, own in zip(checkpoints, stored) if own is not None]
    if bare and carrying:   # an authors' checkpoint beside one with its own: one vocabulary must fit both
        if given is None:
            raise InputError(f"checkpoint {bare[0]} carries no vocabulary (the authors' checkpoints do not) and "
                             f"{carrying[0][0]} carries its own: pass the vocabulary {bare[0]} was trained with "
                             "(vocab=PATH; on the command line, --vocab PATH), which must be the other's too: an "
                             "ensemble needs one vocabulary")
        for path, own in carrying:
            if own != given:
                raise InputError(f"{path} carries its own vocabulary, which differs from {named} that {bare[0]} "
                                 "(no vocabulary of its own) is given: these models learned other word ids, and an "
                                 "ensemble needs one vocabulary")
    models, vocabularies = [], []
    for path, model, own in zip(checkpoints, loaded, stored):
        rows = model.config.vocab_size
        if given is not None:
            if len(given) != rows:
                raise InputError(f"{named}: {len(given)} words, but the word embedding of {path} has "
                                 f"{rows} rows (vocab_size={rows}); use the vocabulary the model was trained with")
            if own is not None and own != given:
                raise vocabulary_conflict(path, vocab)
            model.vocab = given
        elif own is None:
            raise InputError(f"checkpoint {path} carries no vocabulary (the authors' checkpoints do not); pass the "
                             "vocabulary JSON of its data set: vocab=PATH (on the command line, --vocab PATH)")
        models.append(model.to(device).eval())
        vocabularies.append(model.vocab)
    for path, other in zip(checkpoints[1:], vocabularies[1:]):
        if other != vocabularies[0]:
            sizes = (f"{len(vocabularies[0])} vs {len(other)} words" if len(other) != len(vocabularies[0])
                     else f"both {len(other)} words, with different word ids")
            raise InputError(f"{checkpoints[0]} and {path} use different vocabularies ({sizes}); "
                             "an ensemble needs one vocabulary")
    return models, vocabularies[0]


def start_device(device: torch.device | str) -> None:
    """Start `device`'s runtime now (CUDA's context and its first allocation): what the first
    model moved there would otherwise pay, timed apart by `sgraf evaluate --timings`."""
    torch.empty(1, device=device).add_(1)


def check_split_fits(model: torch.nn.Module, split: Any, name: str) -> None:
    """Raise InputError if the split's features are not the shape the model expects."""
    config = model.config
    regions, dim = split.images.shape[1:]
    if (regions, dim) != (config.num_regions, config.img_dim):
        raise InputError(f"{split.ims_path}: features of shape (n, {regions}, {dim}), but {name} expects "
                         f"(n, {config.num_regions}, {config.img_dim}) (num_regions, img_dim)")
    if getattr(model, "needs_boxes", False):
        try:
            split.read_boxes(required=True)
        except InputError as error:
            raise InputError(f"{name} (positions={config.positions!r}): {error}") from None


def _checked_arguments(models: Any, split: Any, vocab: Any, token_ids: Any = None) -> list[torch.nn.Module]:
    """The models of a Python call of `score_split` / `evaluate_split` as a list (one model is
    taken as a list of one), or an `InputError` naming the argument that is not what it expects."""
    if isinstance(models, (torch.nn.ModuleList, torch.nn.Sequential)):
        models = list(models)             # an ensemble as a ModuleList
    elif isinstance(models, torch.nn.Module):
        models = [models]                 # one model
    if isinstance(models, (str, os.PathLike)) or not isinstance(models, Sequence) or not models:
        raise InputError(f"models: a list of SGRAF networks (sgraf.load_model(path)), got {type(models).__name__}")
    for m, model in enumerate(models):
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"models[{m}]: an SGRAF network (sgraf.load_model(path)), got {type(model).__name__}")
    if not (hasattr(split, "images") and hasattr(split, "captions")):
        raise InputError(f"split: a PrecompSplit (sgraf.data.precomp.PrecompSplit(data_dir, 'test')), got "
                         f"{type(split).__name__}")
    if token_ids is None and not callable(getattr(vocab, "encode", None)):
        raise InputError(f"vocab: a Vocabulary to tokenise the captions (sgraf.load_vocab(path), or the model's "
                         f"own: model.vocab), got {type(vocab).__name__}")
    return list(models)


def score_split(models: Sequence[torch.nn.Module], split: Any, vocab: Any, precision: str = "fp32",
                batch_size: int = 128, progress: bool = False, head: str | None = None,
                token_ids: Sequence[Sequence[int]] | None = None, stopwatch: Stopwatch | None = None,
                keep_on_device: bool = False, on_rows: Any = None) -> np.ndarray | torch.Tensor:
    """The (n_img, n_cap) score matrix of a model (float32) or an ensemble (float64) on a split (with
    `keep_on_device`, a tensor left on the CUDA device that scored it; `on_rows`: see
    `sgraf.scoring.score_matrix`).

    The captions are tokenised once for every model (unless `token_ids` gives them). Under
    ``torchrun`` every process must call this; each scores a share of the images and every
    process returns the whole matrix. `stopwatch` times the stages 'tokenise', 'encode images',
    'encode captions' and 'score'.
    """
    models = _checked_arguments(models, split, vocab, token_ids)
    encoded = _encode_split(models, split, vocab, precision, batch_size, progress, token_ids, stopwatch)
    with stage(stopwatch, "score"):
        return scoring.score_matrix(list(models), encoded, precision=precision, progress=progress, head=head,
                                    keep_on_device=keep_on_device, on_rows=on_rows)


def _encode_split(models: Sequence[torch.nn.Module], split: Any, vocab: Any, precision: str, batch_size: int,
                  progress: bool, token_ids: Sequence[Sequence[int]] | None, stopwatch: Stopwatch | None) -> list[Any]:
    """The split encoded by each model, its captions tokenised once for all (unless given)."""
    if token_ids is None:
        with stage(stopwatch, "tokenise"):
            token_ids = scoring.tokenize_captions(split.captions, vocab)
    return [scoring.encode_split(model, split, vocab, batch_size=batch_size, precision=precision,
                                 progress=progress and distributed.is_main_process(), token_ids=token_ids,
                                 stopwatch=stopwatch)
            for model in models]


def _evaluate_folds(models: Sequence[torch.nn.Module], split: Any, vocab: Any, folds: int, precision: str,
                    batch_size: int, progress: bool, head: str | None, token_ids: Sequence[Sequence[int]] | None,
                    stopwatch: Stopwatch | None) -> dict[str, Any]:
    """`evaluate_split` over `folds` folds when no matrix is wanted, as the authors evaluate
    MSCOCO 1K: the split encoded once, then each fold's images scored against its own captions
    only (the diagonal blocks that `metrics.evaluate_sims` reads; the whole matrix is `folds`
    times the work). A block scored alone may differ from the same block of the whole matrix in
    its last bits (BLAS sums a product of another shape in another order), as the authors'
    blocks do from their whole matrix; the same recalls outside near-ties."""
    if isinstance(folds, bool) or not isinstance(folds, int) or split.n_images % folds:
        raise InputError(f"folds: {split.n_images} images do not split into {folds!r} equal folds")
    encoded = _encode_split(models, split, vocab, precision, batch_size, progress, token_ids, stopwatch)
    size, per_image = split.n_images // folds, split.caps_per_image
    blocks = []
    for k in range(folds):
        images, captions = slice(k * size, (k + 1) * size), slice(k * size * per_image, (k + 1) * size * per_image)
        with stage(stopwatch, "score"):
            blocks.append(scoring.score_matrix(list(models), [part.fold(images, captions) for part in encoded],
                                               precision=precision, progress=progress, head=head,
                                               keep_on_device=True))
    with stage(stopwatch, "metrics"):
        result = metrics.evaluate_fold_blocks(blocks, split.caps_per_image)
        warn_saturated(torch.cat([torch.as_tensor(block) for block in blocks]), models)
    return result


def evaluate_split(models: Sequence[torch.nn.Module], split: Any, vocab: Any, folds: int = 1,
                   precision: str = "fp32", batch_size: int = 128, progress: bool = False,
                   head: str | None = None, token_ids: Sequence[Sequence[int]] | None = None,
                   stopwatch: Stopwatch | None = None, matrix: bool = True,
                   save_to: str | os.PathLike | None = None) -> tuple[dict[str, Any], np.ndarray | None]:
    """Metrics (`sgraf.metrics.evaluate_sims`) and the score matrix of models on a split.

    This is what training validation calls, so that it matches `sgraf evaluate` exactly.
    `stopwatch` times `score_split`'s stages, 'metrics' and 'save'. On a GPU the ranks are counted
    where the matrix was scored, and the matrix comes to the host band by band while the rest is
    scored (`sgraf.model.host_copy`; the wait for the last band is timed as 'score'). Without
    `matrix` nothing is copied to the host and None is returned in its place. `save_to`: a path
    the matrix is written to as a `.npy` (by the same bands on a GPU; the caller makes
    the write atomic, `sgraf.atomic_write.atomic_path`).
    """
    models = _checked_arguments(models, split, vocab, token_ids)
    matrix = matrix or save_to is not None
    if folds > 1 and not matrix:
        return _evaluate_folds(models, split, vocab, folds, precision, batch_size, progress, head, token_ids,
                               stopwatch), None
    on_gpu = bool(models) and plan.gpu_plan(model_device(models[0]))
    copy = (HostCopy((split.n_images, split.n_captions), save_to, dtype=score_dtype(len(models)))
            if matrix and on_gpu else None)
    with copy if copy is not None else contextlib.nullcontext():
        sims = score_split(models, split, vocab, precision, batch_size, progress, head, token_ids, stopwatch,
                           keep_on_device=True, on_rows=copy.band if copy is not None else None)
        with stage(stopwatch, "metrics"):
            result = metrics.evaluate_sims(sims, folds=folds, caps_per_image=split.caps_per_image)
            warn_saturated(sims, models)
        if not matrix:
            return result, None
        with stage(stopwatch, "score"):
            host = copy.result(sims) if copy is not None else sims.cpu().numpy()
    if save_to is not None and copy is None:
        with stage(stopwatch, "save"):
            write_matrix(host, save_to)
    return result, host


_WARNED_SATURATED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def warn_saturated(sims: np.ndarray | torch.Tensor, models: Sequence[torch.nn.Module] = ()) -> int:
    """Warn when scores are exactly 1.0, the ceiling of the heads' sigmoid in float32: such scores
    tie, their order is the tie-break's, and the recalls say little. With `models`, once per model
    in a process (a training run validates often). Returns how many there are."""
    # == 1.0, not >= (a matrix of another tool's logits, all above 1, had been called saturated)
    saturated, low, high = 0, math.inf, -math.inf
    for start in range(0, sims.shape[0], 1024):
        block = sims[start:start + 1024]
        saturated += int((block == 1.0).sum())
        low, high = min(low, float(block.min())), max(high, float(block.max()))
    constant = low == high and sims.shape[0] * sims.shape[1] > 1
    if not saturated and not constant:
        return 0
    if models:
        fresh = [model for model in models if model not in _WARNED_SATURATED]
        if not fresh:
            return saturated
        _WARNED_SATURATED.update(fresh)
    if constant and low != 1.0:       # a collapsed model (a training at lr=100 had "finished" at dev rsum 125)
        logger.warning("every score is %.6g: the model scores every pair alike (collapsed: the hinge loss's plateau, "
                       "or a learning rate too large), so its recalls are the tie-break's alone", low)
        return saturated
    place = any(getattr(model.config, "positions", "none") == "place" and not model.config.place_penalty
                for model in models)
    total = int(sims.shape[0]) * int(sims.shape[1])
    logger.warning("%d of the %d scores (%.1f %%) are exactly 1.0: the sigmoid saturated, so they tie and their "
                   "order is the tie-break's; the recalls are unreliable%s", saturated, total, 100 * saturated / total,
                   " (the place term can lift every caption of a model with positions='place': place_penalty=true "
                   "lets it only lower scores)" if place else "")
    return saturated


FLAT_MEMBER_SAMPLE = 32    # images (one caption each) whose every pair `warn_flat_members` scores
FLAT_MEMBER_RATIO = 0.01   # a member whose scores spread less than this share of another's adds a near-constant


def warn_flat_members(models: Sequence[torch.nn.Module], names: Sequence[str], split: Any, vocab: Any) -> list[str]:
    """Warn when a model of an ensemble scores (almost) every pair alike: the sd of its scores over
    every pair of the split's first `FLAT_MEMBER_SAMPLE` images and one caption of each is under
    `FLAT_MEMBER_RATIO` of another member's. Averaged, such a model adds a near-constant and the
    ensemble ranks as the others alone do (a place model whose term had outgrown its heads scored
    1e-36 to 6e-7, and its ensemble with an SGR gave the SGR's figures to the digit). Returns the
    names of such models."""
    from sgraf.data.precomp import first_pairs

    boxes_needed = any(getattr(model, "needs_boxes", False) for model in models)
    batch = first_pairs(split, vocab, FLAT_MEMBER_SAMPLE, with_boxes=boxes_needed)
    n = len(batch.lengths)
    spreads = []
    for model in models:
        device = model_device(model)
        boxes = batch.boxes.to(device) if boxes_needed and getattr(model, "needs_boxes", False) else None
        scores = model.score(batch.images.to(device), batch.captions.to(device), batch.lengths, boxes=boxes)
        spreads.append(float(scores.double().std()) if scores.numel() > 1 else 0.0)
    widest = max(spreads)
    flat = []
    for name, spread in zip(names, spreads):
        if spread < FLAT_MEMBER_RATIO * widest:
            flat.append(name)
            logger.warning("%s scores every pair almost alike (sd %.2g over %d x %d pairs, the ensemble's widest "
                           "%.2g): averaged, it adds a near-constant and the ensemble ranks as the other models do; "
                           "evaluate it alone", name, spread, n, n, widest)
    return flat


def open_split(data_dir: str | os.PathLike, split: str) -> Any:
    """`PrecompSplit`, with an error listing the splits that exist when this one does not."""
    from sgraf.data.precomp import PrecompSplit, split_files, splits_found

    ims, caps = split_files(data_dir, split)
    if not Path(data_dir).exists():
        raise InputError(f"--data {data_dir}: no such folder")
    if not Path(data_dir).is_dir():
        raise InputError(f"--data {data_dir}: a file, where a data folder is needed")
    if not (ims.is_file() and caps.is_file()):
        raise InputError(f"split {split!r} does not exist in {data_dir} (needs {ims.name} and {caps.name}); "
                         f"splits there: {splits_found(data_dir, split)}")
    return PrecompSplit(data_dir, split)


def save_matrix(sims: np.ndarray, path: str | os.PathLike) -> None:
    """Write a score matrix's .npy atomically (temporary file, then `os.replace`; `write_matrix`)."""
    with atomic_path(path) as temporary:
        write_matrix(sims, temporary)


def save_matrix_and_record(sims: np.ndarray, path: str | os.PathLike, record: str) -> None:
    """Write a score matrix's .npy and its record (`score_record.record_text`) beside it, both or
    neither: each to a temporary file first, then moved into place together, signals held off
    between the moves (the matrix had been moved before its record was written: a full disk then
    left a new matrix without one, which a later evaluation scored as any split of its shape)."""
    with contextlib.ExitStack() as write:
        record_file = write.enter_context(atomic_path(score_record.record_path(path)))
        matrix_file = write.enter_context(atomic_path(path))
        write_matrix(sims, matrix_file)
        record_file.write_text(record, encoding="utf-8")
        with signals_deferred():
            write.close()


def write_matrix(sims: np.ndarray, path: str | os.PathLike) -> None:
    """Write a score matrix to `path` as a .npy: float64 as it is (an ensemble's exact mean, as
    `sgraf.model.blocks.ENSEMBLE_DTYPE` keeps it, or a float64 matrix given, as the authors save
    theirs), any other float type as float32 (`save_matrix` makes the write atomic)."""
    with open(path, "wb") as handle:
        np.save(handle, metrics.score_array(sims))


def load_matrix(path: str | os.PathLike) -> np.ndarray:
    """A saved (n_images, n_captions) score matrix, memory-mapped; InputError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "No such file", str(path))
    sims = open_npy(path, "a float (n_images, n_captions) score matrix (sgraf evaluate --save-sims)")
    if sims.ndim != 2 or sims.dtype.kind != "f":
        raise InputError(f"{path}: expected a 2-d float (n_images, n_captions) matrix, got "
                         f"{getattr(sims, 'dtype', type(sims).__name__)} of shape {getattr(sims, 'shape', '?')}")
    return sims


def _check_finite_matrix(sims: np.ndarray, path: str | os.PathLike) -> None:
    """InputError naming the file and the first score holding NaN/inf (`first_non_finite`, read
    in row chunks)."""
    where = first_non_finite(sims)
    if where is not None:
        row, column = where
        raise InputError(f"{path}: score [image {row}, caption {column}] is {sims[row, column]}; "
                         f"expected finite scores")


def evaluate_checkpoints(checkpoints: str | os.PathLike | Sequence[str | os.PathLike], data_dir: str | os.PathLike,
                         split: str, vocab: str | os.PathLike | Any = None, folds: int = 1, precision: str = "fp32",
                         batch_size: int = 128, device: torch.device | str = "cpu", progress: bool = False,
                         save_sims: str | os.PathLike | None = None, stopwatch: Stopwatch | None = None,
                         token_prefetch: Any = None) -> dict[str, Any]:
    """Evaluate a checkpoint, or the average of several, on ``data_dir/{split}_*``.

    `evaluate_checkpoints_with_sims` takes the same arguments and also returns the matrix.

    Args:
        checkpoints: one path, or several for an ensemble.
        data_dir: the precomp directory.
        split: the split name (``test``, ``testall``, ...).
        vocab: vocabulary JSON (or object) for models that carry none.
        folds: consecutive equal folds to average over (MSCOCO 1K: 5 on ``testall``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (`sgraf.precision`).
        batch_size: encoder batch and caption bucket size.
        device: where to run ('auto': CUDA when available).
        progress: progress bars with ETA on stderr.
        save_sims: write the (n_img, n_cap) matrix here (caption-file order; `write_matrix`).
        stopwatch: times the stages 'data', 'checkpoint', 'tokenise', 'encode images', 'encode
            captions', 'score', 'metrics' and 'save' (`sgraf.stopwatch`; `sgraf evaluate --timings`).
        token_prefetch: the split's captions being tokenised in another process
            (`sgraf.data.token_cache.prefetch`), as `sgraf evaluate` starts it before its imports.

    Returns:
        The `sgraf.metrics.evaluate_sims` dict.
    """
    # the matrix comes to the host only to be saved
    return _evaluate_checkpoints(checkpoints, data_dir, split, vocab, folds, precision, batch_size, device,
                                 progress, save_sims, stopwatch, token_prefetch, matrix=save_sims is not None)[0]


def evaluate_checkpoints_with_sims(checkpoints: str | os.PathLike | Sequence[str | os.PathLike],
                                   data_dir: str | os.PathLike,
                                   split: str, vocab: str | os.PathLike | Any = None, folds: int = 1,
                                   precision: str = "fp32", batch_size: int = 128,
                                   device: torch.device | str = "cpu", progress: bool = False,
                                   save_sims: str | os.PathLike | None = None, stopwatch: Stopwatch | None = None,
                                   token_prefetch: Any = None) -> tuple[dict[str, Any], np.ndarray]:
    """`evaluate_checkpoints`, returning ``(metrics, (n_img, n_cap) score matrix: float32, an ensemble's float64)``."""
    result, sims = _evaluate_checkpoints(checkpoints, data_dir, split, vocab, folds, precision, batch_size,
                                         device, progress, save_sims, stopwatch, token_prefetch, matrix=True)
    assert sims is not None
    return result, sims


def _evaluate_checkpoints(checkpoints: Sequence[str | os.PathLike], data_dir: str | os.PathLike, split: str,
                          vocab: str | os.PathLike | Any, folds: int, precision: str, batch_size: int,
                          device: torch.device | str, progress: bool, save_sims: str | os.PathLike | None,
                          stopwatch: Stopwatch | None, token_prefetch: Any, matrix: bool
                          ) -> tuple[dict[str, Any], np.ndarray | None]:
    """`evaluate_checkpoints_with_sims`; without `matrix` (and `save_sims`) the matrix is not
    copied to the host and None is returned in its place."""
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 1:
        raise InputError(f"--folds must be a positive integer, got {folds!r}")
    checkpoints = path_list("checkpoints", checkpoints)
    device = resolve_device(device)     # 'auto': CUDA when available
    with stage(stopwatch, "data"):
        precomp = open_split(data_dir, split)
    if precomp.n_images % folds:
        raise InputError(f"--folds {folds} (folds={folds}): the {precomp.n_images} images of {precomp.ims_path} "
                         f"do not split into {folds} equal folds")
    with stage(stopwatch, "checkpoint"):
        models, vocabulary = load_ensemble(checkpoints, vocab, device)
    for model, path in zip(models, checkpoints):
        check_split_fits(model, precomp, str(path))
        trained = (getattr(model, "train_config", None) or {}).get("precision")
        validated = validation_precision(trained) if isinstance(trained, str) else None
        if validated and validated != precision:
            logger.info("%s was validated in %s while it trained: --precision %s scores as its validation did (the "
                        "run's dev rsum); this evaluation is %s", path, validated, validated, precision)
    with stage(stopwatch, "tokenise"):
        # once: the check and every model
        token_ids = scoring.tokenize_captions(precomp.captions, vocabulary, token_prefetch)
    warn_unknown_share(vocabulary, token_ids, str(precomp.caps_path))
    if len(models) > 1 and distributed.is_main_process():
        warn_flat_members(models, [str(path) for path in checkpoints], precomp, vocabulary)
    logger.info("evaluating %s on %s (%d images, %d captions)", ", ".join(map(str, checkpoints)),
                precomp.caps_path, precomp.n_images, precomp.n_captions)
    saving = save_sims is not None and distributed.is_main_process()
    with contextlib.ExitStack() as write:
        # opened first, so that a path that cannot be written fails before the work; closed in
        # reverse order: the matrix moved into place, then its record beside it
        record = write.enter_context(atomic_path(score_record.record_path(save_sims))) if saving else None
        temporary = write.enter_context(atomic_path(save_sims)) if saving else None
        result, sims = evaluate_split(models, precomp, vocabulary, folds, precision, batch_size, progress,
                                      token_ids=token_ids, stopwatch=stopwatch,
                                      matrix=matrix or save_sims is not None, save_to=temporary)
        with stage(stopwatch, "save"):
            if record is not None:
                record.write_text(score_record.record_text(
                    sims, score_record.split_identity(precomp, boxes=any(getattr(model, "needs_boxes", False)
                                                                         for model in models)), precision=precision,
                    checkpoints=[str(Path(path).resolve()) for path in checkpoints],
                    # the vocabulary decides every score of a checkpoint that carries none (the authors')
                    **({"vocab": str(Path(vocab).resolve())} if isinstance(vocab, (str, os.PathLike)) else {})),
                    encoding="utf-8")
            with signals_deferred():      # both moved, or neither: a stop between had left the new matrix
                write.close()           # beside the old one's record (synced and moved into place)
    if saving:
        logger.info("wrote the %s score matrix to %s (and what it scored to %s)", sims.shape, save_sims,
                    score_record.record_path(save_sims).name)
    return result, sims


def evaluate_sims_files(paths: Sequence[str | os.PathLike], folds: int = 1,
                        data_dir: str | os.PathLike | None = None, split: str | None = None,
                        save_sims: str | os.PathLike | None = None,
                        stopwatch: Stopwatch | None = None) -> dict[str, Any]:
    """Evaluate saved score matrices, averaging several (their float64 mean, kept in float64).

    With `data_dir` the matrices must have the split's (n_images, n_captions) shape. A matrix saved
    by sgraf has a record of the split it scored beside it (`sgraf.score_record`): one that names
    other captions than the split's, or than another matrix's, is refused (InputError). `save_sims`
    writes the matrix with such a record.
    `evaluate_sims_files_with_sims` takes the same arguments and also returns the matrix.
    `stopwatch` times the stages 'load', 'metrics' and 'save'.
    """
    return evaluate_sims_files_with_sims(paths, folds, data_dir, split, save_sims, stopwatch)[0]


def evaluate_sims_files_with_sims(paths: Sequence[str | os.PathLike], folds: int = 1,
                                  data_dir: str | os.PathLike | None = None, split: str | None = None,
                                  save_sims: str | os.PathLike | None = None,
                                  stopwatch: Stopwatch | None = None) -> tuple[dict[str, Any], np.ndarray]:
    """`evaluate_sims_files`, returning ``(metrics, the (averaged) score matrix)``."""
    if not paths:
        raise InputError("no score matrix given")
    with stage(stopwatch, "load"):
        sims, scored = load_matrices(paths, data_dir, split)
    with stage(stopwatch, "metrics"):
        result = metrics.evaluate_sims(sims, folds=folds)
        warn_saturated(sims)
    if save_sims is not None:
        with stage(stopwatch, "save"):
            save_matrix_and_record(sims, save_sims, score_record.record_text(
                sims, scored, averaged=[str(Path(path).resolve()) for path in paths]))
    return result, sims


def load_compared(paths_a: Sequence[str | os.PathLike], paths_b: Sequence[str | os.PathLike],
                  data_dir: str | os.PathLike | None = None,
                  split: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Two models' score matrices of one split, each the average of its paths (`sgraf compare`):
    checked as `evaluate_sims_files` checks its matrices, and against each other, by their shapes
    and the captions their records name (InputError, naming both)."""
    if not paths_a or not paths_b:
        raise InputError("no score matrix given")
    sims_a, scored_a = load_matrices(paths_a, data_dir, split)
    sims_b, scored_b = load_matrices(paths_b, data_dir, split)
    if sims_a.shape != sims_b.shape:
        raise InputError(f"{paths_b[0]}: score matrix of shape {sims_b.shape}, {paths_a[0]} of shape {sims_a.shape}: "
                         "two models are compared on one split")
    score_record.check_same_split(paths_a[0], scored_a, paths_b[0], scored_b)
    return sims_a, sims_b


def load_matrices(paths: Sequence[str | os.PathLike], data_dir: str | os.PathLike | None,
                   split: str | None) -> tuple[np.ndarray, dict[str, Any] | None]:
    """The saved matrix, or the average of several, and the split they score (`score_record`;
    None where neither `data_dir` nor a record says): each checked for the split's shape (with
    `data_dir`; else the first's) and captions (by its record, if it has one), and read through
    once for NaN/inf (InputError naming the file)."""
    matrices = [load_matrix(path) for path in paths]
    given = None
    if data_dir is not None:
        precomp = open_split(data_dir, split or "test")
        expected = (precomp.n_images, precomp.n_captions)
        where = f"split {precomp.split!r} of {data_dir}"
        given = score_record.split_identity(precomp)
    else:
        expected = matrices[0].shape
        where = str(paths[0])
        rows, columns = expected if len(expected) == 2 else (0, 0)
        if rows and (columns < rows or columns % rows):
            transposed = " (the transpose of one?)" if rows > columns and rows % columns == 0 else ""
            raise InputError(f"{paths[0]}: score matrix of shape {expected}; expected (n_images, n_captions) with a "
                             f"whole number of captions per image{transposed}")
    for path, sims in zip(paths, matrices):
        if sims.shape != expected:
            raise InputError(f"{path}: score matrix of shape {sims.shape}, expected {expected} "
                             f"(n_images, n_captions) as {where}")
    records = [score_record.read_record(path, sims) for path, sims in zip(paths, matrices)]
    scored = score_record.common_split(paths, records, given)
    for path, sims in zip(paths, matrices):
        _check_finite_matrix(sims, path)
    return (matrices[0] if len(matrices) == 1 else scoring.average_matrices(matrices)), scored
