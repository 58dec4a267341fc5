"""Which files of a precomp data folder belong together (read as one).

    DATA/{split}_ims.npy          features             (precomp, convert-tsv, extract, generate)
    DATA/{split}_caps.txt         captions, grouped by image
    DATA/{split}_boxes.npy        region boxes, pixels (generate, convert-tsv, extract; explain draws them)
    DATA/{split}_image_sizes.npy  picture sizes        (beside the boxes: models read boxes / size)
    DATA/{split}_image_ids.txt    image ids and sizes  (convert-tsv)
    DATA/{split}_image_names.txt  image file names     (extract)
    DATA/{split}_scenes.jsonl     scene descriptions   (generate)
    DATA/images/{split}/...       rendered pictures    (generate; explain draws them)
    DATA/vocab.json, DATA/benchmark.json               (generate: the whole data set)

A writer of one split replaces the split's files as a whole (`sgraf.output_folder`); the
benchmark generator replaces the whole layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

SPLIT_SUFFIXES = ("_ims.npy", "_caps.txt", "_boxes.npy", "_image_sizes.npy", "_image_ids.txt", "_image_names.txt",
                  "_scenes.jsonl")
DATA_SET_FILES = ("vocab.json", "benchmark.json")
IMAGES = "images"
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg")     # image i's picture: images/{split}/{i:05d}{suffix}, the first found


def pictures_folder(data_dir: str | os.PathLike[str], split: str) -> Path:
    """A split's picture folder in a data folder: `DATA/images/SPLIT` (`sgraf generate` and
    `sgraf extract` write it; pictures are `picture_path`'s names in it)."""
    return Path(data_dir) / IMAGES / split


def picture_name(split: str, image_id: int, suffix: str) -> str:
    """Image `image_id`'s picture within a data folder, as a relative name: `images/SPLIT/{id:05d}{suffix}`
    (what `sgraf generate` and `sgraf extract` write, and `picture_path` finds)."""
    return f"{IMAGES}/{split}/{image_id:05d}{suffix}"


def picture_path(folder: str | os.PathLike[str], image_id: int) -> Path | None:
    """Image `image_id`'s picture in a picture folder (`images/{split}`): `{id:05d}{suffix}` for the
    first of `PICTURE_SUFFIXES` that is a file; None without one."""
    names = (Path(folder) / f"{image_id:05d}{suffix}" for suffix in PICTURE_SUFFIXES)
    return next((path for path in names if path.is_file()), None)


def pictures_fingerprint(data_dir: str | os.PathLike[str], split: str, n_images: int) -> dict[str, object] | None:
    """What a gallery's pictures are, cheaply: ``{"count", "sha256"}``, the number of images with a
    picture and the sha256 of each one's file name and size (one listing of the folder, no file
    read); None without a picture folder. Other files in the folder count for nothing. A server
    compares it with what its index recorded: another split's pictures copied in had been
    served as the gallery's without a word."""
    import hashlib

    folder = pictures_folder(data_dir, split)
    try:       # by lower-cased name: a file system that ignores case serves 00001.PNG as 00001.png
        names = {name.lower(): name for name in os.listdir(folder)}
    except (FileNotFoundError, NotADirectoryError):
        return None
    digest, count = hashlib.sha256(), 0
    for image_id in range(n_images):
        name = next((names[f"{image_id:05d}{suffix}"] for suffix in PICTURE_SUFFIXES
                     if f"{image_id:05d}{suffix}" in names), None)
        if name is None:
            continue
        try:
            size = os.stat(folder / name).st_size
        except OSError:        # a dangling link, a link loop: no picture a server could send
            continue
        digest.update(f"{name}\t{size}\n".encode())
        count += 1
    return {"count": count, "sha256": digest.hexdigest()}


def split_problem(split: object) -> str | None:
    """Why `split` cannot name a split (its files are `DATA/{split}_ims.npy` and so on: a path
    separator or a leading dot would put them elsewhere, or hide them), else None."""
    if not isinstance(split, str) or not split:
        return f"expected a split name such as train, dev, test or testall, got {split!r}"
    if "/" in split or "\\" in split or split.startswith(".") or not split.isprintable():
        return (f"expected a split name such as train, dev, test or testall (no path separator, no leading dot), "
                f"got {split!r}")
    return None


def check_split_name(split: object) -> None:
    """InputError when `split` cannot name a split (`split_problem`)."""
    from sgraf.errors import InputError

    problem = split_problem(split)
    if problem is not None:
        raise InputError(f"split: {problem}")


def split_family(split: str) -> Callable[[str], bool]:
    """Predicate over relative paths: the files of `split` (features and every companion)."""
    names = {split + suffix for suffix in SPLIT_SUFFIXES}
    pictures = f"{IMAGES}/{split}/"
    return lambda name: name in names or name.startswith(pictures)


def data_set_family(name: str) -> bool:
    """Whether a relative path is a file of the precomp layout (any split, vocabulary, pictures)."""
    top_level = "/" not in name
    return ((top_level and (name.endswith(SPLIT_SUFFIXES) or name in DATA_SET_FILES))
            or name.startswith(IMAGES + "/"))


def data_set_files(data_dir: str | os.PathLike[str]) -> list[str]:
    """The files of the precomp layout that are in `data_dir` now (`data_set_family`: every
    split's files, the vocabulary, the benchmark's record, the pictures): what no command may
    write over while it reads the folder, whichever of its splits it reads."""
    top = Path(data_dir)
    try:
        names = [entry.name for entry in os.scandir(top) if entry.is_file()]
    except OSError:     # not there (yet): the command says so when it reads it
        return []
    found = [f"{os.fspath(data_dir)}/{name}" for name in sorted(names) if data_set_family(name)]
    for root, folders, files in os.walk(top / IMAGES):
        folders.sort()
        found.extend(os.path.join(root, name) for name in sorted(files))
    return found


def split_paths(data_dir: str, split: str) -> list[str]:
    """The paths of `split`'s files in `data_dir` (whether they exist or not), and its pictures
    folder: what a command reading the split must never write over."""
    return [f"{data_dir}/{split}{suffix}" for suffix in SPLIT_SUFFIXES] + [f"{data_dir}/{IMAGES}/{split}"]


def split_files(data_dir: str | os.PathLike[str], split: str) -> tuple[Path, Path]:
    """Paths of a split's feature and caption files (`sgraf.data.precomp` reads them; here so
    that a command can name them before it imports PyTorch)."""
    data_dir = Path(data_dir)
    return data_dir / f"{split}_ims.npy", data_dir / f"{split}_caps.txt"
