"""The block scorer behind every entry point: images x captions in length buckets, with what does
not depend on a block computed once per call.

`SGRAF.score`, `Matcher.score` / `score_embeddings` (and so gallery search re-ranking), training
validation and `sgraf evaluate` all score through `score_encoded`:

- captions are sorted by length and held in buckets, each padded only to its own longest
  caption (`encode_token_buckets` from token ids, `bucket_words` from word embeddings), so no
  block pays for padding to the longest caption of the call;
- per model and call, the weight-only constants (folded SGR weights, cast similarity layers)
  are prepared once (`frozen_weights`), the self-attention global vectors of every image and
  caption are computed once (`image_globals`, `CaptionBucket.glo`), and each image block's Gram
  matrices once (`region_grams`), not once per block;
- the work is cut into (image block, caption bucket) tasks, each scored whole by one worker.
  On a CPU the thread mode and the chunk size are measured once per machine (`thread_mode`,
  `tune_models`); on a GPU the blocks are sized from the device's free memory (`block_sizes`)
  and the scores stay on the device until the end (no host synchronisation per block).

Models are duck-typed (`Scorer`); nothing here imports the SGRAF network itself.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from sgraf import distributed
from sgraf.data.arrays import check_finite_features, mapped_file, padded_ids
from sgraf.errors import InputError
from sgraf.kernels import plan, tuning
from sgraf.precision import autocast, check_precision

# CPU: images per scoring block, and an upper bound on image x caption x word x feature elements
# of one block (the size of the largest per-pair intermediate: float32 128 MiB); the eval fast
# path then cuts a block into cache-sized chunks. Fixed (never derived from the number of
# processes), so that every block, and therefore every float, is the same whether one process
# or several score a split.
IMAGE_BLOCK = 16
BLOCK_ELEMENTS = 1 << 25
# GPU: images per block, and the share of the free device memory that a block's largest
# intermediate may take (the block's other intermediates are a few times its size). Large blocks
# keep the GPU busy instead of waiting on kernel launches (256 x 1,024 scored MSCOCO-5K-size
# 4x faster than 16 x 128 on an H100: ../shared/gpu/README.md).
GPU_IMAGE_BLOCK = 256
# GPU: consecutive caption buckets (sorted by length, so little padding is added) are scored
# together up to this many captions: 256 x 1,024 blocks scored twice as fast as 256 x 128.
GPU_CAPTION_BLOCK = 1024
GPU_MEMORY_SHARE = 1 / 16
GPU_MAX_ELEMENTS = 1 << 31
# Calls scoring at least this many pairs (a Flickr30K or MSCOCO-1K test split has 5 million)
# measure the CPU thread mode and chunk size for this machine if they were never measured (2-4 s
# at the paper's size, 1-2 % of such a split's first scoring); smaller ones take the stored
# choices or the defaults.
TUNE_MIN_PAIRS = 4_000_000
# How the CPU's cores share the scoring: "ops" scores one block at a time with PyTorch's threads
# inside each op; "blocks" scores one block per core in Python threads, each op on one core (the
# scorer's many small ops spread over cores better that way on some processors). The first is
# the default (2-core AMD EPYC Zen 5: blocks about 1.2x faster in bf16, no gain in fp32); which
# is faster is measured once per machine, precision and model size (`thread_mode`).
THREAD_MODES = {"fp32": ("ops", "blocks"), "bf16": ("blocks", "ops"), "fp16": ("ops", "blocks")}


class Scorer(Protocol):
    """What the scorer needs from a model (`sgraf.model.sgraf.SGRAF` provides it; the optional
    `image_globals`, `caption_globals`, `region_grams`, `frozen_weights`, `probe_block` and
    `tune_eval` are used when present)."""

    def encode_images(self, images: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor: ...

    def encode_captions(self, captions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...

    def similarity(self, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: torch.Tensor,
                   head: str | None = None) -> torch.Tensor: ...


@dataclass
class CaptionBucket:
    """Captions of similar length, encoded together.

    Attributes:
        index: (n_b,) int64 positions of these captions among all captions of the call.
        embs: (n_b, L_b, d) float32 word features, zero beyond each length; L_b the longest here.
        lengths: (n_b,) int64 token counts (``<start>`` and ``<end>`` included), on the CPU
            whatever the device: the scorer sizes its blocks from them without waiting for it.
        glo: (n_b, d) float32 eval-mode global vectors of these captions, for models that
            provide ``caption_globals`` (None otherwise); computed once here, not per block.
    """

    index: torch.Tensor
    embs: torch.Tensor
    lengths: torch.Tensor
    glo: torch.Tensor | None = None


@dataclass
class Encoded:
    """Images and captions after one model's encoders: images once each, captions in buckets.

    Attributes:
        img_embs: (n_img, K, d) float32 region features.
        buckets: caption buckets, by decreasing length; together they hold every caption once.
        n_captions: number of captions.
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
        """(n_cap,) caption lengths in the callers' caption order."""
        lengths = torch.zeros(self.n_captions, dtype=torch.int64)
        for bucket in self.buckets:
            lengths[bucket.index.cpu()] = bucket.lengths.cpu()
        return lengths

    def fold(self, images: slice, captions: slice) -> "Encoded":
        """Images `images` and captions `captions` (consecutive, `slice(start, stop)`) of this
        encoding, the captions' buckets kept in their order and numbered from the fold's first
        (the diagonal block of a K-fold evaluation, scored without the rest of the matrix)."""
        buckets = []
        for bucket in self.buckets:
            where = bucket.index.cpu()
            keep = (where >= captions.start) & (where < captions.stop)
            if not bool(keep.any()):
                continue
            lengths = bucket.lengths.cpu()[keep]
            rows = keep.nonzero().squeeze(1).to(bucket.embs.device)
            buckets.append(CaptionBucket(index=(where[keep] - captions.start).to(bucket.index.device),
                                         embs=bucket.embs[rows, : int(lengths.max())], lengths=lengths,
                                         glo=None if bucket.glo is None else bucket.glo[rows]))
        return Encoded(img_embs=self.img_embs[images], buckets=buckets, n_captions=captions.stop - captions.start,
                       img_glo=None if self.img_glo is None else self.img_glo[images])

    @property
    def cap_embs(self) -> torch.Tensor:
        """(n_cap, L, d) word features in the callers' order, padded to the longest caption.

        Materialises a padded copy: meant for small splits and tests; the scorer uses buckets.
        """
        longest = max(int(b.embs.shape[1]) for b in self.buckets)
        first = self.buckets[0].embs
        out = first.new_zeros((self.n_captions, longest, first.shape[2]))
        for bucket in self.buckets:
            out[bucket.index.to(out.device, non_blocking=True), : bucket.embs.shape[1]] = bucket.embs
        return out


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (CPU for a model without parameters)."""
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (float32 for a model without any):
    inputs are cast to it, and embeddings kept in it (a float64 model scores in float64)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def copied(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose recurrent layers' weights are one block of memory again:
    `copy.deepcopy` leaves a CUDA GRU's weights apart, and cuDNN would then compact them (and
    warn) at every call."""
    import copy

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return twin


