"""The SCAN "precomp" layout: memory-mapped region features and their captions.

A split `S` of a data directory is two files:

- `S_ims.npy`: region features, shape (n_images, K, D), float32 (the authors': K = 36
  bottom-up-attention regions, D = 2048). Opened memory-mapped: only the rows a batch needs
  are read, so a 33 GB MSCOCO train file costs page cache, not process memory.
- `S_caps.txt`: UTF-8, one caption per line ('\\n' endings). With c = n_captions / n_images
  (which must be a whole number), caption k belongs to image k // c.

A features file may also hold one row per caption, each image repeated c times in a row (the
authors' loader reads such files, "rkiros data has redundancy in images", and their evaluation
keeps every c-th row): when the file has as many rows as there are captions and its first rows
repeat, every c-th row is read (`PrecompSplit.rows_per_image`), after a sample of the other
groups is checked to repeat too.

The authors validate on the first 5,000 `dev` captions only; here that is the explicit
`max_captions=5000` option (the training config's `val_max_captions`), never a silent cut.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from sgraf.data.arrays import as_float32, check_finite_features, open_npy, padded_ids
from sgraf.data.boxes import read_boxes
from sgraf.data.captions import read_captions
from sgraf.data.layout import split_files
from sgraf.data.vocab import Vocabulary, load_vocab
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

STANDARD_SPLITS = ("train", "dev", "test", "testall")
FINITE_SAMPLE = 64  # images `sgraf data check` looks at without --full-scan (evenly spread)
_SCAN_CHUNK_BYTES = 64 << 20  # full scans read this much at a time
_FINGERPRINT_EDGE = 1 << 20  # bytes hashed at each end of a features file


# the most tokens a caption of a data set may have (Flickr30K's and MSCOCO's longest have under 100)
MAX_CAPTION_TOKENS = 1000


def available_splits(data_dir: str | os.PathLike[str]) -> list[str]:
    """Splits of `data_dir` with both files, standard ones first (train, dev, test, testall)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    names = {p.name[: -len("_ims.npy")] for p in data_dir.glob("*_ims.npy")}
    names = {n for n in names if (data_dir / f"{n}_caps.txt").is_file()}
    return [s for s in STANDARD_SPLITS if s in names] + sorted(names - set(STANDARD_SPLITS))


def splits_found(data_dir: str | os.PathLike[str], split: str) -> str:
    """The splits of `data_dir` for a message about a missing `split`: 'train, dev, test', with
    the one `split` was likely meant to name ('Test', 'tset': "did you mean 'test'?"; 'val' or
    'validation': 'dev', the precomp layout's name), or 'none'."""
    found = available_splits(data_dir)
    if not found:
        return "none"
    same_letters = [name for name in found if name.casefold() == split.casefold()]
    meant = "dev" if split.casefold() in ("val", "valid", "validation") and "dev" in found else None
    close = same_letters or ([meant] if meant else difflib.get_close_matches(split, found, n=1, cutoff=0.6))
    return ", ".join(found) + (f"; did you mean {close[0]!r}?" if close else "")


