"""Encode a split once, then score every image against every caption in bounded blocks.

This is the one code path behind `sgraf evaluate`, validation during training and gallery
search:

1. `encode_split` runs the encoders once: each image of the precomp file once (the file holds
   each image once; no five copies), captions sorted by length and encoded in buckets of
   similar length so that little is spent on padding. Embeddings are float32. The models'
   self-attention global vectors (which depend on one image or one caption only) are computed
   here too, once, instead of once per scoring block.
2. `score_matrix` streams over (image block x caption block) pairs through the model's
   vectorised `similarity`, writes each block into a float32 matrix in caption-file order, and
   averages several models (an SGR + SAF ensemble) block by block. Under ``torchrun`` each
   process scores a contiguous share of fixed image blocks and the shares are gathered, so the
   result is the same for any number of processes.

Precision is one switch (`sgraf.precision.autocast`): ``"bf16"`` runs the encoders and the
scorer under autocast; embeddings and scores are kept in float32.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from sgraf import distributed
from sgraf.errors import InputError, check_positive_int
from sgraf.kernels import tuning
from sgraf.precision import autocast, check_precision

logger = logging.getLogger(__name__)

# Images per scoring block. Fixed (never derived from the number of processes), so that every
# block, and therefore every float, is the same whether one process or several score the split.
IMAGE_BLOCK = 16
# Upper bound on image x caption x word x feature elements of one scoring block: the size of
# the largest per-pair intermediate the vectorised similarity builds (float32: 128 MiB).
BLOCK_ELEMENTS = 1 << 25
# Splits of at least this many pairs (a Flickr30K or MSCOCO-1K test split has 5 million) measure
# the CPU thread mode and chunk size for this machine if they were never measured (2-4 s at the
# paper's size, 1-2 % of such a split's first scoring); smaller ones take the stored choices or
# the defaults.
TUNE_MIN_PAIRS = 4_000_000


class Scorer(Protocol):
    """What the scorer needs from a model (`sgraf.model.sgraf.SGRAF` provides it)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor: ...

    def encode_captions(self, captions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...

    def similarity(self, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: torch.Tensor,
                   head: str | None = None) -> torch.Tensor: ...


@dataclass
class CaptionBucket:
    """Captions of similar length, encoded together.

    Attributes:
        index: (n_b,) int64 positions of these captions in the caption file.
        embs: (n_b, L_b, d) float32 word features, zero beyond each length; L_b the longest here.
        lengths: (n_b,) int64 token counts (``<start>`` and ``<end>`` included).
        glo: (n_b, d) float32 eval-mode global vectors of these captions, for models that
            provide ``caption_globals`` (None otherwise); computed once here, not per block.
    """

    index: torch.Tensor
    embs: torch.Tensor
    lengths: torch.Tensor
    glo: torch.Tensor | None = None


@dataclass
class Encoded:
    """A split after the encoders: images once each, captions bucketed by length.

    Attributes:
        img_embs: (n_img, K, d) float32 region features.
        buckets: caption buckets, by decreasing length; together they hold every caption once.
        n_captions: number of captions in the split.
        img_glo: (n_img, d) float32 eval-mode global vectors of the images, for models that
            provide ``image_globals`` (None otherwise).
    """

    img_embs: torch.Tensor
    buckets: list[CaptionBucket]
    n_captions: int
    img_glo: torch.Tensor | None = None

    @property
    def n_images(self) -> int:
        return int(self.img_embs.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """(n_cap,) caption lengths in caption-file order."""
        lengths = torch.zeros(self.n_captions, dtype=torch.int64)
        for bucket in self.buckets:
            lengths[bucket.index.cpu()] = bucket.lengths.cpu()
        return lengths

    @property
    def cap_embs(self) -> torch.Tensor:
        """(n_cap, L, d) word features in caption-file order, padded to the longest caption.

        Materialises a padded copy: meant for small splits and tests; the scorer uses buckets.
        """
        longest = max(int(b.embs.shape[1]) for b in self.buckets)
        first = self.buckets[0].embs
        out = first.new_zeros((self.n_captions, longest, first.shape[2]))
        for bucket in self.buckets:
            out[bucket.index.to(out.device), : bucket.embs.shape[1]] = bucket.embs
        return out


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (CPU for a model without parameters)."""
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(models: Sequence[nn.Module]) -> Iterator[None]:
    """Put `models` in eval mode and without gradients; restore their train/eval state after."""
    was_training = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for model, training in zip(models, was_training):
            model.train(training)


def _progress(total: int, desc: str, enabled: bool, unit: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, dynamic_ncols=True,
                disable=not enabled, leave=False)


def tokenize_captions(captions: Sequence[str], vocab: Any) -> list[list[int]]:
    """Token ids of each caption, ``<start>`` ... ``<end>``, via ``vocab.encode``."""
    return [list(vocab.encode(caption)) for caption in captions]


def encode_images(model: Scorer, images: Any, batch_size: int = 128, precision: str = "fp32",
                  progress: bool = False) -> torch.Tensor:
    """Encode precomp image features in batches.

    Args:
        model: the model (its device is used).
        images: (n_img, K, D) float32 array, memory-mapped or not, or a tensor.
        batch_size: images per batch.
        precision: ``"fp32"`` or ``"bf16"``.
        progress: show a progress bar on stderr.

    Returns:
        (n_img, K, d) float32 region features on the model's device.
    """
    device = model_device(model)  # type: ignore[arg-type]
    n_img = len(images)
    parts = []
    with eval_mode([model]), _progress(n_img, "encoding images", progress, "img") as bar:  # type: ignore[list-item]
        for start in range(0, n_img, check_positive_int(batch_size, "batch_size")):
            batch = images[start:start + batch_size]  # (b, K, D), read from the memory map
            if not isinstance(batch, torch.Tensor):
                batch = torch.from_numpy(np.array(batch, dtype=np.float32))
            with autocast(precision, device):
                parts.append(model.encode_images(batch.float().to(device)).float())  # (b, K, d)
            bar.update(len(batch))
    return torch.cat(parts, dim=0)


def encode_captions(model: Scorer, token_ids: Sequence[Sequence[int]], batch_size: int = 128,
                    precision: str = "fp32", progress: bool = False) -> list[CaptionBucket]:
    """Encode tokenised captions in buckets of similar length.

    Captions are sorted by decreasing length (stably), cut into batches of `batch_size`, and
    each batch is padded only to its own longest caption.

    Returns:
        Buckets in decreasing length; ``bucket.index`` maps back to positions in `token_ids`.
    """
    device = model_device(model)  # type: ignore[arg-type]
    caption_globals = getattr(model, "caption_globals", None)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    if len(token_ids) and int(lengths.min()) < 1:
        raise InputError(f"caption {int(torch.argmin(lengths))}: no tokens")
    order = torch.sort(lengths, descending=True, stable=True).indices
    buckets = []
    with eval_mode([model]), _progress(len(token_ids), "encoding captions", progress, "cap") as bar:  # type: ignore[list-item]
        for start in range(0, len(token_ids), check_positive_int(batch_size, "batch_size")):
            index = order[start:start + batch_size]
            bucket_lengths = lengths[index]
            padded = torch.zeros((len(index), int(bucket_lengths.max())), dtype=torch.int64)
            for row, k in enumerate(index.tolist()):
                padded[row, : len(token_ids[k])] = torch.as_tensor(token_ids[k], dtype=torch.int64)
            with autocast(precision, device):
                embs = model.encode_captions(padded.to(device), bucket_lengths.to(device)).float()  # (b, L_b, d)
                glo = caption_globals(embs, bucket_lengths.to(device)) if caption_globals else None
            buckets.append(CaptionBucket(index=index, embs=embs, lengths=bucket_lengths.to(device), glo=glo))
            bar.update(len(index))
    return buckets


def encode_split(model: Scorer, split: Any, vocab: Any, batch_size: int = 128, precision: str = "fp32",
                 device: torch.device | str | None = None, progress: bool = False) -> Encoded:
    """Run the encoders over a split once.

    Args:
        model: the model, already on `device`.
        split: a `sgraf.data.precomp.PrecompSplit` (anything with ``images`` (n_img, K, D) and
            ``captions`` (list of str)).
        vocab: the vocabulary (``vocab.encode(caption)`` gives token ids).
        batch_size: images or captions per encoder batch (also the caption bucket size).
        precision: ``"fp32"`` or ``"bf16"``.
        device: accepted for symmetry with the callers; must be the model's device if given.
        progress: progress bars on stderr.

    Returns:
        The `Encoded` split, on the model's device.
    """
    check_precision(precision)
    check_positive_int(batch_size, "batch_size")
    if device is not None and torch.device(device).type != model_device(model).type:  # type: ignore[arg-type]
        raise ValueError(f"encode_split: model is on {model_device(model)}, not on {device}")  # type: ignore[arg-type]
    token_ids = tokenize_captions(split.captions, vocab)
    img_embs = encode_images(model, split.images, batch_size, precision, progress)
    buckets = encode_captions(model, token_ids, batch_size, precision, progress)
    logger.debug("encoded %d images and %d captions in %d buckets", len(img_embs), len(token_ids), len(buckets))
    return Encoded(img_embs=img_embs, buckets=buckets, n_captions=len(token_ids),
                   img_glo=image_globals(model, img_embs, batch_size, precision))


def image_globals(model: Scorer, img_embs: torch.Tensor, batch_size: int = 128,
                  precision: str = "fp32") -> torch.Tensor | None:
    """(n_img, d) float32 eval-mode global vectors of encoded images, in batches, for models
    that provide ``image_globals`` (the scorer then skips recomputing them per block); else None."""
    return _per_image(model, "image_globals", img_embs, batch_size, precision)


def _per_image(model: Scorer, method: str, img_embs: torch.Tensor, batch_size: int,
               precision: str = "fp32") -> torch.Tensor | None:
    """The model's optional per-image `method` (``image_globals``, ``region_grams``) of encoded
    images, in batches, concatenated; None if the model lacks it or returns None."""
    compute = getattr(model, method, None)
    if compute is None or len(img_embs) == 0:
        return None
    parts = []
    with eval_mode([model]), autocast(precision, img_embs.device):  # type: ignore[list-item]
        for start in range(0, len(img_embs), batch_size):
            part = compute(img_embs[start:start + batch_size])
            if part is None:
                return None
            parts.append(part)
    return torch.cat(parts)


def _caption_blocks(bucket: CaptionBucket, image_block: int, block_elements: int) -> Iterator[slice]:
    """Slices of a bucket small enough that image_block x captions x L x d <= block_elements."""
    n_b, length, dim = bucket.embs.shape
    per_caption = image_block * length * dim
    step = max(1, block_elements // max(per_caption, 1))
    for start in range(0, n_b, step):
        yield slice(start, start + step)


def score_matrix(models: Sequence[Scorer], encoded: Sequence[Encoded], precision: str = "fp32",
                 image_block: int = IMAGE_BLOCK, block_elements: int = BLOCK_ELEMENTS,
                 progress: bool = False, head: str | None = None, shard: bool = True) -> np.ndarray:
    """The (n_img, n_cap) score matrix of one model, or the average of several models.

    Args:
        models: one model, or several for an ensemble (each in eval mode during the call).
        encoded: the split encoded by each model (same order, same split).
        precision: ``"fp32"`` or ``"bf16"`` (autocast around the similarity).
        image_block: images per scoring block.
        block_elements: bound on images x captions x words x features per block.
        progress: progress bar with ETA on stderr (rank 0 only).
        head: passed to ``similarity`` (``"sgr"``/``"saf"`` of a joint model; None: its score).
        shard: under ``torchrun``, let each process score a share of the images and gather.

    Returns:
        float32 numpy (n_img, n_cap) in caption-file order, identical on every process. Several
        models are averaged block by block in float64, then rounded once to float32.
    """
    check_precision(precision)
    if isinstance(models, nn.Module):
        models, encoded = [models], [encoded]  # type: ignore[list-item]
    if not models or len(models) != len(encoded):
        raise ValueError(f"score_matrix: {len(models)} models but {len(encoded)} encoded splits")
    n_img, n_cap = encoded[0].n_images, encoded[0].n_captions
    for enc in encoded[1:]:
        if (enc.n_images, enc.n_captions) != (n_img, n_cap):
            raise ValueError("score_matrix: the encoded splits of the ensemble differ in size: "
                             f"({n_img}, {n_cap}) vs ({enc.n_images}, {enc.n_captions})")
        if len(enc.buckets) != len(encoded[0].buckets) or any(
                not torch.equal(a.index, b.index) for a, b in zip(enc.buckets, encoded[0].buckets)):
            raise ValueError("score_matrix: the ensemble's captions were bucketed differently "
                             "(encode every model with the same vocabulary and batch size)")
    if image_block < 1 or block_elements < 1:
        raise ValueError("score_matrix: image_block and block_elements must be positive")

    n_blocks = -(-n_img // image_block)
    if shard:
        blocks = distributed.shard_range(n_blocks)
    else:
        blocks = range(n_blocks)
    first_row = min(blocks.start * image_block, n_img)
    last_row = min(blocks.stop * image_block, n_img)
    share = torch.zeros((last_row - first_row, n_cap), dtype=torch.float32)  # (n_rows, n_cap)

    total = (last_row - first_row) * n_cap
    show = progress and distributed.is_main_process()

    def score_task(task: tuple[int, int]) -> None:
        row, bucket_id = task
        rows = slice(row, min(row + image_block, n_img))
        local = slice(rows.start - first_row, rows.stop - first_row)
        reference = encoded[0].buckets[bucket_id]
        block_grams = [None if gram is None else gram[local] for gram in grams]
        with torch.no_grad():  # grad mode is per thread
            for cols in _caption_blocks(reference, image_block, block_elements):
                block = _score_block(models, encoded, rows, bucket_id, cols, precision, head, block_grams)
                share[local, reference.index[cols].cpu()] = block
                bar.update(block.numel())

    starts = range(first_row, last_row, image_block)
    # (image block, caption bucket) tasks in row-major order: small enough that parallel workers
    # finish together; each block is still scored whole by one worker
    tasks = [(row, bucket_id) for row in starts for bucket_id in range(len(encoded[0].buckets))]
    with eval_mode(models), frozen_weights(models), _progress(total, "scoring", show, "pair") as bar:  # type: ignore[arg-type]
        measure = n_img * n_cap >= TUNE_MIN_PAIRS
        workers = score_workers(encoded[0].img_embs.device, precision, len(tasks), models, measure)
        # per model, the Gram matrices of this share's images: once, not once per caption block
        grams = [_per_image(model, "region_grams", enc.img_embs[first_row:last_row], image_block)
                 for model, enc in zip(models, encoded)]
        if measure:
            tune_models(models, precision, encoded[0].img_embs.device, workers)
        with _one_thread_per_op() if workers > 1 else contextlib.nullcontext():
            if workers > 1:
                with ThreadPoolExecutor(workers) as pool:
                    list(pool.map(score_task, tasks))
            else:
                for task in tasks:
                    score_task(task)
    if shard and distributed.is_distributed():
        share = distributed.all_gather_cat(share)
    return share.numpy()


# How the CPU's cores share the scoring: "ops" scores one block at a time with PyTorch's threads
# inside each op; "blocks" scores one block per core in Python threads, each op on one core (the
# scorer's many small ops spread over cores better that way on some processors). The first is
# the default (2-core AMD EPYC Zen 5: blocks about 1.2x faster in bf16, no gain in fp32); which
# is faster is measured once per machine, precision and model size (`thread_mode`).
THREAD_MODES = {"fp32": ("ops", "blocks"), "bf16": ("blocks", "ops"), "fp16": ("ops", "blocks")}


def score_workers(device: torch.device, precision: str, n_tasks: int, models: Sequence[Scorer] = (),
                  measure: bool = False) -> int:
    """Threads that score (image block, caption bucket) tasks side by side: 1 ("ops", or not on a
    CPU), else one per core ("blocks"; see `THREAD_MODES` and `thread_mode`, which measures only
    if `measure`). Each block is computed by one thread from start to end, so the result does not
    depend on which thread took it."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < 2 or n_tasks < 2:
        return 1
    return min(threads, n_tasks) if thread_mode(models, precision, device, measure) == "blocks" else 1


def thread_mode(models: Sequence[Scorer], precision: str, device: torch.device, measure: bool = True) -> str:
    """"ops" or "blocks" for scoring `models` at `precision` on this CPU: measured once per machine
    on a synthetic block of the first model (`probe_block`), stored (`sgraf.kernels.tuning`).
    The stored choice or the default when not `measure`, for models without a probe, and under
    torchrun (see `tune_models`)."""
    candidates = THREAD_MODES[precision]
    model = models[0] if models else None
    probe = getattr(model, "probe_block", None)
    name = f"cpu scoring threads|{precision}|{model.size_key() if probe else 'any model'}"  # type: ignore[union-attr]
    if not measure or probe is None or distributed.is_distributed():
        return tuning.peek(name, candidates)
    threads = torch.get_num_threads()
    blocks: list[Any] = []          # the synthetic block, made at the first measurement only

    def seconds(mode: str) -> float:
        if not blocks:
            blocks.append(probe())
        return block_timer(precision, device, threads if mode == "blocks" else 1)(blocks[0])

    return tuning.choose(name, candidates, seconds)


def block_timer(precision: str, device: torch.device, workers: int) -> Any:
    """A function that times a block-scoring function the way the scorer runs blocks: seconds per
    block, best of 2 after a warm-up, one block at a time, or `workers` blocks at once in Python
    threads with one thread per op (so that the cores share the caches and memory as they will)."""
    def timer(score_block: Any) -> float:
        def one(_: Any = None) -> None:
            with autocast(precision, device):     # autocast is per thread
                score_block()

        if workers == 1:
            return tuning.best_time(one, repeats=2)
        with _one_thread_per_op(), ThreadPoolExecutor(workers) as pool:
            return tuning.best_time(lambda: list(pool.map(one, range(workers))), repeats=2) / workers

    return timer


def tune_models(models: Sequence[Scorer], precision: str, device: torch.device, workers: int = 1) -> None:
    """Let each model that offers ``tune_eval_chunks`` measure its chunk size for this machine and
    precision (once per machine, see `sgraf.kernels.tuning`) the way the scorer will run blocks
    (`workers` at once), and use it for the split (inside its ``frozen_weights``). Skipped under
    torchrun: processes that measured apart could choose apart, and the matrix must not depend
    on the number of processes (each takes the stored choice or the default)."""
    if distributed.is_distributed():
        return
    for model in models:
        tune = getattr(model, "tune_eval_chunks", None)
        if tune is not None:
            with autocast(precision, device):
                tune(device, block_timer(precision, device, workers),
                     f"{workers} blocks at once" if workers > 1 else "")


@contextlib.contextmanager
def _one_thread_per_op() -> Iterator[None]:
    """PyTorch's intra-op threads (a process-wide setting) set to 1 for the duration, then restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def frozen_weights(models: Sequence[Scorer]) -> Iterator[None]:
    """Let each model that offers ``frozen_weights`` prepare its weight-only constants once."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if hasattr(model, "frozen_weights"):
                stack.enter_context(model.frozen_weights())
        yield


def _score_block(models: Sequence[Scorer], encoded: Sequence[Encoded], rows: slice, bucket_id: int,
                 cols: slice, precision: str, head: str | None,
                 grams: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One (images x captions) block, averaged over the models: float32 on the CPU."""
    blocks = []
    for index, (model, enc) in enumerate(zip(models, encoded)):
        bucket = enc.buckets[bucket_id]
        device = enc.img_embs.device
        cached = {}
        if enc.img_glo is not None and bucket.glo is not None:
            cached = {"img_glo": enc.img_glo[rows], "cap_glo": bucket.glo[cols]}
        if grams is not None and grams[index] is not None:
            cached["gram"] = grams[index]
        with autocast(precision, device):
            scores = model.similarity(enc.img_embs[rows], bucket.embs[cols], bucket.lengths[cols],
                                      head=head, **cached)  # (b_img, b_cap)
        blocks.append(scores.float().cpu())
    if len(blocks) == 1:
        return blocks[0]
    # Average in float64 and round once: the float32 nearest to the exact mean of the models.
    return torch.stack(blocks).double().mean(dim=0).float()


def average_matrices(matrices: Sequence[np.ndarray], rows_per_chunk: int = 1024) -> np.ndarray:
    """The float32 mean of equally shaped score matrices, computed in float64 by row chunks."""
    shape = matrices[0].shape
    out = np.empty(shape, dtype=np.float32)
    for start in range(0, shape[0], rows_per_chunk):
        chunk = sum(np.asarray(m[start:start + rows_per_chunk], dtype=np.float64) for m in matrices)
        out[start:start + rows_per_chunk] = chunk / len(matrices)
    return out