@contextlib.contextmanager
def eval_mode(models: Sequence[nn.Module]) -> Iterator[None]:
    """Put `models` in eval mode and without gradients; restore their train/eval state after.

    Models already in eval mode are left alone: `eval()` walks every submodule, which cost a
    quarter of a small call (a search re-ranking 50 images) when done on every block. A model in
    training gets each submodule's own mode back (a BatchNorm its user froze stays in eval).
    Threads that score one model in training at once share its eval spell: the first to enter
    saves the modes, the last to leave puts them back (each call had saved and restored its own,
    so one call's restore put the model in training under another's scores, and its BatchNorm
    statistics moved).
    """
    entered = []
    with _EVAL_LOCK:
        for model in models:
            held = _EVAL_HELD.get(id(model))
            if held is None and model.training:
                held = _EVAL_HELD[id(model)] = [0, {module: module.training for module in model.modules()}]
                for module in held[1]:
                    module.training = False
            if held is not None:
                held[0] += 1
                entered.append(model)
    try:
        with torch.no_grad():
            yield
    finally:
        with _EVAL_LOCK:
            for model in entered:
                held = _EVAL_HELD[id(model)]
                held[0] -= 1
                if held[0] == 0:
                    del _EVAL_HELD[id(model)]
                    for module, mode in held[1].items():
                        module.training = mode


