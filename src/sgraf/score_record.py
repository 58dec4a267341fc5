"""What a saved score matrix scored: the record written beside it, and the checks that read it.

A score matrix (`sgraf evaluate --save-sims FILE.npy`) is a plain `.npy`, as the authors' ensemble
script reads them, and says nothing of the split it scored. Flickr30K's dev and test splits have
the same shape (1,000 x 5,000), so a matrix of one evaluated, or averaged with another, as the
other would pass every shape check and give wrong numbers. `FILE.npy.json` records the split (the
folder, split name, file names and sizes, and `sgraf.data.precomp.data_fingerprint` of its files,
as a training run and a gallery index record their data), the checkpoints or matrices that made
it, and a fingerprint of the matrix it describes. `--sims` refuses a matrix whose record names
other captions than the split's (`--data`) or than another matrix's, and warns of other features
with the same captions.

The fingerprint is the sha256 of the matrix's shape and of up to `FINGERPRINT_ROWS` rows spread
over it: a record left beside a matrix written by other means (or by a run stopped between the two
files) no longer matches and is ignored with a warning, without reading 500 MB of an MSCOCO 5K
matrix. A matrix without a record (the authors', or one written by other tools) is checked by its
shape only, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from sgraf import text_files
from sgraf.atomic_write import write_text
from sgraf.errors import InputError

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "sgraf score matrix record"
VERSION = 1
FINGERPRINT_ROWS = 64


def record_path(matrix_path: str | os.PathLike) -> Path:
    """`FILE.npy` -> `FILE.npy.json`."""
    return Path(f"{os.fspath(matrix_path)}.json")


def fingerprint(sims: np.ndarray) -> str:
    """sha256 of the matrix's shape and values of up to `FINGERPRINT_ROWS` evenly spaced rows (a
    memory-mapped matrix reads only those rows): as float32, or for a float64 matrix (an
    ensemble's) its float64 values and the word float64, so that a float32 copy of it is another
    matrix (rounded, it ranks ties otherwise; its record had passed)."""
    import numpy as np    # here, not at import: the CLI names the record path before its imports

    wide = np.dtype(sims.dtype) == np.float64
    digest = hashlib.sha256(json.dumps(list(sims.shape)).encode() + (b"float64" if wide else b""))
    if sims.shape[0]:
        for row in np.unique(np.linspace(0, sims.shape[0] - 1, FINGERPRINT_ROWS).round().astype(np.int64)):
            digest.update(np.ascontiguousarray(sims[row], dtype=np.float64 if wide else np.float32).tobytes())
    return digest.hexdigest()


def split_identity(split: Any, boxes: bool = True) -> dict[str, Any]:
    """The split a matrix scores (a `PrecompSplit`): `sgraf.data.precomp.data_fingerprint` of its
    files (the captions hashed whole, which tells the splits apart; the features by their size and
    ends; with `boxes`, the region boxes and picture sizes where the split has them: a position
    model's scores read them), and the folder, name, file names and sizes, which say it to a reader."""
    from sgraf.data.precomp import BOX_FILES, data_fingerprint

    captions, features = Path(split.caps_path), Path(split.ims_path)
    return {"data": str(captions.resolve().parent), "split": split.split, "captions": captions.name,
            "features": features.name, "n_images": int(split.n_images), "n_captions": int(split.n_captions),
            "fingerprint": data_fingerprint(captions.parent, [split.split], extras=BOX_FILES if boxes else ())}


def _digest(split: dict[str, Any], kind: str) -> Any:
    """The fingerprint's digest of the split's captions or features file (`kind`)."""
    name = split.get(kind)
    return split["fingerprint"].get(name) if isinstance(name, str) else None


def record_text(sims: np.ndarray, split: dict[str, Any] | None, **made_by: Any) -> str:
    """The JSON of a record (`write_record`'s arguments, without the path)."""
    record = {"format": FORMAT, "version": VERSION, "shape": list(sims.shape),
              "matrix_fingerprint": fingerprint(sims), "split": split, **made_by}
    return json.dumps(record, indent=1) + "\n"


def write_record(matrix_path: str | os.PathLike, sims: np.ndarray, split: dict[str, Any] | None,
                 **made_by: Any) -> None:
    """Write `FILE.npy.json` for the matrix just saved at `matrix_path` (atomically).

    Args:
        sims: the matrix as saved (its fingerprint goes into the record).
        split: `split_identity` of the split it scores, or None where that is not known (averaged
            matrices without records).
        made_by: what made it, e.g. ``checkpoints=[...]``, ``precision="bf16"`` or
            ``averaged=[...]`` (plain JSON values).
    """
    write_text(record_path(matrix_path), record_text(sims, split, **made_by))


def read_record(matrix_path: str | os.PathLike, sims: np.ndarray) -> dict[str, Any] | None:
    """The record of the matrix at `matrix_path` (loaded as `sims`), or None: none there, or one
    that is unreadable or describes another matrix (a warning says which)."""
    path = record_path(matrix_path)
    if not path.is_file():    # a matrix written by other code, or copied without its record
        logger.info("%s has no record beside it (%s): it is checked by its shape only", matrix_path, path.name)
        return None
    try:
        record = json.loads(text_files.read_text(path, "a score matrix record (JSON)"))
    except (OSError, ValueError) as error:       # InputError (not UTF-8) is a ValueError
        logger.warning("%s: not a readable score matrix record (%s); %s is checked by its shape only",
                       path, error, matrix_path)
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        logger.warning("%s: not a score matrix record (no \"format\": %r); %s is checked by its shape only",
                       path, FORMAT, matrix_path)
        return None
    if record.get("matrix_fingerprint") != fingerprint(sims):
        logger.warning("%s describes another matrix than %s (written since by other means?); ignored: the "
                       "matrix is checked by its shape only", path, matrix_path)
        return None
    split = record.get("split")
    if split is not None and not (isinstance(split, dict) and isinstance(split.get("fingerprint"), dict)
                                  and isinstance(_digest(split, "captions"), str)):
        logger.warning("%s: field 'split' is %r, expected an object with a 'fingerprint' of its 'captions'; "
                       "ignored", path, split)
        record["split"] = None
    return record


def _named(split: dict[str, Any], kind: str = "captions") -> str:
    """The path of the split's captions or features file (`kind`), or of the file named `kind`."""
    name = split.get(kind) if kind in ("captions", "features") else kind
    return str(Path(str(split.get("data"))) / str(name))


def common_split(paths: Sequence[str | os.PathLike], records: Sequence[dict[str, Any] | None],
                 split: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The split the matrices at `paths` score, by their records: InputError if a record names
    other captions than `split` (the split the command was given) or than another matrix's
    record. Returns `split`, else the split the records agree on, else None (no record names one).
    """
    reference, source = split, None
    for path, record in zip(paths, records):
        scored = record.get("split") if record else None
        if scored is None:
            continue
        if reference is None:
            reference, source = scored, path
        elif _digest(scored, "captions") == _digest(reference, "captions"):
            other = _other_image_files(scored, reference, split_lacks=source is None)
            if other:
                logger.warning("%s scored other %s (%s, by its record) than %s (%s); the captions are the same, so "
                               "it is evaluated as usual", path, " and ".join(other),
                               ", ".join(_named(scored, name) for name in other.values()),
                               "--data's split" if source is None else source,
                               ", ".join(_named(reference, name) if name == "features"
                                         or name in reference["fingerprint"] else f"no {name}"
                                         for name in other.values()))
        else:
            mine, theirs, record_name = _named(scored), _named(reference), record_path(path).name
            if source is None and mine == theirs:
                raise InputError(f"{path} scored {mine} before that file changed (its record {record_name}): "
                                 "these are not the captions it ranks; score the split again")
            if source is None:
                raise InputError(f"{path} scored the captions of {mine} (its record {record_name}), not those of "
                                 f"--data's split, {theirs}: a matrix is evaluated on the split it scored")
            raise InputError(f"{path} scored the captions of {mine} (its record {record_name}), {source} those of "
                             f"{theirs}: the matrices averaged must score one split")
    return reference


def _other_image_files(scored: dict[str, Any], reference: dict[str, Any], split_lacks: bool = False) -> dict[str, str]:
    """The image files whose digests differ between two records' splits: {what: `_named`'s kind}, of the
    features and of the region boxes and picture sizes both fingerprints hold (a position model's
    scores read them; records before session 39 hold none). With `split_lacks` (`reference` is the
    split given with --data, which records every file it has), also the boxes and sizes the matrix
    scored that the split no longer has (a split without them had been evaluated unsaid)."""
    other = {}
    if _digest(scored, "features") != _digest(reference, "features"):
        other["features"] = "features"
    ours, theirs = scored["fingerprint"], reference["fingerprint"]
    for what, suffix in (("region boxes", "_boxes.npy"), ("picture sizes", "_image_sizes.npy")):
        names = [name for name in ours if name.endswith(suffix)
                 and (name in theirs or split_lacks) and ours[name] != theirs.get(name)]
        if names:
            other[what] = names[0]
    return other


def check_same_split(path_a: str | os.PathLike, split_a: dict[str, Any] | None, path_b: str | os.PathLike,
                     split_b: dict[str, Any] | None) -> None:
    """InputError when two matrices' records (`common_split`'s results) name other captions:
    two models are compared on the split both scored. A matrix without a record is not checked."""
    if split_a is None or split_b is None or _digest(split_a, "captions") == _digest(split_b, "captions"):
        return
    raise InputError(f"{path_b} scored the captions of {_named(split_b)}, {path_a} those of {_named(split_a)} "
                     "(by their records): two models are compared on the split both scored")
