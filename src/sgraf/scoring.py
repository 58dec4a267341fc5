"""Score a whole split: encode it once, then every image against every caption, on one process
or shared among several.

The block scorer itself (`sgraf.model.blocks`) is the one every entry point uses; this module
adds what a split needs on top of it, for `sgraf evaluate` and validation during training:

1. `encode_split` runs the encoders once: each image of the precomp file once (the file holds
   each image once; no five copies), captions tokenised, sorted by length and encoded in
   buckets of similar length so that little is spent on padding. Embeddings are float32. The
   models' self-attention global vectors (which depend on one image or one caption only) are
   computed here too, once, instead of once per scoring block.
2. `score_matrix` scores the (image block x caption bucket) tasks through
   `sgraf.model.blocks.score_encoded`, in caption-file order, averaging several models (an SGR
   + SAF ensemble) block by block, with a progress bar. Under ``torchrun`` each process scores
   a contiguous share of fixed image blocks and the shares are gathered, so the result is the
   same for any number of processes.

Precision is one switch (`sgraf.precision.autocast`): ``"bf16"`` runs the encoders and the
scorer under autocast; embeddings and scores are kept in float32 (an ensemble's mean in float64).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from sgraf import distributed
from sgraf.data import token_cache
from sgraf.data.arrays import map_row_chunks
from sgraf.data.vocab import Vocabulary
from sgraf.errors import check_positive_int
from sgraf.model import blocks
from sgraf.model.blocks import (BLOCK_ELEMENTS, IMAGE_BLOCK, CaptionBucket, Encoded, Scorer, check_ensemble,
                                encode_token_buckets, eval_mode, image_globals, model_device, score_encoded)
from sgraf.precision import check_precision
from sgraf.progress import bar as progress_bar
from sgraf.stopwatch import Stopwatch, stage

logger = logging.getLogger(__name__)

# Scores per chunk of `average_matrices` (8 MiB of its float64 result): chunks share the threads
AVERAGE_CHUNK_ELEMENTS = 1 << 20

__all__ = ["CaptionBucket", "Encoded", "Scorer", "encode_images", "encode_captions", "encode_split",
           "image_globals", "score_matrix", "average_matrices", "tokenize_captions", "model_device", "eval_mode",
           "IMAGE_BLOCK", "BLOCK_ELEMENTS"]


def tokenize_captions(captions: Sequence[str], vocab: Any,
                      prefetched: token_cache.Prefetch | None = None) -> list[list[int]]:
    """Token ids of each caption, ``<start>`` ... ``<end>``, via ``vocab.encode``; with a
    `Vocabulary`, read from the token cache when these captions were encoded before, or made
    from the tokens that `prefetched` (`token_cache.prefetch` of their file) kept."""
    if isinstance(vocab, Vocabulary):
        return token_cache.token_ids(captions, vocab, prefetched)
    if prefetched is not None:
        prefetched.cancel()
    return [list(vocab.encode(caption)) for caption in captions]


def encode_images(model: Scorer, images: Any, batch_size: int = 128, precision: str = "fp32",
                  progress: bool = False, source: str | os.PathLike[str] | None = None,
                  boxes: Any = None) -> torch.Tensor:
    """Encode precomp image features in batches (`sgraf.model.blocks.encode_images`), refusing
    NaN/inf in any batch.

    Args:
        model: the model (its device is used).
        images: (n_img, K, D) float32 array, memory-mapped or not, or a tensor.
        batch_size: images per batch.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        progress: show a progress bar on stderr.
        source: the features file named in errors (default: a memory map's own file).
        boxes: (n_img, K, 4) normalised region boxes, for a model with positions.

    Returns:
        (n_img, K, d) float32 region features on the model's device.

    Raises:
        InputError: a feature is NaN/inf (naming the file, image, region and dimension).
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    with progress_bar(len(images), "encoding images", "img", progress, unit_scale=True) as bar:
        return blocks.encode_images(model, images, batch_size, precision, on_batch=bar.update, source=source,
                                    boxes=boxes)


def split_boxes(model: Scorer, split: Any) -> Any:
    """The split's normalised region boxes if `model` reads them (`needs_boxes`), else None;
    a split without boxes is refused in one line (`PrecompSplit.read_boxes(required=True)`)."""
    if not getattr(model, "needs_boxes", False):
        return None
    read = getattr(split, "read_boxes", None)
    return read(required=True) if read is not None else getattr(split, "boxes", None)


def encode_captions(model: Scorer, token_ids: Sequence[Sequence[int]], batch_size: int = 128,
                    precision: str = "fp32", progress: bool = False) -> list[CaptionBucket]:
    """Encode tokenised captions in buckets of similar length (`sgraf.model.blocks.encode_token_buckets`).

    Returns:
        Buckets in decreasing length; ``bucket.index`` maps back to positions in `token_ids`.
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    with progress_bar(len(token_ids), "encoding captions", "cap", progress, unit_scale=True) as bar:
        return encode_token_buckets(model, token_ids, batch_size=batch_size, precision=precision,
                                    on_batch=bar.update)


def encode_split(model: Scorer, split: Any, vocab: Any, batch_size: int = 128, precision: str = "fp32",
                 device: torch.device | str | None = None, progress: bool = False,
                 token_ids: Sequence[Sequence[int]] | None = None, stopwatch: Stopwatch | None = None) -> Encoded:
    """Run the encoders over a split once.

    Args:
        model: the model, already on `device`.
        split: a `sgraf.data.precomp.PrecompSplit` (anything with ``images`` (n_img, K, D) and
            ``captions`` (list of str)).
        vocab: the vocabulary (``vocab.encode(caption)`` gives token ids).
        batch_size: images or captions per encoder batch (also the caption bucket size).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device: accepted for symmetry with the callers; must be the model's device if given.
        progress: progress bars on stderr.
        token_ids: the captions already tokenised with `vocab` (`tokenize_captions`), for a
            caller that needed them before (an ensemble, the unknown-word check).
        stopwatch: times the stages 'tokenise' (without `token_ids`), 'encode images' (with
            the image globals) and 'encode captions' (`sgraf.stopwatch`).

    Returns:
        The `Encoded` split, on the model's device.
    """
    check_precision(precision)
    check_positive_int(batch_size, "batch_size")
    if device is not None and torch.device(device).type != model_device(model).type:  # type: ignore[arg-type]
        raise ValueError(f"encode_split: model is on {model_device(model)}, not on {device}")  # type: ignore[arg-type]
    if token_ids is None:
        with stage(stopwatch, "tokenise"):
            token_ids = tokenize_captions(split.captions, vocab)
    with stage(stopwatch, "encode images"):
        img_embs = encode_images(model, split.images, batch_size, precision, progress,
                                 source=getattr(split, "ims_path", None), boxes=split_boxes(model, split))
        img_glo = image_globals(model, img_embs, batch_size, precision)
    with stage(stopwatch, "encode captions"):
        buckets = encode_captions(model, token_ids, batch_size, precision, progress)
    logger.debug("encoded %d images and %d captions in %d buckets", len(img_embs), len(token_ids), len(buckets))
    return Encoded(img_embs=img_embs, buckets=buckets, n_captions=len(token_ids), img_glo=img_glo)


def score_matrix(models: Sequence[Scorer], encoded: Sequence[Encoded], precision: str = "fp32",
                 image_block: int | None = None, block_elements: int | None = None,
                 progress: bool = False, head: str | None = None, shard: bool = True,
                 keep_on_device: bool = False,
                 on_rows: Callable[[torch.Tensor, slice], Any] | None = None) -> np.ndarray | torch.Tensor:
    """The (n_img, n_cap) score matrix of one model, or the average of several models.

    Args:
        models: one model, or several for an ensemble (each in eval mode during the call).
        encoded: the split encoded by each model (same order, same split).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast around the similarity).
        image_block: images per scoring block (default: `sgraf.model.blocks.block_sizes`).
        block_elements: bound on images x captions x words x features per block (same default).
        progress: progress bar with ETA on stderr (rank 0 only).
        head: passed to ``similarity`` (``"sgr"``/``"saf"`` of a joint model; None: its score).
        shard: under ``torchrun``, let each process score a share of the images and gather.
        keep_on_device: return a tensor where the scores were computed (a CUDA device keeps
            them: `sgraf.metrics` counts the ranks there) instead of numpy.

    Returns:
        numpy (n_img, n_cap) in caption-file order, identical on every process: float32 for one
        model; several are averaged block by block in float64 and kept in float64, as the
        authors' evaluation averages (`sgraf.model.blocks.ENSEMBLE_DTYPE`).
    """
    check_precision(precision)
    if isinstance(models, nn.Module):
        models, encoded = [models], [encoded]  # type: ignore[list-item]
    if not models or len(models) != len(encoded):
        raise ValueError(f"score_matrix: {len(models)} models but {len(encoded)} encoded splits")
    try:
        check_ensemble(encoded)
    except ValueError as error:
        raise ValueError(f"score_matrix: {error}") from None
    if (image_block is not None and image_block < 1) or (block_elements is not None and block_elements < 1):
        raise ValueError("score_matrix: image_block and block_elements must be positive")
    image_block = image_block or blocks.block_sizes(encoded[0].img_embs.device, precision)[0]
    n_img, n_cap = encoded[0].n_images, encoded[0].n_captions
    n_blocks = -(-n_img // image_block)
    shares = distributed.shard_range(n_blocks) if shard else range(n_blocks)
    first_row = min(shares.start * image_block, n_img)
    last_row = min(shares.stop * image_block, n_img)
    show = progress and distributed.is_main_process()
    with progress_bar((last_row - first_row) * n_cap, "scoring", "pair", show, unit_scale=True) as bar:
        share = score_encoded(models, encoded, precision, rows=(first_row, last_row), image_block=image_block,
                              block_elements=block_elements, head=head, on_block=bar.update,
                              keep_on_device=keep_on_device,
                              on_rows=None if shard and distributed.is_distributed() else on_rows)
    if shard and distributed.is_distributed():
        share = distributed.all_gather_cat(share)
    return share if keep_on_device else share.numpy()


def average_matrices(matrices: Sequence[np.ndarray], rows_per_chunk: int | None = None) -> np.ndarray:
    """The float64 mean of equally shaped score matrices: summed in float64 from zero in the
    order given, divided (as the authors average two; `sgraf.model.blocks.ENSEMBLE_DTYPE`).

    By chunks of `rows_per_chunk` rows (default: about `AVERAGE_CHUNK_ELEMENTS` scores), each
    summed in place in its rows of the result, on PyTorch's number of threads
    (`sgraf.data.arrays.map_row_chunks`). Two MSCOCO-5K-size matrices took 2.6-4.5 s in chunks of
    1,024 rows with a new float64 array per operation (each a fresh 200 MB of pages). The 1 GB
    float64 result's pages, faulted in by the first pass, cost most of what is left (about 1 s on
    a 2-core Intel Xeon, against 0.5 s for the float32 mean this replaced)."""
    shape = matrices[0].shape
    out = np.empty(shape, dtype=np.float64)
    elements = AVERAGE_CHUNK_ELEMENTS if rows_per_chunk is None else rows_per_chunk * shape[1]

    def chunk(rows: tuple[int, int]) -> None:
        start, stop = rows
        total = out[start:stop]
        total.fill(0.0)                 # from zero: 0.0 + -0.0 is +0.0
        for matrix in matrices:
            total += matrix[start:stop]
        total /= len(matrices)

    map_row_chunks(chunk, shape[0], int(np.prod(shape[1:])), elements)
    return out