def data_fingerprint(data_dir: str | os.PathLike[str], splits: Sequence[str] = ("train", "dev"),
                     extras: Sequence[str] = ()) -> dict[str, str]:
    """A cheap identity of the splits' files: `{file name: sha256 hex digest}`.

    Caption files are hashed whole (tens of MB at most); a features file by its size and its
    first and last MiB, since hashing a 33 GB MSCOCO file would take minutes. Equal
    fingerprints mean the same captions and, short of an edit inside a features file that
    keeps its size, the same features. `extras` are the suffixes of each split's other files the
    reader uses (`EXTRA_FILES`: the region boxes and picture sizes a position model reads, the
    scenes of `batches=families`), hashed whole where they exist.
    """
    fingerprint = {}
    for split in splits:
        ims_path, caps_path = split_files(data_dir, split)
        fingerprint[caps_path.name] = hashlib.sha256(caps_path.read_bytes()).hexdigest()
        size = ims_path.stat().st_size
        digest = hashlib.sha256(str(size).encode())
        with open(ims_path, "rb") as handle:
            digest.update(handle.read(_FINGERPRINT_EDGE))
            if size > _FINGERPRINT_EDGE:
                handle.seek(max(_FINGERPRINT_EDGE, size - _FINGERPRINT_EDGE))
                digest.update(handle.read())
        fingerprint[ims_path.name] = digest.hexdigest()
        for suffix in extras:
            path = Path(data_dir) / f"{split}{suffix}"
            if path.is_file():
                fingerprint[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return fingerprint


# the suffixes of a split's files beside its features and captions that `data_fingerprint` can hash
BOX_FILES = ("_boxes.npy", "_image_sizes.npy")
SCENE_FILES = ("_scenes.jsonl",)
EXTRA_FILES = BOX_FILES + SCENE_FILES


def comparable_fingerprint(found: dict[str, str], recorded: dict[str, str]) -> dict[str, str]:
    """`found` without the `EXTRA_FILES` that `recorded` lacks: a record written before sgraf
    hashed them (session 39) is compared by the features and captions alone."""
    return {name: digest for name, digest in found.items()
            if name in recorded or not name.endswith(EXTRA_FILES)}


def fingerprint_differences(found: dict[str, str], recorded: dict[str, str]) -> list[str]:
    """The file names whose digests differ between two `data_fingerprint`s (either side missing
    a file counts), sorted: what a refusal to mix data sets names."""
    return sorted(name for name in set(found) | set(recorded) if found.get(name) != recorded.get(name))


REPEAT_SAMPLE = 16     # groups of rows checked to repeat one image, in a file of one row per caption
MAX_ROWS_PER_IMAGE = 20
_said_fortran: set[str] = set()


def _open_features(path: Path) -> np.ndarray:
    """Open `path` memory-mapped and check it is a (n, K, D) floating array."""
    images = open_npy(path, "float32 features of shape (n_images, regions, dim)")
    if images.ndim != 3:
        raise InputError(f"{path}: array has rank {images.ndim} (shape {images.shape}); expected rank 3, "
                         "(n_images, regions, dim)")
    if not np.issubdtype(images.dtype, np.floating):
        raise InputError(f"{path}: dtype {images.dtype}; expected float32 features")
    if images.dtype != np.float32:
        logger.warning("%s: dtype %s, batches are converted to float32", path, images.dtype)
    if 0 in images.shape:
        raise InputError(f"{path}: empty array of shape {images.shape}; expected (n_images, regions, dim) "
                         "with no zero size")
    if images.flags.f_contiguous and not images.flags.c_contiguous and str(path) not in _said_fortran:
        _said_fortran.add(str(path))   # once a file: loader workers open it again
        logger.warning("%s is stored in Fortran (column-major) order: every image read touches the whole file "
                       "(slow, and the page cache fills with it); write it once in C order, e.g. np.save(NEW, "
                       "np.ascontiguousarray(np.load(OLD, mmap_mode='r'))), on a machine with the memory", path)
    return images


def _count_zero_regions(block: np.ndarray, counts: dict[str, int]) -> dict[str, int]:
    """`counts` ({"looked_at", "images", "regions", "empty_images"}) with the all-zero regions of
    `block` (n, K, D) added."""
    zero = ~block.any(axis=2)                                   # (n, K): the regions that are all zero
    counts["looked_at"] += len(block)
    counts["images"] += int(zero.any(axis=1).sum())
    counts["regions"] += int(zero.sum())
    counts["empty_images"] += int(zero.all(axis=1).sum())
    return counts


def _missing(data_dir: Path, split: str, path: Path) -> str:
    """Why the split's file `path` cannot be read, for an `InputError`."""
    if not data_dir.exists():
        return f"{data_dir}: no such data folder"
    if not data_dir.is_dir():
        return f"{data_dir}: a file, where a data folder is needed"
    if path.is_symlink() and not path.exists():
        return f"{path}: a broken symbolic link (to {os.readlink(path)}, which does not exist)"
    if path.is_dir():
        return f"{path}: a folder, where a file is needed"
    ims, caps = split_files(data_dir, split)
    return (f"{path}: missing file; split {split!r} needs {ims.name} and {caps.name} (splits found in "
            f"{data_dir}: {splits_found(data_dir, split)})")


def _rows_per_image(images: np.ndarray, path: Path) -> int:
    """c where `images` (one row per caption) repeats each image c times in a row, else 1."""
    first, repeats = images[0], 1
    while repeats < min(len(images), MAX_ROWS_PER_IMAGE) and np.array_equal(images[repeats], first):
        repeats += 1
    if repeats == 1 or repeats == min(len(images), MAX_ROWS_PER_IMAGE):
        return 1     # no repeat, or no row after the repeats that differs: the same image throughout?
    groups = len(images) // repeats
    sample = np.unique(np.linspace(0, groups - 1, num=min(REPEAT_SAMPLE, groups)).astype(int))
    for group in sample:
        rows = np.asarray(images[group * repeats:(group + 1) * repeats])
        if len(images) % repeats or not (rows == rows[0]).all():
            logger.warning("%s: rows 0..%d are one image repeated, but rows %d..%d are not (or the %d rows are "
                           "not a multiple of %d): read as one image a row, each with one caption", path,
                           repeats - 1, group * repeats, (group + 1) * repeats - 1, len(images), repeats)
            return 1
    logger.info("%s: one row per caption, each image repeated %d times (as the authors' loader reads them): "
                "one row of every %d is read", path, repeats, repeats)
    return repeats


class PrecompSplit:
    """One split of a precomp data directory, validated on opening.

    Args:
        data_dir: the directory holding `{split}_ims.npy` and `{split}_caps.txt`.
        split: the split name (`train`, `dev`, `test`, `testall` or any other).
        max_captions: keep only the first `max_captions` captions and their images (the
            authors validate on `dev` with 5000); must be a multiple of the captions per
            image. None keeps everything.
        full_scan: read every feature now and refuse NaN/inf. Without it nothing is read on
            opening: every reader checks each block it reads (`read_images`, `check_batch`,
            the scorer's batches), so NaN/inf is refused wherever it is, when it is reached.

    Attributes:
        images: (n_images, K, D) memory-mapped array (read-only).
        captions: list of n_captions caption strings, stripped, in file order.

    Raises:
        InputError: a missing file, a wrong array rank or dtype, a caption count that is
            not a multiple of the image count, NaN/inf features (with `full_scan`), bad
            UTF-8, empty lines.
    """

    def __init__(self, data_dir: str | os.PathLike[str], split: str, max_captions: int | None = None,
                 full_scan: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        self.ims_path, self.caps_path = split_files(data_dir, split)
        for path in (self.ims_path, self.caps_path):
            if not path.is_file():
                raise InputError(_missing(self.data_dir, split, path))
        images = _open_features(self.ims_path)
        captions = read_captions(self.caps_path)
        n_img, n_cap = images.shape[0], len(captions)
        if n_cap == 0:
            raise InputError(f"{self.caps_path}: no captions")
        self.rows_per_image = _rows_per_image(images, self.ims_path) if n_img == n_cap > 1 else 1
        n_img //= self.rows_per_image
        if n_cap % n_img:
            raise InputError(f"{self.caps_path}: {n_cap} caption{'s' if n_cap > 1 else ''}, not a multiple of the "
                             f"{n_img} images in {self.ims_path} (caption k belongs to image k // "
                             "captions_per_image)")
        self.caps_per_image = n_cap // n_img
        if max_captions is not None:
            if max_captions <= 0 or max_captions % self.caps_per_image:
                raise InputError(f"max_captions={max_captions} for {self.caps_path}: expected a positive "
                                 f"multiple of its {self.caps_per_image} captions per image")
            if max_captions < n_cap:
                logger.info("%s: using the first %d of %d captions (max_captions)", self.caps_path,
                            max_captions, n_cap)
                captions = captions[:max_captions]
                n_cap, n_img = max_captions, max_captions // self.caps_per_image
        self.max_captions = max_captions
        self.captions: list[str] = captions
        self.n_images = n_img
        self.n_captions = n_cap
        self._images: np.ndarray | None = images
        self._boxes: np.ndarray | None = None
        self._boxes_read = False
        if full_scan:
            self.check_finite(full=True)

    @property
    def images(self) -> np.ndarray:
        """(n_images, K, D) read-only memory map (the first `n_images` rows of the file)."""
        return self._open_images()[: self.n_images]

    @property
    def boxes(self) -> np.ndarray | None:
        """(n_images, K, 4) float32 region boxes normalised to [0, 1] of each picture
        (`sgraf.data.boxes.read_boxes`, read and checked on first use), or None if the split has
        none (or boxes without `{split}_image_sizes.npy`)."""
        if not self._boxes_read:
            self._boxes = self.read_boxes(required=False)
            self._boxes_read = True
        return self._boxes

    def read_boxes(self, required: bool = False) -> np.ndarray | None:
        """`boxes`, or with `required` an InputError in one line when the split has none (what a
        model with positions needs)."""
        if self._boxes_read and (self._boxes is not None or not required):
            return self._boxes
        boxes = read_boxes(self.data_dir, self.split, int(self._open_images().shape[0]), self.num_regions,
                           required=required)
        self._boxes = None if boxes is None else boxes[: self.n_images]
        self._boxes_read = True
        return self._boxes

    def image_names(self) -> list[str] | None:
        """Each image's name, where the split records one: the file name `extract` read
        (`{split}_image_names.txt`) or the image id of a converted TSV (`{split}_image_ids.txt`);
        None where it records none. InputError when the file has another number of lines."""
        for suffix in ("_image_names.txt", "_image_ids.txt"):
            path = self.data_dir / f"{self.split}{suffix}"
            if path.is_file():
                names = [line.split("\t")[0].strip() for line in read_captions(path)]
                if self.rows_per_image > 1 and len(names) == len(self._open_images()) * self.rows_per_image:
                    names = names[::self.rows_per_image]     # a name a row of the features file
                if len(names) < self.n_images:
                    raise InputError(f"{path}: {len(names)} names for the {self.n_images} images of {self.ims_path}; "
                                     "expected one a line")
                return names[: self.n_images]
        return None

    def check_caption_lengths(self, limit: int | None = None) -> None:
        """Refuses a caption of more than `limit` tokens (default `MAX_CAPTION_TOKENS`), naming
        the file, its line and its length: SGR reasons over a graph of a caption's words, whose
        memory grows with the square of its length (one caption of 5,000 words had a training run
        killed by the kernel for want of memory, without a word). Only captions with more
        characters than the limit are tokenised (a token is at least one character)."""
        from sgraf.data.vocab import tokenize

        limit = MAX_CAPTION_TOKENS if limit is None else limit
        for k, caption in enumerate(self.captions):
            if len(caption) > limit:
                n_tokens = len(tokenize(caption))
                if n_tokens > limit:
                    raise InputError(f"{self.caps_path}:{k + 1}: a caption of {n_tokens:,} tokens; sgraf takes at most "
                                     f"{limit:,} (SGR's graph over a caption's words grows with the square of its "
                                     "length): shorten or drop it")

    def _open_images(self) -> np.ndarray:
        """Every image of the file (every `rows_per_image`-th row), memory-mapped; opened again
        after unpickling in a DataLoader worker."""
        if self._images is None:
            self._images = _open_features(self.ims_path)
        return self._images[::self.rows_per_image] if self.rows_per_image > 1 else self._images

    @property
    def num_regions(self) -> int:
        return int(self.images.shape[1])

    @property
    def feature_dim(self) -> int:
        return int(self.images.shape[2])

    def image_index(self, k: int) -> int:
        """The image of caption `k`: k // caps_per_image."""
        return k // self.caps_per_image

    def read_images(self, start: int, stop: int) -> np.ndarray:
        """Images [start, stop) as a float32 (n, K, D) copy, refused if any value is NaN/inf.

        Raises:
            InputError: naming the features file and the image, region and dimension.
        """
        block = as_float32(self.images[start:stop], copy=True)
        check_finite_features(block, self.ims_path, first_image=start, stored=self.images.dtype)
        return block

    def check_finite(self, full: bool = False) -> dict[str, int]:
        """Raise InputError naming the image and region of the first NaN/inf feature, and count
        the all-zero regions (padding of images with fewer regions, or a file cut short and filled
        with zeros) of the images read, in the same pass.

        `full=True` reads everything, in chunks of ~64 MB; by default only `FINITE_SAMPLE`
        images spread evenly over the file (first and last included) are read, the quick look
        of `sgraf data check` (readers check every block they read in any case).

        Returns:
            {"looked_at", "images" (with one all-zero region or more), "regions", "empty_images"
            (every region zero)}.
        """
        images = self.images
        counts = {"looked_at": 0, "images": 0, "regions": 0, "empty_images": 0}
        if full:
            step = max(1, _SCAN_CHUNK_BYTES // max(1, images[0].nbytes))
            for start in range(0, self.n_images, step):
                block = as_float32(images[start:start + step])  # as readers see it
                check_finite_features(block, self.ims_path, first_image=start, stored=images.dtype)
                _count_zero_regions(block, counts)
            return counts
        index = np.unique(np.linspace(0, self.n_images - 1, num=min(FINITE_SAMPLE, self.n_images)).astype(int))
        block = as_float32(images[index])
        try:
            check_finite_features(block, self.ims_path, image_ids=index, stored=images.dtype)
        except InputError as error:
            raise InputError(f"{error} (found by the sampled check)") from None
        return _count_zero_regions(block, counts)

    def summary(self) -> dict[str, Any]:
        """Counts and shapes for `sgraf data check`."""
        return {
            "split": self.split,
            "images": self.n_images,
            "captions": self.n_captions,
            "captions_per_image": self.caps_per_image,
            "rows_per_image": self.rows_per_image,
            "regions": self.num_regions,
            "feature_dim": self.feature_dim,
            "dtype": str(self.images.dtype),
            "features_file": str(self.ims_path),
            "features_bytes": self.ims_path.stat().st_size,
        }

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies its data; workers re-open the file instead.
        state = self.__dict__.copy()
        state["_images"] = None
        return state

    def __repr__(self) -> str:
        return (f"PrecompSplit({str(self.data_dir)!r}, {self.split!r}: {self.n_images} images x "
                f"{self.num_regions} regions x {self.feature_dim}, {self.n_captions} captions)")


@dataclass
class Batch:
    """A batch of (image, caption) pairs, one per caption, in dataset order.

    Attributes:
        images: (B, K, D) float32 region features of each caption's image.
        captions: (B, L) int64 token ids, zero-padded, L = max(lengths).
        lengths: (B,) int64 caption lengths including `<start>` and `<end>`.
        caption_ids: (B,) int64 caption indices in the split's file.
        image_ids: (B,) int64 image indices (equal ids = the same image).
        boxes: (B, K, 4) float32 region boxes normalised to [0, 1] (`sgraf.data.boxes`) when the
            dataset carries them (a model with positions), else None.
        true_of: (B, width) int64 per caption the image ids it is true of, -1 padded, when the
            batch is drawn by families (`sgraf.training.families`), else None.
        finite: True when the process that collated the batch (a DataLoader worker) found every
            feature finite (`CheckedLoader`); None when nobody looked yet.
    """

    images: torch.Tensor
    captions: torch.Tensor
    lengths: torch.Tensor
    caption_ids: torch.Tensor
    image_ids: torch.Tensor
    boxes: torch.Tensor | None = None
    true_of: torch.Tensor | None = None
    finite: bool | None = None

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _apply(self, move: Any) -> Batch:
        return Batch(*(move(t) for t in (self.images, self.captions, self.lengths, self.caption_ids,
                                         self.image_ids)), boxes=None if self.boxes is None else move(self.boxes),
                     true_of=None if self.true_of is None else move(self.true_of), finite=self.finite)

    def to(self, device: torch.device | str) -> Batch:
        return self._apply(lambda t: t.to(device))

    def pin_memory(self) -> Batch:
        return self._apply(lambda t: t.pin_memory())


class PrecompDataset(Dataset):
    """Caption-indexed dataset: item k is (features of image k // c, ids of caption k, k, k // c).

    Captions are encoded on first use and cached (the authors encode in `__getitem__`).

    Args:
        split: an opened `PrecompSplit`.
        vocab: the vocabulary that encodes captions, or its JSON path.
        with_boxes: items (and batches) carry each image's region boxes, normalised (for a model
            with positions); the split must have them (InputError in one line otherwise).
    """

    def __init__(self, split: PrecompSplit, vocab: Vocabulary | str | os.PathLike[str],
                 with_boxes: bool = False) -> None:
        if isinstance(vocab, (str, os.PathLike)):
            vocab = load_vocab(vocab)
        if not hasattr(vocab, "encode"):
            raise InputError(f"vocab: expected a Vocabulary or its JSON path, got {type(vocab).__name__}")
        self.split = split
        self.vocab = vocab
        self._ids: list[list[int] | None] = [None] * split.n_captions
        self.boxes = split.read_boxes(required=True) if with_boxes else None

    def __len__(self) -> int:
        return self.split.n_captions

    def caption_ids(self, k: int) -> list[int]:
        ids = self._ids[k]
        if ids is None:
            ids = self._ids[k] = self.vocab.encode(self.split.captions[k])
        return ids

    def check_batch(self, batch: Batch) -> None:
        """Refuse a batch whose features hold NaN/inf, naming the features file and the image.

        Items are not checked in `__getitem__`: in a DataLoader worker the error would reach
        the user as a worker traceback. `CheckedLoader` calls this on each batch instead, in
        the process that consumes the batches.
        """
        check_finite_features(batch.images, self.split.ims_path, image_ids=batch.image_ids,
                              stored=self.split.images.dtype)

    def __getitem__(self, k: int) -> tuple[Any, ...]:
        """(features (K, D), token ids, k, image id), and the image's boxes (K, 4) `with_boxes`."""
        if not 0 <= k < len(self):
            raise IndexError(f"caption index {k} out of range for {len(self)} captions")
        image_id = self.split.image_index(k)
        features = as_float32(self.split.images[image_id], copy=True)  # (K, D)
        if self.boxes is not None:
            return features, self.caption_ids(k), k, image_id, self.boxes[image_id]
        return features, self.caption_ids(k), k, image_id


def collate_batch(items: Sequence[tuple[Any, ...]]) -> Batch:
    """Stack dataset items into a `Batch`, keeping their order (no sort by length)."""
    features, ids, caption_ids, image_ids = (list(column) for column in zip(*(item[:4] for item in items)))
    boxes = torch.from_numpy(np.stack([item[4] for item in items])) if len(items[0]) > 4 else None
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    return Batch(
        images=torch.from_numpy(np.stack(features)),
        captions=padded_ids(ids),
        lengths=lengths,
        caption_ids=torch.tensor(caption_ids, dtype=torch.int64),
        image_ids=torch.tensor(image_ids, dtype=torch.int64),
        boxes=boxes,
    )


def first_pairs(split: PrecompSplit, vocab: Any, n: int, with_boxes: bool = False) -> Batch:
    """The split's first `n` images (all when fewer) with the first caption of each, as one
    `Batch`: a small sample whose every pair a check scores (`training.loop.place_term_spread`,
    `evaluate.warn_flat_members`)."""
    dataset = PrecompDataset(split, vocab, with_boxes=with_boxes)
    return collate_batch([dataset[image * split.caps_per_image] for image in range(min(n, split.n_images))])


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """A permutation of range(n) that depends only on (seed, epoch).

    Each `iter()` uses the current epoch and then advances it; `set_epoch(e)` jumps to epoch
    e (resuming a run gives the same order as an uninterrupted one). Independent of
    `num_workers`, unlike a shared torch generator that workers also draw seeds from.
    """

    def __init__(self, n: int, seed: int = 0, epoch: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=generator).tolist())


class CheckedLoader(DataLoader):
    """A DataLoader over a `PrecompDataset` that refuses NaN/inf features batch by batch.

    Each batch is checked (`PrecompDataset.check_batch`: one `isfinite().all()`) as it
    arrives, in the process that consumes it, so the error names the features file and the
    image in one line whether or not worker processes read the batch. With worker processes,
    the worker that collates a batch looks first (`Batch.finite`), and the consumer checks only
    a batch found not finite (to name the image): a training step on a GPU is bound by the
    consuming process, whose check of a paper-size batch took 4.3 ms of a 40-60 ms step on a
    2-core AMD EPYC Zen 3 (`benchmarks/bench_train_loader.py`).
    """

    def __init__(self, dataset: Dataset, *args: Any, collate_fn: Any = None, num_workers: int = 0,
                 **kwargs: Any) -> None:
        if num_workers > 0 and collate_fn is not None:
            collate_fn = FiniteCollate(collate_fn)
        super().__init__(dataset, *args, collate_fn=collate_fn, num_workers=num_workers, **kwargs)

    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            if getattr(batch, "finite", None) is not True:
                self.dataset.check_batch(batch)
            yield batch


class FiniteCollate:
    """A `Batch` collate function that also records whether the batch's features are all finite
    (`Batch.finite`), in the DataLoader worker that runs it (`CheckedLoader`). A class, so that
    workers started by spawning can receive it."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: Sequence[tuple[Any, ...]]) -> Any:
        batch = self.collate(items)
        images = getattr(batch, "images", None)
        if isinstance(images, torch.Tensor) and images.device.type == "cpu" and images.dtype == torch.float32:
            batch.finite = bool(np.isfinite(images.numpy()).all())
        return batch


def make_loader(dataset: PrecompDataset, batch_size: int, shuffle: bool = False, seed: int = 0,
                num_workers: int = 0, drop_last: bool = False, epoch: int = 0) -> CheckedLoader:
    """A `CheckedLoader` of `Batch`es; shuffled order depends only on `seed` and the epoch.

    With `shuffle`, the loader's sampler is an `EpochShuffleSampler` (reach it as
    `loader.sampler` to `set_epoch`); the same seed gives the same batches whatever
    `num_workers` is. Without, captions come in file order.
    """
    sampler = EpochShuffleSampler(len(dataset), seed=seed, epoch=epoch) if shuffle else None
    return CheckedLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_batch, drop_last=drop_last, persistent_workers=num_workers > 0)