_EVAL_LOCK = threading.Lock()
_EVAL_HELD: dict[int, list[Any]] = {}     # id(model) -> [calls inside, its modules' modes before]


@contextlib.contextmanager
def frozen_weights(models: Sequence[Scorer]) -> Iterator[None]:
    """Let each model that offers ``frozen_weights`` prepare its weight-only constants once."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if hasattr(model, "frozen_weights"):
                stack.enter_context(model.frozen_weights())
        yield


# ---------------------------------------------------------------------------------- encoding
def encode_images(model: Scorer, images: Any, batch_size: int = 128, precision: str = "fp32",
                  on_batch: Callable[[int], Any] | None = None, source: str | os.PathLike[str] | None = None,
                  boxes: Any = None) -> torch.Tensor:
    """Region features (n_img, K, D) (array, memory map or tensor) -> (n_img, K, d) float32 on the
    model's device, in batches of `batch_size`; `on_batch(n)` after each batch (progress).

    Each batch is checked for NaN/inf as it is read (InputError naming `source`, default a
    memory map's own file, and the image, region and dimension). `boxes`: (n_img, K, 4)
    normalised region boxes (array or tensor), passed batch by batch to a model that reads
    them (`needs_boxes`); a model with positions refuses a call without them."""
    device, dtype = model_device(model), model_dtype(model)  # type: ignore[arg-type]
    needs_boxes = bool(getattr(model, "needs_boxes", False))
    if needs_boxes and boxes is None:
        positions = model.config.positions  # type: ignore[attr-defined]
        raise InputError(f"this model (positions={positions!r}) needs each region's box; the images came without boxes")
    if needs_boxes and len(boxes) != len(images):
        raise InputError(f"{len(boxes)} images' boxes for {len(images)} images; expected one (K, 4) array per image")
    source, first_row = (source, 0) if source else mapped_file(images)
    parts = []
    reading = read_ahead(images, batch_size, source, first_row, device)
    with eval_mode([model]), reading as batches:  # type: ignore[list-item]
        for start, batch in batches:
            batch = batch.to(dtype)
            if device.type == "cuda" and batch.device.type == "cpu":
                # page-locked, so the copy runs beside the previous batch's kernels
                batch = (batch if batch.is_pinned() else batch.pin_memory()).to(device, non_blocking=True)
            with autocast(precision, device):
                if needs_boxes:
                    batch_boxes = _as_tensor(boxes[start:start + batch_size]).to(device, dtype)  # (b, K, 4)
                    parts.append(model.encode_images(batch.to(device), batch_boxes).to(dtype))
                else:
                    parts.append(model.encode_images(batch.to(device)).to(dtype))  # (b, K, d)
            if on_batch is not None:
                on_batch(len(batch))
    return torch.cat(parts, dim=0)


# Threads that read image batches off a memory map ahead of the encoder under the GPU plan
# (`read_ahead`), where the encoder takes little time and the reading is most of the stage
READ_THREADS_GPU = 4
READ_AHEAD_BATCHES = 2     # ... per thread at most (each batch a (b, K, D) float32 copy)


@contextlib.contextmanager
def read_ahead(images: Any, batch_size: int, source: str | os.PathLike[str] | None, first_row: int,
               device: torch.device) -> Iterator[Iterator[tuple[int, torch.Tensor]]]:
    """(start, (b, K, D) CPU tensor) of each batch of `images`, in order, each checked for NaN/inf.

    A tensor is sliced in place. An array or memory map is copied once per batch into a float32
    tensor: under the GPU plan (`sgraf.kernels.plan`) by `READ_THREADS_GPU` threads ahead of the
    caller, into page-locked memory for a CUDA device (its copy to the device then needs no
    second copy, as `pin_memory` made, and the caching host allocator's blocks are reused);
    elsewhere on the caller's thread (a 2-core AMD EPYC Zen 3 read 3,000 paper-size images in
    0.2-0.4 s there and 0.6-0.8 s through one thread beside it: memory freed on another thread
    than the one that filled it). A batch with NaN/inf raises its `InputError` when the caller
    reaches it; leaving the context cancels the batches not read yet."""
    starts = range(0, len(images), batch_size)
    pinned = device.type == "cuda"

    def read(start: int) -> torch.Tensor:
        part = images[start:start + batch_size]                       # (b, K, D), off the memory map
        if pinned and not isinstance(part, torch.Tensor):
            batch = torch.empty(tuple(np.shape(part)), dtype=torch.float32, pin_memory=True)
            np.copyto(batch.numpy(), part, casting="unsafe")          # as np.array(part, np.float32)
        else:   # numpy's own allocation: on Linux in huge pages (about half the page faults' time)
            batch = _as_tensor(part)
        check_finite_features(batch, source, first_image=first_row + start)
        return batch

    if isinstance(images, torch.Tensor) or not plan.gpu_plan(device):
        yield ((start, read(start)) for start in starts)
        return
    pool = ThreadPoolExecutor(READ_THREADS_GPU, thread_name_prefix="sgraf-read")
    pending: collections.deque = collections.deque()
    upcoming = iter(starts)

    def fill() -> None:
        for start in itertools.islice(upcoming, READ_THREADS_GPU * READ_AHEAD_BATCHES - len(pending)):
            pending.append((start, pool.submit(read, start)))

    def ordered() -> Iterator[tuple[int, torch.Tensor]]:
        fill()
        while pending:
            start, future = pending.popleft()
            batch = future.result()
            fill()
            yield start, batch
    try:
        yield ordered()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _as_tensor(values: Any) -> torch.Tensor:
    """A float32 tensor of an array slice (a copy off a memory map) or the tensor itself."""
    from sgraf.data.arrays import as_float32

    return values if isinstance(values, torch.Tensor) else torch.from_numpy(as_float32(values, copy=True))


def encode_token_buckets(model: Scorer, token_ids: Sequence[Sequence[int]] | torch.Tensor,
                         lengths: torch.Tensor | None = None, batch_size: int = 128, precision: str = "fp32",
                         on_batch: Callable[[int], Any] | None = None) -> list[CaptionBucket]:
    """Encode captions in buckets of similar length.

    Captions are sorted by decreasing length (stably), cut into buckets of `batch_size` (under
    the GPU plan at least `GPU_CAPTION_BLOCK`, the captions the scorer joins into a block anyway:
    fewer, larger encoder calls), and each bucket is encoded padded only to its own longest
    caption; the model's caption global vectors are computed per bucket, once.

    Args:
        token_ids: lists of token ids, or a padded (n, L) int64 tensor with `lengths`.

    Returns:
        Buckets by decreasing length; ``bucket.index`` maps back to positions in `token_ids`.
    """
    device, dtype = model_device(model), model_dtype(model)  # type: ignore[arg-type]
    if isinstance(token_ids, torch.Tensor):
        padded_all = token_ids
        lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu()
    else:
        padded_all = None
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    if len(lengths) and int(lengths.min()) < 1:
        raise InputError(f"caption {int(torch.argmin(lengths))}: no tokens")
    caption_globals = getattr(model, "caption_globals", None)
    buckets = []
    with eval_mode([model]):  # type: ignore[list-item]
        for index, bucket_lengths in _length_buckets(lengths, batch_size, device):
            width = int(bucket_lengths.max())
            if padded_all is not None:
                padded = padded_all[index.to(padded_all.device, non_blocking=True), :width]
            else:
                padded = padded_ids([token_ids[k] for k in index.tolist()])
            with autocast(precision, device):
                padded = padded.to(device, non_blocking=True)
                embs = model.encode_captions(padded, bucket_lengths).to(dtype)  # (b, L_b, d)
                glo = caption_globals(embs, bucket_lengths) if caption_globals else None
            buckets.append(CaptionBucket(index=index, embs=embs, lengths=bucket_lengths, glo=glo))
            if on_batch is not None:
                on_batch(len(index))
    return buckets


def _length_buckets(lengths: torch.Tensor, batch_size: int,
                    device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(positions, lengths) of each bucket: captions sorted by decreasing length (stably), cut
    into buckets of `batch_size` (at least `GPU_CAPTION_BLOCK` under the GPU plan of `device`).
    `encode_token_buckets` and `bucket_words` bucket alike, so an ensemble encoded either way
    shares its buckets."""
    order = torch.sort(lengths, descending=True, stable=True).indices
    batch_size = max(batch_size, GPU_CAPTION_BLOCK) if plan.gpu_plan(device) else batch_size
    for start in range(0, len(lengths), batch_size):
        index = order[start:start + batch_size]
        yield index, lengths[index]


def bucket_words(model: Scorer, words: torch.Tensor, lengths: torch.Tensor, batch_size: int = 128,
                 precision: str = "fp32") -> list[CaptionBucket]:
    """Already encoded word features (n, L, d), zero beyond each length, in length buckets as
    `encode_token_buckets` makes them (each trimmed to its own longest caption), with the
    model's caption global vectors computed once per bucket."""
    device = model_device(model)  # type: ignore[arg-type]
    lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu()
    caption_globals = getattr(model, "caption_globals", None)
    buckets = []
    with eval_mode([model]):  # type: ignore[list-item]
        for index, bucket_lengths in _length_buckets(lengths, batch_size, device):
            rows = index.to(words.device, non_blocking=True)
            embs = words[rows, : int(bucket_lengths.max())].to(device, model_dtype(model))
            with autocast(precision, device):
                glo = caption_globals(embs, bucket_lengths) if caption_globals else None
            buckets.append(CaptionBucket(index=index, embs=embs, lengths=bucket_lengths, glo=glo))
    return buckets


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


def encode(model: Scorer, images: Any, token_ids: Sequence[Sequence[int]] | torch.Tensor,
           lengths: torch.Tensor | None = None, batch_size: int = 128, precision: str = "fp32",
           boxes: Any = None) -> Encoded:
    """Images and captions through one model's encoders, as the scorer takes them (`boxes` as in
    `encode_images`)."""
    img_embs = encode_images(model, images, batch_size, precision, boxes=boxes)
    buckets = encode_token_buckets(model, token_ids, lengths, batch_size, precision)
    return Encoded(img_embs=img_embs, buckets=buckets, n_captions=sum(len(b.index) for b in buckets),
                   img_glo=image_globals(model, img_embs, batch_size, precision))


# ---------------------------------------------------------------------------------- scoring
def block_sizes(device: torch.device, precision: str, embed_size: int | None = None) -> tuple[int, int]:
    """(images per block, bound on a block's image x caption x word x feature elements).

    CPU: `IMAGE_BLOCK`, `BLOCK_ELEMENTS` (the eval fast path cuts blocks into cache-sized
    chunks). CUDA: `GPU_IMAGE_BLOCK` images, and as many elements as `GPU_MEMORY_SHARE` of the
    device's free memory holds in the matmul dtype (at most `GPU_MAX_ELEMENTS`, at least the CPU
    bound), so that a block is one launch of each kernel over thousands of pairs.
    """
    if not plan.gpu_plan(device):
        return IMAGE_BLOCK, BLOCK_ELEMENTS
    itemsize = 4 if precision == "fp32" else 2
    elements = int(plan.free_memory(device) * GPU_MEMORY_SHARE) // itemsize
    return GPU_IMAGE_BLOCK, max(BLOCK_ELEMENTS, min(GPU_MAX_ELEMENTS, elements))


def merge_buckets(buckets: Sequence[CaptionBucket], max_captions: int) -> list[CaptionBucket]:
    """Consecutive buckets joined into buckets of at most `max_captions` captions (a bucket
    larger than that stays whole), each padded to its own longest caption. Buckets come sorted
    by decreasing length, so a joined bucket pads its later captions only a little."""
    groups: list[list[CaptionBucket]] = []
    for bucket in buckets:
        if groups and sum(len(b.index) for b in groups[-1]) + len(bucket.index) <= max_captions:
            groups[-1].append(bucket)
        else:
            groups.append([bucket])
    merged = []
    for group in groups:
        if len(group) == 1:
            merged.append(group[0])
            continue
        width = max(int(b.embs.shape[1]) for b in group)
        embs = torch.cat([nn.functional.pad(b.embs, (0, 0, 0, width - b.embs.shape[1])) for b in group])
        glo = None if any(b.glo is None for b in group) else torch.cat([b.glo for b in group])  # type: ignore[misc]
        merged.append(CaptionBucket(index=torch.cat([b.index for b in group]), embs=embs,
                                    lengths=torch.cat([b.lengths for b in group]), glo=glo))
    return merged


def check_ensemble(encoded: Sequence[Encoded]) -> None:
    """ValueError unless every model's encoding has the same sizes and the same buckets."""
    n_img, n_cap = encoded[0].n_images, encoded[0].n_captions
    for enc in encoded[1:]:
        if (enc.n_images, enc.n_captions) != (n_img, n_cap):
            raise ValueError("the encodings of the ensemble differ in size: "
                             f"({n_img}, {n_cap}) vs ({enc.n_images}, {enc.n_captions})")
        if len(enc.buckets) != len(encoded[0].buckets) or any(
                not torch.equal(a.index, b.index) for a, b in zip(enc.buckets, encoded[0].buckets)):
            raise ValueError("the ensemble's captions were bucketed differently "
                             "(encode every model with the same vocabulary and batch size)")


def score_encoded(models: Sequence[Scorer], encoded: Sequence[Encoded], precision: str = "fp32",
                  rows: tuple[int, int] | None = None, image_block: int | None = None,
                  block_elements: int | None = None, head: str | None = None,
                  on_block: Callable[[int], Any] | None = None,
                  caption_block: int | None = None, keep_on_device: bool = False,
                  on_rows: Callable[[torch.Tensor, slice], Any] | None = None) -> torch.Tensor:
    """Scores of images `rows` (default: all) against every caption, one model or the mean of
    several: (n_rows, n_cap) on the CPU (with `keep_on_device`, on the CUDA device that scored
    them), in the callers' caption order; float32 for one model, float64 for several (`ENSEMBLE_DTYPE`).

    Args:
        models: one model, or several for an ensemble (each in eval mode during the call).
        encoded: each model's `Encoded` (same images, same caption buckets).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast around the similarity).
        rows: (first, end) image rows to score; must start on an `image_block` boundary.
        image_block, block_elements: block sizes (default: `block_sizes` for the device; on a CPU
            a call with few captions takes as many images per block as `block_elements` allows).
        head: passed to ``similarity`` (``"sgr"``/``"saf"`` of a joint model; None: its score).
        on_block: called with the number of pairs of each block scored (progress).
        caption_block: join consecutive caption buckets up to this many captions (default: on
            CUDA `GPU_CAPTION_BLOCK`; on the CPU the buckets stay as encoded).

    Several models are averaged block by block in float64 and kept so.
    """
    check_precision(precision)
    if not models or len(models) != len(encoded):
        raise ValueError(f"{len(models)} models but {len(encoded)} encodings")
    check_ensemble(encoded)
    device = encoded[0].img_embs.device
    gpu = plan.gpu_plan(device)
    if caption_block is None and gpu:
        caption_block = GPU_CAPTION_BLOCK
    if caption_block is not None:
        if caption_block < 1:
            raise ValueError("caption_block must be positive")
        encoded = [Encoded(img_embs=enc.img_embs, buckets=merge_buckets(enc.buckets, caption_block),
                           n_captions=enc.n_captions, img_glo=enc.img_glo) for enc in encoded]
    default_block, default_elements = block_sizes(device, precision)
    block_elements = block_elements or default_elements
    n_img, n_cap = encoded[0].n_images, encoded[0].n_captions
    first_row, last_row = rows if rows is not None else (0, n_img)
    if image_block is None and not gpu:
        # few captions (a search re-ranking its shortlist): as many images per block as the
        # element bound allows, not 16, so that a call is a few large ops instead of many small
        # ones (2.5x faster for 50 images x 1 caption); split scorers pass their fixed blocks
        widest = max((b.embs.shape[0] * b.embs.shape[1] * b.embs.shape[2] for b in encoded[0].buckets), default=1)
        image_block = max(default_block, min(last_row - first_row, block_elements // max(widest, 1)))
    image_block = image_block or default_block
    if image_block < 1 or block_elements < 1:
        raise ValueError("image_block and block_elements must be positive")
    # on a GPU the scores stay on the device until the end: no host synchronisation per block
    share = torch.zeros((last_row - first_row, n_cap), dtype=score_dtype(len(models)),
                        device=device if device.type == "cuda" else "cpu")
    indices = [bucket.index.to(share.device, non_blocking=True) for bucket in encoded[0].buckets]

    def score_task(task: tuple[int, int]) -> None:
        row, bucket_id = task
        block_rows = slice(row, min(row + image_block, last_row))
        local = slice(block_rows.start - first_row, block_rows.stop - first_row)
        reference = encoded[0].buckets[bucket_id]
        block_grams = [None if gram is None else gram[local] for gram in grams]
        with torch.no_grad():  # grad mode is per thread
            for cols in _caption_blocks(reference, image_block, block_elements):
                block = _score_block(models, encoded, block_rows, bucket_id, cols, precision, head, block_grams)
                share[local, indices[bucket_id][cols]] = block.to(share.device)
                if on_block is not None:
                    on_block(block.numel())

    # (image block, caption bucket) tasks in row-major order: small enough that parallel workers
    # finish together; each block is still scored whole by one worker
    tasks = [(row, bucket_id) for row in range(first_row, last_row, image_block)
             for bucket_id in range(len(encoded[0].buckets))]
    with eval_mode(models), frozen_weights(models):  # type: ignore[arg-type]
        measure = n_img * n_cap >= TUNE_MIN_PAIRS
        workers = score_workers(device, precision, len(tasks), models, measure)
        # per model, the Gram matrices of these images: once, not once per caption block
        grams = [_per_image(model, "region_grams", enc.img_embs[first_row:last_row], image_block, precision)
                 for model, enc in zip(models, encoded)]
        if measure:
            tune_models(models, precision, device, workers)
        with _one_thread_per_op() if workers > 1 else contextlib.nullcontext():
            if workers > 1:
                with ThreadPoolExecutor(workers) as pool:
                    list(pool.map(score_task, tasks))
            else:
                for row, bucket_id in tasks:
                    score_task((row, bucket_id))
                    if on_rows is not None and bucket_id == len(encoded[0].buckets) - 1:
                        on_rows(share, slice(row - first_row, min(row + image_block, last_row) - first_row))
    return share if keep_on_device else share.cpu()


def _caption_blocks(bucket: CaptionBucket, image_block: int, block_elements: int) -> Iterator[slice]:
    """Slices of a bucket small enough that image_block x captions x L x d <= block_elements."""
    n_b, length, dim = bucket.embs.shape
    per_caption = image_block * length * dim
    step = max(1, block_elements // max(per_caption, 1))
    for start in range(0, n_b, step):
        yield slice(start, start + step)


def _score_block(models: Sequence[Scorer], encoded: Sequence[Encoded], rows: slice, bucket_id: int,
                 cols: slice, precision: str, head: str | None,
                 grams: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One (images x captions) block on the models' device: float32 scores of one model, the
    float64 mean of several."""
    blocks = []
    for index, (model, enc) in enumerate(zip(models, encoded)):
        bucket = enc.buckets[bucket_id]
        cached = {}
        if enc.img_glo is not None and bucket.glo is not None:
            cached = {"img_glo": enc.img_glo[rows], "cap_glo": bucket.glo[cols]}
        if grams is not None and grams[index] is not None:
            cached["gram"] = grams[index]
        with autocast(precision, enc.img_embs.device):
            scores = model.similarity(enc.img_embs[rows], bucket.embs[cols], bucket.lengths[cols],
                                      head=head, **cached)  # (b_img, b_cap)
        blocks.append(scores.float())
    if len(blocks) == 1:
        return blocks[0]
    return torch.stack(blocks).double().mean(dim=0)


# An ensemble's scores: the mean of its models' float32 scores, in float64 and never rounded back.
# The authors' evaluation holds each model's scores in float64 arrays (`np.zeros`) and averages
# there; rounded to float32, two means closer than half a float32 step tie, and the tie-break
# ranked them (on a synthetic 1,000 x 5,000 pair with an e2e-like spread, 21 ranks differed).
ENSEMBLE_DTYPE = torch.float64


def score_dtype(n_models: int) -> torch.dtype:
    """The dtype of the scores of `n_models` averaged: float32 for one, `ENSEMBLE_DTYPE` for several."""
    return torch.float32 if n_models == 1 else ENSEMBLE_DTYPE


# ---------------------------------------------------------------------------------- CPU threads
def score_workers(device: torch.device, precision: str, n_tasks: int, models: Sequence[Scorer] = (),
                  measure: bool = False) -> int:
    """Threads that score (image block, caption bucket) tasks side by side: 1 ("ops", or not on a
    CPU), else one per core ("blocks"; see `THREAD_MODES` and `thread_mode`, which measures only
    if `measure`). Each block is computed by one thread from start to end, so the result does not
    depend on which thread took it."""
    threads = torch.get_num_threads()
    if plan.gpu_plan(device) or torch.device(device).type != "cpu" or threads < 2 or n_tasks < 2:
        return 1          # a device (MPS too: its queue is not for several threads at once) takes one
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


def block_timer(precision: str, device: torch.device, workers: int) -> Callable[[Callable[[], None]], float]:
    """A function that times a block-scoring function the way the scorer runs blocks: seconds per
    block, best of 2 after a warm-up, one block at a time, or `workers` blocks at once in Python
    threads with one thread per op (so that the cores share the caches and memory as they will)."""
    def timer(score_block: Callable[[], None]) -> float:
        def one(_: Any = None) -> None:
            with autocast(precision, device):     # autocast is per thread
                score_block()

        if workers == 1:
            return tuning.best_time(one, repeats=2)
        with _one_thread_per_op(), ThreadPoolExecutor(workers) as pool:
            return tuning.best_time(lambda: list(pool.map(one, range(workers))), repeats=2) / workers

    return timer


def tune_models(models: Sequence[Scorer], precision: str, device: torch.device, workers: int = 1) -> None:
    """Let each model that offers ``tune_eval`` measure its eval choices for this machine and
    precision (once per machine, see `sgraf.kernels.tuning`: SGR's edge route, and the chunk size
    the way the scorer will run blocks, `workers` at once), and use them for the call (inside its
    ``frozen_weights``). Skipped under torchrun: processes that measured apart could choose
    apart, and the matrix must not depend on the number of processes (each takes the stored
    choice or the default)."""
    if distributed.is_distributed():
        return
    for model in models:
        tune = getattr(model, "tune_eval", None)
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

