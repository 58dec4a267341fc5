"""Gallery search: an on-disk index of encoded images and captions, two-stage retrieval.

An index is a folder:

    manifest.json                 format, the models' identities (config + weights sha256 +
                                  checkpoint path), the data it came from, each file's shape,
                                  dtype and sha256
    captions.txt                  the gallery's captions, one per line (split order)
    image_keys.npy                (n_img, G) float32 first-stage keys (global vectors)
    caption_keys.npy              (n_cap, G) float32
    caption_lengths.npy           (n_cap,) int64, `<start>` and `<end>` included
    image_regions.{m}.npy         (n_img, K, d_m) region embeddings of model m
    image_boxes.npy               (n_img, K, 4) float32 region boxes normalised to [0, 1], only
                                  when a model reads positions (`Matcher.needs_boxes`): its
                                  regions were encoded with them, explanations need them again
    caption_words.{m}.npy         (n_cap, L_max, d_m) word embeddings of model m, zero-padded

The big arrays are opened memory-mapped, so a query reads only the rows of its shortlist.

Search is two-stage: the first stage ranks the whole gallery by the inner product of the
models' self-attention global vectors (the mean cosine over the ensemble; FAISS does this when
installed and asked for) and keeps a shortlist of N candidates; the full SGRAF scorer (all
local and global alignments, graph reasoning / attention filtration, ensemble mean) re-ranks
the shortlist. With N >= the gallery size the result is the exhaustive ranking.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sgraf.api import Matcher, describe_identity, shortlist_keys, split_shortlist_keys
from sgraf.atomic_write import (missing_folders, preallocated_memmap, taken_back_on_failure, temporary_folder,
                                write_error)
from sgraf.data.arrays import as_float32, check_finite_features, mapped_file, open_npy, padded_ids
from sgraf.data.vocab import warn_unknown_share
from sgraf.errors import InputError, check_positive_int
from sgraf.io_paths import path_list
from sgraf.progress import bar as progress_bar
from sgraf.scoring import tokenize_captions
from sgraf.signals import signals_deferred

logger = logging.getLogger(__name__)

FORMAT = "sgraf-index"
VERSION = 1
MANIFEST = "manifest.json"
CAPTIONS = "captions.txt"
IMAGE_NAMES = "image_names.txt"   # the pictures' names (files of `extract`, ids of `convert-tsv`), when known
BOXES = "image_boxes.npy"
STORAGE_DTYPES = ("float32", "float16")
FIRST_STAGES = ("auto", "numpy", "faiss")
KEY_QUERIES = 16     # queries per first-stage matrix product (always this many columns: see _coarse_many)

__all__ = ["Hit", "GalleryIndex", "build_index", "open_index", "shortlist_for"]


def shortlist_for(shortlist: int, top_k: int) -> int | None:
    """What `--shortlist N` means for a query of `top_k` results, in `sgraf search` and
    `sgraf serve` alike: 0 scores the whole gallery (None), else max(N, top_k) candidates."""
    return None if shortlist == 0 else max(shortlist, top_k)


@dataclass(frozen=True)
class Hit:
    """One search result.

    Attributes:
        id: image index or caption index in the split's order.
        score: the full SGRAF score (ensemble mean).
        coarse: the first-stage score (mean cosine of the global vectors).
        text: the caption (caption results) or the image's first caption (image results).
        name: the picture's name (image results of an index that records names: the file name
            `extract` read, the image id of a converted TSV), else None.
    """

    id: int
    score: float
    coarse: float
    text: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "score": self.score, **({"name": self.name} if self.name is not None else {})}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read whole by chunks (an index's files, `sgraf serve`'s data)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _vocab_sha256(vocab: Any) -> str | None:
    if vocab is None:
        return None
    return hashlib.sha256(json.dumps(vocab.word2idx, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------- building
def build_index(matcher: Matcher, features: Any, captions: Sequence[str], out: str | Path, *,
                caps_per_image: int | None = None, source: dict[str, Any] | None = None,
                dtype: str = "float32", batch_size: int = 256, progress: bool = False,
                boxes: Any = None, image_names: Sequence[str] | None = None) -> Path:
    """Encode a gallery and write it as an index folder.

    Args:
        matcher: the model(s) and vocabulary; the index records their identities.
        features: (n_img, K, img_dim) region features (a memory-mapped array is read in chunks).
        captions: the gallery's captions, split order (words unknown to the vocabulary map to
            `<unk>`, as in evaluation).
        out: the index folder; replaced if it already holds an index, refused if it holds
            anything else.
        caps_per_image: captions per image (caption k describes image k // caps_per_image);
            default n_captions / n_images when that divides, else None.
        source: where the gallery came from (data dir, split), stored in the manifest with the
            split's `data_fingerprint` (so that a server refuses other data given for it).
        dtype: storage of the embeddings, 'float32' (exact) or 'float16' (half the disk).
        batch_size: images / captions encoded per chunk.
        progress: progress bars (images, then captions) on stderr.
        boxes: (n_img, K, 4) region boxes normalised to [0, 1] (`PrecompSplit.boxes`), required
            when a model of the matcher reads positions (then stored as `image_boxes.npy`),
            ignored otherwise.
        image_names: each picture's name (`PrecompSplit.image_names()`), stored as
            `image_names.txt` and given with each image result (`Hit.name`).

    Returns:
        The index folder.
    """
    if not isinstance(matcher, Matcher):
        raise InputError(f"build_index takes a Matcher (Matcher.load(checkpoints) or Matcher(models)), got "
                         f"{type(matcher).__name__}")
    if dtype not in STORAGE_DTYPES:
        raise InputError(f"index dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    batch_size = check_positive_int(batch_size, "batch_size")
    if isinstance(features, (list, tuple)):
        features = np.asarray(features, dtype=np.float32)
    out = Path(out)
    if out.is_symlink():   # a link to an index folder is written through: the link stays
        out = Path(os.path.realpath(out))
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).exists())):
        raise InputError(f"{out} exists and is not an sgraf index; choose another --out")
    _check_only_index_files(out)
    if not hasattr(features, "shape"):
        raise InputError(f"features: expected an (n_img, K, img_dim) array or tensor, got {type(features).__name__}")
    if len(features.shape) != 3:        # one image's (K, img_dim) had made a gallery of K images, K - 1 of them zeros
        raise InputError(f"features: expected an (n_img, K, img_dim) array or tensor, got shape "
                         f"{tuple(features.shape)}" + (" (one image's features: features[None] is a gallery of one)"
                                                        if len(features.shape) == 2 else ""))
    if isinstance(captions, str) or not all(isinstance(caption, str) for caption in captions):
        raise InputError("captions: expected a list of str, one per caption")
    n_img, n_cap = int(features.shape[0]), len(captions)
    if n_img == 0 or n_cap == 0:
        raise InputError(f"an index needs images and captions, got {n_img} images and {n_cap} captions")
    if caps_per_image is None and n_cap % n_img == 0:
        caps_per_image = n_cap // n_img
    elif caps_per_image is None:
        logger.warning("%d captions for %d images, not a whole number per image: the index records no image of each "
                       "caption (give caps_per_image, or one caption file per image set, for image -> caption "
                       "truth and the caption shown beside each image found)", n_cap, n_img)
    for row, caption in enumerate(captions):
        if "\n" in caption or not caption.strip():
            raise InputError(f"caption {row} is empty or spans several lines: {caption!r}")
    boxes = matcher.check_boxes(boxes, n_img, what="the gallery's boxes")   # before any work
    if image_names is not None:
        image_names = list(image_names)
        if len(image_names) != n_img or not all(isinstance(name, str) and name.strip() and "\n" not in name
                                                for name in image_names):
            raise InputError(f"image_names: expected {n_img} names, one a line, got {len(image_names)}")

    source = dict(source or {})
    if {"data_dir", "split"} <= set(source) and "data_fingerprint" not in source:
        source["data_fingerprint"] = _split_fingerprint(source["data_dir"], source["split"])
    if {"data_dir", "split"} <= set(source) and "pictures" not in source:
        from sgraf.data.layout import pictures_fingerprint

        pictures = pictures_fingerprint(source["data_dir"], source["split"], n_img)
        if pictures is not None:
            source["pictures"] = pictures    # a server refuses other pictures given for the gallery
    created = missing_folders(out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_error(out, error) from None
    with taken_back_on_failure(created), _index_lock(out):
        try:
            staging = temporary_folder(out.parent, f".{out.name}{STAGING_INFIX}")
        except OSError as error:
            raise write_error(out, error) from None
        try:
            captions_label = (f"the {source['split']} captions of {source['data_dir']}"
                              if source and {"split", "data_dir"} <= set(source) else "the gallery captions")
            _write_index(matcher, features, list(captions), staging, dtype, batch_size, captions_label, progress,
                         boxes)
            if image_names is not None:
                (staging / IMAGE_NAMES).write_bytes("".join(name.strip() + "\n" for name in image_names)
                                                    .encode("utf-8"))   # "\n" on Windows too
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "models": matcher.identities,
                "vocab_sha256": _vocab_sha256(matcher.vocab),
                "n_images": n_img,
                "n_captions": n_cap,
                "caps_per_image": caps_per_image,
                "dtype": dtype,
                "source": source,
                "files": {path.name: _describe_file(path) for path in sorted(staging.iterdir())},
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            _swap_in(staging, out)
        except OSError as error:   # name the index the user asked for, not the staging folder
            shutil.rmtree(staging, ignore_errors=True)
            raise write_error(out, error) from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # sgraf index prints it
        logger.debug("indexed %d images and %d captions with %d model(s) into %s", n_img, n_cap, len(matcher.models),
                     out)
        return out


# the folders a build makes beside the index NAME, each name ending in 8 random characters:
STAGING_INFIX = ".sgraf-staging-"   # `.NAME.sgraf-staging-` + 8: the index being built
ASIDE_INFIX = ".sgraf-earlier-"     # `.NAME.sgraf-earlier-` + 8, holding NAME: the earlier index during the swap


@contextlib.contextmanager
def _index_lock(out: Path) -> Iterator[None]:
    """The lock of the index at `out`, a file beside it (the folder is replaced whole): a second
    build into `out` is refused while one runs (both had said they wrote it; the last won). Held,
    it puts back an index a kill left aside mid-swap and removes the folders killed builds left."""
    from sgraf.folder_lock import LOCK_FILE, FolderLock

    with FolderLock(out, purpose="index build", path=out.parent / f".{out.name}{LOCK_FILE}"):
        staging, aside = _leftovers(out)
        if aside and not out.exists():     # the newest, if several
            latest = max(aside, key=lambda folder: folder.stat().st_mtime)
            os.replace(latest / out.name, out)
            logger.warning("%s: put back the index a stopped build had moved aside (%s)", out, latest)
        for leftover in staging + aside:
            shutil.rmtree(leftover, ignore_errors=True)
        yield


def _leftovers(out: Path) -> tuple[list[Path], list[Path]]:
    """The folders beside `out` that builds into `out` left: staging folders (`STAGING_INFIX`) and
    earlier indexes moved aside (`ASIDE_INFIX`, holding `out`'s name). Named exactly: another
    index's (`out.v2`'s) or a user's `.NAME.backup` never match."""
    name = re.escape(out.name)
    staging = re.compile(rf"\.{name}{re.escape(STAGING_INFIX)}[0-9a-f]{{8}}")
    aside = re.compile(rf"\.{name}{re.escape(ASIDE_INFIX)}[a-z0-9_]{{8}}")
    folders = [path for path in out.parent.iterdir() if path.is_dir() and not path.is_symlink()]
    return ([path for path in folders if staging.fullmatch(path.name)],
            [path for path in folders if aside.fullmatch(path.name) and (path / out.name).is_dir()])


def _split_fingerprint(data_dir: str | os.PathLike[str], split: str) -> dict[str, str] | None:
    """`precomp.data_fingerprint` of the split an index is built from (None if its files are not
    there, e.g. features given as an array): a server compares it with the data it is given."""
    from sgraf.data.precomp import BOX_FILES, data_fingerprint

    try:      # with the region boxes and picture sizes, which a server's explanations draw
        return data_fingerprint(data_dir, splits=(split,), extras=BOX_FILES)
    except (OSError, InputError):
        return None


def _check_only_index_files(out: Path) -> None:
    """An earlier index is replaced whole: refuse when it holds a file its manifest does not list."""
    if not (out / MANIFEST).is_file():
        return
    try:
        listed = set(json.loads((out / MANIFEST).read_text(encoding="utf-8"))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    extra = sorted(p.name for p in out.iterdir() if p.name != MANIFEST and p.name not in listed)
    if extra:
        raise InputError(f"{out / extra[0]} is not part of the sgraf index in {out} (its manifest does not list it) "
                         "and would be deleted with it; move it away or choose another --out")


def _swap_in(staging: Path, out: Path) -> None:
    """Puts the finished index `staging` at `out`: the earlier index is moved aside first, so
    `out` holds one whole index or the other, and removed once the new one is in place."""
    aside = None
    try:
        with signals_deferred():
            if out.exists():
                aside = Path(tempfile.mkdtemp(prefix=f".{out.name}{ASIDE_INFIX}", dir=out.parent))
                os.replace(out, aside / out.name)
            try:
                os.replace(staging, out)
            except BaseException:
                if aside is not None and not out.exists():
                    os.replace(aside / out.name, out)   # the earlier index back in its place
                raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _describe_file(path: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r")
        entry.update(shape=list(array.shape), dtype=str(array.dtype))
    return entry


def _write_index(matcher: Matcher, features: Any, captions: list[str], folder: Path, dtype: str,
                 batch_size: int, captions_label: str, progress: bool = False,
                 boxes: torch.Tensor | None = None) -> None:
    n_img, n_cap, n_models = int(features.shape[0]), len(captions), len(matcher.models)
    source, first_row = mapped_file(features)   # a memory map: its file and rows
    # images, in chunks written straight into memory-mapped files
    regions_out: list[np.memmap] = []
    keys_out = None
    with progress_bar(n_img, "encoding images", "img", progress, unit_scale=True) as bar:
        for start in range(0, n_img, batch_size):
            chunk = as_float32(features[start:start + batch_size])
            check_finite_features(chunk, source or "image features", first_image=first_row + start)
            encoding = matcher.encode_images(chunk, None if boxes is None else boxes[start:start + batch_size])
            if keys_out is None:
                key_width = shortlist_keys(encoding.global_vectors).shape[1]
                keys_out = _open_out(folder / "image_keys.npy", (n_img, key_width), "float32")
                regions_out = [_open_out(folder / f"image_regions.{m}.npy", (n_img, *encoding.regions[m].shape[1:]),
                                         dtype) for m in range(n_models)]
            stop = start + len(encoding)
            keys_out[start:stop] = shortlist_keys(encoding.global_vectors)
            for m in range(n_models):
                regions_out[m][start:stop] = encoding.regions[m].numpy().astype(dtype)
            bar.update(stop - start)
    if boxes is not None:
        np.save(folder / BOXES, boxes.numpy().astype(np.float32))
    # captions: tokenise all first, for the padded width
    ids = tokenize_captions(captions, matcher.vocab)       # kept on disk for the next index of them
    warn_unknown_share(matcher.vocab, ids, captions_label)
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    width = int(lengths.max())
    np.save(folder / "caption_lengths.npy", lengths)
    words_out = [_open_out(folder / f"caption_words.{m}.npy",
                           (n_cap, width, matcher.models[m].config.embed_size), dtype)
                 for m in range(n_models)]
    cap_keys_out = None
    with progress_bar(n_cap, "encoding captions", "cap", progress, unit_scale=True) as bar:
        for start in range(0, n_cap, batch_size):
            chunk = ids[start:start + batch_size]
            encoding = matcher.encode_token_ids(padded_ids(chunk), torch.from_numpy(lengths[start:start + len(chunk)]))
            keys = shortlist_keys(encoding.global_vectors)
            if cap_keys_out is None:
                cap_keys_out = _open_out(folder / "caption_keys.npy", (n_cap, keys.shape[1]), "float32")
            cap_keys_out[start:start + len(chunk)] = keys
            for m in range(n_models):
                block = encoding.words[m].numpy()
                words_out[m][start:start + len(chunk), :block.shape[1]] = block.astype(dtype)
            bar.update(len(chunk))
    for array in [*regions_out, *words_out, keys_out, cap_keys_out]:
        array.flush()
    del regions_out, words_out, keys_out, cap_keys_out
    # bytes: a text-mode write ends lines "\r\n" on Windows, and a reader splitting on "\n" kept the "\r"
    (folder / CAPTIONS).write_bytes("".join(caption.strip() + "\n" for caption in captions).encode("utf-8"))


def _open_out(path: Path, shape: tuple[int, ...], dtype: str) -> np.memmap:
    return preallocated_memmap(path, dtype, shape)   # ENOSPC here, not SIGBUS while writing


# --------------------------------------------------------------------------------- opening
def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if folder.is_file():
        raise InputError(f"{folder} is a file: give the index folder" + (
            f" ({folder.parent})" if folder.name == MANIFEST else ""))
    if not folder.is_dir():
        aside = _leftovers(folder)[1] if folder.parent.is_dir() else []
        if aside:         # a build killed between its two moves (SIGKILL: the others wait for both)
            latest = max(aside, key=lambda earlier: earlier.stat().st_mtime) / folder.name
            raise InputError(f"{folder}: no index there, but a stopped `sgraf index` left the earlier one aside in "
                             f"{latest}: move it back (mv {shlex.quote(str(latest))} {shlex.quote(str(folder))}) or "
                             "build the index again")
        raise FileNotFoundError(2, "no such index folder", str(folder))
    if not path.is_file():
        raise InputError(f"{folder} is not an sgraf index: {MANIFEST} is missing (build one with `sgraf index`)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: corrupted index manifest, not valid JSON ({exc}); rebuild the index "
                         "with `sgraf index`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"{path}: not an sgraf index manifest (expected \"format\": \"{FORMAT}\")")
    if manifest.get("version") != VERSION:
        raise InputError(f"{path}: index version {manifest.get('version')!r} is not supported "
                         f"(this sgraf reads version {VERSION}); rebuild the index")
    for key in ("models", "n_images", "n_captions", "files", "dtype"):
        if key not in manifest:
            raise InputError(f"{path}: corrupted index manifest, field {key!r} is missing")
    models, files, per_image = manifest["models"], manifest["files"], manifest.get("caps_per_image")
    checks = (
        ("models", "a list of model identities",
         isinstance(models, list) and bool(models) and all(isinstance(m, dict) for m in models)),
        ("n_images", "a positive integer", _is_count(manifest["n_images"])),
        ("n_captions", "a positive integer", _is_count(manifest["n_captions"])),
        ("files", "an object of file entries",
         isinstance(files, dict) and all(isinstance(entry, dict) for entry in files.values())),
        ("caps_per_image", "a positive integer or null", per_image is None or _is_count(per_image)),
    )
    for key, wanted, valid in checks:
        if not valid:
            found = repr(manifest.get(key))
            found = found if len(found) <= 60 else found[:57] + "..."
            raise InputError(f"{path}: corrupted index manifest, field {key!r} is {found}, expected {wanted}; "
                             "rebuild the index")
    if per_image and (manifest["n_images"] - 1) * per_image >= manifest["n_captions"]:
        raise InputError(f"{path}: corrupted index manifest, {manifest['n_images']} images with {per_image} "
                         f"captions each do not fit {manifest['n_captions']} captions; rebuild the index")
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _file_entry(folder: Path, name: str, manifest: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """The manifest's record of index file `name`, with the fields that are read."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise InputError(f"{folder / MANIFEST}: corrupted index manifest, no entry for {name}")
    missing = [field for field in fields if field not in entry]
    if missing:
        raise InputError(f"{folder / MANIFEST}: corrupted index manifest, the entry for {name} lacks "
                         f"{', '.join(missing)}; rebuild the index")
    return entry


def _open_array(folder: Path, name: str, manifest: dict[str, Any], verify: bool) -> np.ndarray:
    path = folder / name
    entry = _file_entry(folder, name, manifest, ("bytes", "sha256", "shape", "dtype"))
    if not path.is_file():
        raise InputError(f"{path}: index file is missing; rebuild the index with `sgraf index`")
    if path.stat().st_size != entry["bytes"]:
        raise InputError(f"{path}: corrupted index file, {path.stat().st_size} bytes where the manifest "
                         f"records {entry['bytes']} (truncated or overwritten); rebuild the index")
    if verify and sha256_file(path) != entry["sha256"]:
        raise InputError(f"{path}: corrupted index file, its sha256 does not match the manifest; "
                         "rebuild the index")
    array = open_npy(path, f"the {entry['dtype']}{entry['shape']} array the manifest records; rebuild the index",
                     what="corrupted index file, ")
    if list(array.shape) != entry["shape"] or str(array.dtype) != entry["dtype"]:
        raise InputError(f"{path}: corrupted index file, array {array.dtype}{list(array.shape)} where the "
                         f"manifest records {entry['dtype']}{entry['shape']}; rebuild the index")
    return array


def _read_captions(folder: Path, manifest: dict[str, Any], verify: bool, name: str = CAPTIONS) -> list[str]:
    """The gallery's captions from captions.txt (or the lines of another text file of the index,
    `name`), checked against the manifest like the arrays."""
    path = folder / name
    entry = _file_entry(folder, name, manifest, ("bytes", "sha256"))
    if not path.is_file():
        raise InputError(f"{path}: index file is missing; rebuild the index with `sgraf index`")
    data = path.read_bytes()
    if len(data) != entry["bytes"]:
        raise InputError(f"{path}: corrupted index file, {len(data)} bytes where the manifest records "
                         f"{entry['bytes']} (truncated or overwritten); rebuild the index")
    if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise InputError(f"{path}: corrupted index file, its sha256 does not match the manifest; rebuild the index")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{path}:{line}: corrupted index file, bytes that are not valid UTF-8 "
                         f"(byte 0x{data[exc.start]:02x}); rebuild the index") from None
    return [line.removesuffix("\r") for line in text.split("\n")[:-1]]   # an index written on Windows before


def check_identity(manifest: dict[str, Any], matcher: Matcher, where: Path | str) -> None:
    """Refuse a matcher whose models are not the ones the index was built with, naming both."""
    built = manifest["models"]
    current = matcher.identities
    if len(built) != len(current):
        raise InputError(
            f"index {where} was built with {len(built)} model(s) "
            f"[{'; '.join(describe_identity(i) for i in built)}] but {len(current)} "
            f"{'was' if len(current) == 1 else 'were'} given "
            f"[{'; '.join(describe_identity(i) for i in current)}]")
    for position, (old, new) in enumerate(zip(built, current)):
        if old.get("weights_sha256") != new["weights_sha256"] or old.get("config") != new["config"]:
            raise InputError(
                f"index {where} was built with model {position + 1} = {describe_identity(old)}, but the "
                f"model given is {describe_identity(new)}; rebuild the index with this model or "
                "search with the model it was built with")
    if manifest.get("vocab_sha256") not in (None, _vocab_sha256(matcher.vocab)):
        raise InputError(f"index {where} was built with another vocabulary than the models' "
                         f"({getattr(matcher.vocab, 'source', None) or 'the one stored in the checkpoints'}): "
                         "search with --vocab naming the one it was built with")


def open_index(path: str | Path, matcher: Matcher | None = None,
               checkpoints: str | Path | Sequence[str | Path] | None = None, vocab: Any | None = None,
               verify: bool = True, first_stage: str = "auto",
               device: str | torch.device = "cpu", in_memory: bool = False) -> "GalleryIndex":
    """Open an index folder for search.

    Args:
        path: the index folder.
        matcher: the model(s) to search with; default: load `checkpoints`, or else the checkpoint
            paths recorded in the manifest. Either way they must be the models the index was
            built with (same config and weights hash), otherwise `InputError` names both.
        checkpoints: checkpoint paths to load instead of the recorded ones.
        vocab: vocabulary (object or JSON path) for checkpoints that carry none.
        verify: check every file's sha256 against the manifest (reads the whole index once).
        first_stage: 'numpy' (exact inner products), 'faiss' (FAISS flat inner-product index,
            needs the `faiss` extra) or 'auto' (FAISS when installed).
        device: where the loaded models encode and score (not used with `matcher`).
        in_memory: read the arrays into memory instead of mapping them (a server: files copied
            over the index while it runs then change nothing it answers, and cannot crash it
            with SIGBUS as a mapped file cut short does).
    """
    folder = Path(path)
    manifest = _read_manifest(folder)
    if matcher is None:
        paths = (path_list("checkpoints", checkpoints) if checkpoints is not None
                 else [m.get("source") for m in manifest["models"]])
        if not paths or any(p is None for p in paths):
            raise InputError(f"index {folder} does not record its checkpoint paths (built from models in memory); "
                             "give them: --checkpoint on the command line, checkpoints= or matcher= in Python")
        missing = [str(p) for p in paths if not Path(p).is_file()]
        if missing:
            raise InputError(f"index {folder} was built with checkpoint(s) {', '.join(missing)}, which no "
                             "longer exist; give the same model(s): --checkpoint on the command line, checkpoints= "
                             "in Python")
        matcher = Matcher.load(paths, vocab=vocab, device=device)
    check_identity(manifest, matcher, folder)
    return GalleryIndex(folder, manifest, matcher, verify=verify, first_stage=first_stage, in_memory=in_memory)


def file_states(folder: Path, names: Sequence[str]) -> dict[str, tuple[int, ...] | None]:
    """{name: (device, inode, size, modification time in ns)} of files in `folder` (None: not
    there): a few stat calls that tell a file replaced (another inode), rewritten in place (size,
    time) or removed, without reading it."""
    states: dict[str, tuple[int, ...] | None] = {}
    for name in names:
        try:
            stat = (folder / name).stat()
            states[name] = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            states[name] = None
    return states


def changed_since(folder: Path, states: dict[str, tuple[int, ...] | None]) -> list[str]:
    """The names whose `file_states` in `folder` are no longer `states` (taken earlier)."""
    now = file_states(folder, list(states))
    return [name for name, state in states.items() if now[name] != state]


def _first_stage(asked: str) -> str:
    """The first stage an index runs: 'faiss' when asked, or with 'auto' where FAISS imports;
    'numpy' otherwise."""
    if asked in ("auto", "faiss"):
        try:
            # FAISS logs its CPU-feature probing at INFO; keep that out of our output
            logging.getLogger("faiss.loader").setLevel(logging.WARNING)
            import faiss  # noqa: F401  (optional extra)
            return "faiss"
        except ImportError:
            if asked == "faiss":
                raise InputError("first_stage='faiss' needs FAISS: pip install 'sgraf[faiss]'") from None
    return "numpy"


class GalleryIndex:
    """An opened index: first-stage keys in memory, embeddings memory-mapped.

    Use `open_index` to create one; `search_text` and `search_image` query it.
    """

    def __init__(self, folder: Path, manifest: dict[str, Any], matcher: Matcher, verify: bool = True,
                 first_stage: str = "auto", in_memory: bool = False) -> None:
        if first_stage not in FIRST_STAGES:
            raise InputError(f"first_stage must be one of {', '.join(FIRST_STAGES)}, got {first_stage!r}")
        self.folder = folder
        self.manifest = manifest
        self.matcher = matcher
        n_models = len(manifest["models"])
        self.n_images = int(manifest["n_images"])
        self.n_captions = int(manifest["n_captions"])
        self.caps_per_image = manifest.get("caps_per_image")
        self.files = file_states(folder, [MANIFEST, *manifest["files"]])   # what `changed_files` compares

        def load(name: str) -> np.ndarray:
            array = _open_array(folder, name, manifest, verify)
            return np.array(array) if in_memory else array

        self.image_keys = np.ascontiguousarray(load("image_keys.npy"))      # (n_img, G)
        self.caption_keys = np.ascontiguousarray(load("caption_keys.npy"))  # (n_cap, G)
        self.caption_lengths = np.asarray(load("caption_lengths.npy"))      # (n_cap,)
        self.image_regions = [load(f"image_regions.{m}.npy") for m in range(n_models)]
        self.image_boxes = load(BOXES) if BOXES in manifest["files"] else None   # (n_img, K, 4) or None
        if self.image_boxes is None and matcher.needs_boxes:
            raise InputError(f"index {folder} holds no {BOXES}, but {matcher.boxes_needed_by()}; "
                             "rebuild the index with `sgraf index` from data with boxes")
        self.caption_words = [load(f"caption_words.{m}.npy") for m in range(n_models)]
        self.captions = _read_captions(folder, manifest, verify)
        if len(self.captions) != self.n_captions:
            raise InputError(f"{folder / CAPTIONS}: corrupted index file, {len(self.captions)} captions where the "
                             f"manifest records {self.n_captions}")
        self.image_names = (_read_captions(folder, manifest, verify, IMAGE_NAMES) if IMAGE_NAMES in manifest["files"]
                            else None)
        if self.image_names is not None and len(self.image_names) != self.n_images:
            raise InputError(f"{folder / IMAGE_NAMES}: corrupted index file, {len(self.image_names)} names where the "
                             f"manifest records {self.n_images} images")
        self._check_arrays(n_models)
        self._checked = matcher.identities          # `open_index` checked these (`_check_models`)
        self._faiss = {"image": None, "caption": None}
        self.first_stage = _first_stage(first_stage)

    def _check_models(self) -> None:
        """`check_identity` again when the matcher's weights have changed since the index was
        opened (a model still training, a `load_state_dict`): the stored embeddings are the old
        weights'. Cheap when nothing changed: `Matcher.identities` is the same list then."""
        identities = self.matcher.identities
        if identities is not self._checked:
            check_identity(self.manifest, self.matcher, self.folder)
            self._checked = identities

    def name_of(self, image_id: int) -> str | None:
        """Image `image_id`'s name, when the index records names."""
        return self.image_names[image_id] if self.image_names is not None else None

    def __repr__(self) -> str:
        return (f"GalleryIndex({self.folder}: {self.n_images} images, {self.n_captions} captions, "
                f"{len(self.matcher.models)} model(s))")

    def changed_files(self) -> list[str]:
        """The index's files (names in its folder) that are no longer the ones opened: replaced,
        rewritten or gone (`file_states`); empty while the folder holds what was opened."""
        return changed_since(self.folder, self.files)

    def _check_arrays(self, n_models: int) -> None:
        """What --no-verify leaves unchecked must still not crash a query: the arrays' shapes, the
        caption lengths, the boxes and the keys; `InputError` naming the file otherwise."""
        arrays = {"image_keys.npy": (self.image_keys, 2, self.n_images),
                  "caption_keys.npy": (self.caption_keys, 2, self.n_captions),
                  "caption_lengths.npy": (self.caption_lengths, 1, self.n_captions)}
        for m in range(n_models):
            arrays[f"image_regions.{m}.npy"] = (self.image_regions[m], 3, self.n_images)
            arrays[f"caption_words.{m}.npy"] = (self.caption_words[m], 3, self.n_captions)
        if self.image_boxes is not None:
            arrays[BOXES] = (self.image_boxes, 3, self.n_images)
        for name, (array, rank, rows) in arrays.items():
            if array.ndim != rank or array.shape[0] != rows:
                raise InputError(f"{self.folder / name}: corrupted index file, shape {array.shape} where {rows} rows "
                                 f"of rank {rank} are expected; rebuild the index")
        width = min(words.shape[1] for words in self.caption_words)
        lengths = self.caption_lengths
        if lengths.dtype.kind not in "iu" or int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise InputError(f"{self.folder / 'caption_lengths.npy'}: corrupted index file, lengths {lengths.min()}.."
                             f"{lengths.max()} where 1..{width} (the width of the word embeddings) are expected; "
                             "rebuild the index")
        if self.image_boxes is not None:
            if self.image_boxes.shape[1:] != self.image_regions[0].shape[1:2] + (4,) \
                    or self.image_boxes.dtype.kind != "f":
                raise InputError(f"{self.folder / BOXES}: corrupted index file, {self.image_boxes.dtype} boxes of "
                                 f"shape {self.image_boxes.shape} where float boxes ({self.n_images}, "
                                 f"{self.image_regions[0].shape[1]}, 4) are expected; rebuild the index")
            from sgraf.model.positions import check_normalised_boxes

            try:      # every box once here (a few MB): a bad one named by its image, not at a request
                check_normalised_boxes(torch.from_numpy(np.array(self.image_boxes, dtype=np.float32)))
            except InputError as error:
                raise InputError(f"{self.folder / BOXES}: corrupted index file, {str(error).split(': ', 1)[1]}; "
                                 "rebuild the index") from None
        for name in ("image_keys.npy", "caption_keys.npy"):
            keys = arrays[name][0]
            if keys.dtype.kind != "f" or not np.isfinite(keys).all():
                raise InputError(f"{self.folder / name}: corrupted index file, {keys.dtype} keys with NaN or infinite "
                                 "values where finite floats are expected; rebuild the index")

    # ----------------------------------------------------------------------------- stages
    def _coarse(self, gallery: str, query_key: np.ndarray, shortlist: int) -> tuple[np.ndarray, np.ndarray]:
        """First stage: the `shortlist` best gallery items by global-vector inner product.

        Returns:
            (ids, coarse scores), ids sorted ascending (so the memory maps are read in order).
        """
        return self._coarse_many(gallery, query_key[None, :], shortlist)[0]

    def _coarse_many(self, gallery: str, query_keys: np.ndarray,
                     shortlist: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The first stage of several queries (n_q, G) at once: the gallery's keys are read from
        memory once per `KEY_QUERIES` queries.

        The queries go through the inner products in groups of exactly `KEY_QUERIES` rows (zero
        rows fill the last group): a matrix product of one shape, whose columns do not depend on
        one another, so a query's coarse scores and shortlist are the same bits alone or with
        others (a product of another width would take another kernel and round differently).

        Returns:
            per query, (ids, coarse scores) as `_coarse`.
        """
        keys = self.image_keys if gallery == "image" else self.caption_keys
        n = keys.shape[0]
        query_keys = np.ascontiguousarray(query_keys, dtype=np.float32)
        n_q = query_keys.shape[0]
        use_faiss = shortlist < n and self.first_stage == "faiss"
        if use_faiss and self._faiss[gallery] is None:
            import faiss

            index = faiss.IndexFlatIP(keys.shape[1])
            index.add(keys)
            self._faiss[gallery] = index
        found = []
        for start in range(0, n_q, KEY_QUERIES):
            group = np.zeros((KEY_QUERIES, query_keys.shape[1]), dtype=np.float32)
            group[:min(KEY_QUERIES, n_q - start)] = query_keys[start:start + KEY_QUERIES]
            rows = range(min(KEY_QUERIES, n_q - start))
            if use_faiss:
                # the real rows only: FAISS scans a few query rows one by one (below its BLAS
                # threshold), each alone, so a query's bits do not depend on the others; the zero
                # rows had cost a scan each (a search of one text 20 ms instead of 1 ms on 100,000
                # keys of 128; a served search with FAISS 3x slower than with NumPy)
                coarse, ids = self._faiss[gallery].search(group[:len(rows)], shortlist)   # (rows, shortlist)
                found += [(ids[q].astype(np.int64), coarse[q]) for q in rows]
                continue
            scores = keys @ group.T                                             # (n, KEY_QUERIES)
            for q in rows:
                if shortlist >= n:
                    found.append((np.arange(n), np.ascontiguousarray(scores[:, q])))
                else:
                    ids = np.argpartition(-scores[:, q], shortlist - 1)[:shortlist]
                    found.append((ids, scores[ids, q]))
        result = []
        for ids, coarse in found:
            order = np.argsort(ids, kind="stable")
            result.append((ids[order], coarse[order]))
        return result

    def _globals(self, keys: np.ndarray, ids: np.ndarray | None = None) -> list[torch.Tensor] | None:
        """The models' global vectors of these items, from the first-stage keys the index stores
        (computed from the exact embeddings when it was built), so that re-ranking does not
        recompute them; None if the keys do not split into the models' sizes."""
        rows = keys if ids is None else keys[ids]
        return split_shortlist_keys(rows, [m.config.embed_size for m in self.matcher.models])

    def _check_sizes(self, top_k: int, shortlist: int | None, n: int) -> tuple[int, int]:
        if not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise InputError(f"top_k must be a positive integer, got {top_k!r}")
        if shortlist is None:
            shortlist = n
        if not isinstance(shortlist, (int, np.integer)) or shortlist < 1:
            raise InputError(f"shortlist must be a positive integer, or None to re-rank the whole gallery "
                             f"(--shortlist 0 on the command line), got {shortlist!r}")
        # both capped at the gallery first: top_k=1000 of 32 pictures asks for all 32, whatever the shortlist
        top_k, shortlist = min(int(top_k), n), min(int(shortlist), n)
        if shortlist < top_k:
            raise InputError(f"shortlist ({shortlist}) must be at least top_k ({top_k}): the re-ranking "
                             "returns results from the shortlist only")
        return top_k, shortlist

    def _rows(self, kind: str, index: Any) -> list[torch.Tensor]:
        """Rows `index` of every model's 'image_regions' or 'caption_words' as float32 tensors.

        Only these rows are read from the memory maps; they are checked here because
        `--no-verify` skips the checksum that would have caught damaged values.
        """
        arrays = self.image_regions if kind == "image_regions" else self.caption_words
        rows = []
        for m, array in enumerate(arrays):
            block = as_float32(array[index], copy=True)
            if not np.isfinite(block).all():
                raise InputError(f"{self.folder / f'{kind}.{m}.npy'}: corrupted index file, NaN or infinite "
                                 "embeddings where finite values are expected; rebuild the index")
            rows.append(torch.from_numpy(block))
        return rows

    @staticmethod
    def _best(ids: np.ndarray, scores: np.ndarray, coarse: np.ndarray, top_k: int) -> list[tuple[int, float, float]]:
        order = np.lexsort((ids, -scores))[:top_k]  # best score first, ties by id
        return [(int(ids[i]), float(scores[i]), float(coarse[i])) for i in order]

    # ----------------------------------------------------------------------------- queries
    def search_text(self, query: str, top_k: int = 10, shortlist: int | None = 100,
                    allow_unknown: bool = False) -> list[Hit]:
        """Text -> the top-k images of the gallery.

        Args:
            query: the text; every word must be in the model's vocabulary unless `allow_unknown`.
            top_k: results returned.
            shortlist: candidates kept by the first stage for re-ranking (None: all, exhaustive).
        """
        return self.search_texts([query], top_k=top_k, shortlist=shortlist, allow_unknown=allow_unknown)[0]

    def search_texts(self, queries: Sequence[str], top_k: int = 10, shortlist: int | None = 100,
                     allow_unknown: bool = False) -> list[list[Hit]]:
        """Several texts -> the top-k images of each, as `search_text` gives them one by one.

        The first stage reads the gallery's keys from memory once for up to `KEY_QUERIES` texts
        (what a server gains by taking queries that arrive together as one batch), in a product
        of fixed shape; each text is encoded on its own and its shortlist re-ranked on its own.
        So each answer is, to the last bit, the answer `search_text` gives for that text alone,
        whatever it was batched with (tested on this machine's BLAS: a product whose shape
        followed the batch's size rounded differently).
        """
        if isinstance(queries, str):
            raise InputError("search_texts takes a list of texts, got one str (search_text takes one text)")
        top_k, shortlist = self._check_sizes(top_k, shortlist, self.n_images)
        self._check_models()
        if not len(queries):
            return []
        texts = [self.matcher.encode_texts([query], allow_unknown=allow_unknown, query=True) for query in queries]
        keys = np.concatenate([shortlist_keys(text.global_vectors) for text in texts])
        shortlists = self._coarse_many("image", keys, shortlist)
        results = []
        for text, (ids, coarse) in zip(texts, shortlists):
            regions = self._rows("image_regions", ids)
            scores = self.matcher.score_embeddings(
                regions, (text.words, text.lengths),
                image_globals=self._globals(self.image_keys, ids))[:, 0]          # (shortlist,)
            hits = []
            for image_id, score, rough in self._best(ids, scores, coarse, top_k):
                caption = None
                if self.caps_per_image:
                    caption = self.captions[image_id * self.caps_per_image]
                hits.append(Hit(image_id, score, rough, caption, self.name_of(image_id)))
            results.append(hits)
        return results

    def search_image(self, image_id: int | None = None, features: Any | None = None, top_k: int = 10,
                     shortlist: int | None = 100, boxes: Any | None = None) -> list[Hit]:
        """Image -> the top-k captions of the gallery.

        Args:
            image_id: an image of the index (its stored encoding is used, positions included), or
            features: (K, img_dim) region features of a new image, with
            boxes: its (K, 4) region boxes normalised to [0, 1], when a model reads positions.
        """
        top_k, shortlist = self._check_sizes(top_k, shortlist, self.n_captions)
        self._check_models()
        if (image_id is None) == (features is None):
            raise InputError("give exactly one of image_id and features")
        if features is not None:
            image = self.matcher.encode_images(features, boxes=boxes)
            if len(image) != 1:
                raise InputError(f"search one image at a time, got features of {len(image)} images")
            regions, key = image.regions, shortlist_keys(image.global_vectors)[0]
        else:
            if isinstance(image_id, bool) or not isinstance(image_id, (int, np.integer)):
                raise InputError(f"image id must be an integer, got {image_id!r} ({type(image_id).__name__})")
            if not 0 <= image_id < self.n_images:
                raise InputError(f"image id {image_id!r} is out of range: the index holds images "
                                 f"0..{self.n_images - 1}")
            regions = self._rows("image_regions", slice(image_id, image_id + 1))
            key = self.image_keys[image_id]
        ids, coarse = self._coarse("caption", key, shortlist)
        lengths = torch.from_numpy(np.array(self.caption_lengths[ids]))
        width = int(lengths.max())
        words = self._rows("caption_words", (ids, slice(0, width)))
        scores = self.matcher.score_embeddings(regions, (words, lengths),
                                               image_globals=self._globals(key[None, :]))[0]   # (shortlist,)
        return [Hit(cap_id, score, rough, self.captions[cap_id])
                for cap_id, score, rough in self._best(ids, scores, coarse, top_k)]
