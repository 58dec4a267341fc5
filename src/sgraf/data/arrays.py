"""Reading `.npy` files without trusting them, and checking region features for NaN/inf.

`open_npy` opens a file memory-mapped and never unpickles: a file numpy would refuse (not a
`.npy`, a `.npz` archive, Python objects, a corrupted header, fewer bytes than its header
describes) gets a one-line `InputError` naming the file, what is wrong and what was expected,
in our words rather than numpy's (whose advice to load pickles "unsafely" is not for users of
a data file).

`padded_ids` lays token-id rows of several lengths into one zero-padded int64 tensor.

`map_row_chunks` runs a function over chunks of whole rows of a large matrix on PyTorch's
number of threads (NumPy releases the GIL in its comparisons, sums and casts): the metrics'
rank counts, the average of saved score matrices, and `first_non_finite`, their NaN/inf check.

`check_finite_features` is the NaN/inf check every reader of region features runs on each
block it reads (a batch off the memory map, a training batch, a chunk of a gallery): one
vectorised `isfinite(...).all()` per block, and only on failure the work to name the image,
region and dimension.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tokenize
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sgraf.errors import InputError, NonFiniteFeatures

logger = logging.getLogger(__name__)

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
# What numpy raises reading a damaged `.npy` (or a member of an `.npz`): on Python 3.12 a header
# its literal parser refuses reaches its fallback parser, whose `tokenize` raises TokenError.
DAMAGED_NPY = (ValueError, OSError, EOFError, SyntaxError, TypeError, tokenize.TokenError)


def open_npy(path: str | os.PathLike[str], expected: str, what: str = "") -> np.ndarray:
    """A `.npy` file as a read-only memory map; never unpickles anything.

    Args:
        path: the file.
        expected: what the caller needs, for the error message ("float32 features of shape
            (n_images, regions, dim)").
        what: words put before "not a readable .npy array" ("corrupted index file, ").

    Raises:
        FileNotFoundError: no such file.
        InputError: the file is not a plain `.npy` array (the message says why, names the
            file and ends with "expected <expected>").
    """
    path = Path(path)
    with open(path, "rb") as handle:
        head = handle.read(len(NPY_MAGIC))
    if not head.startswith(NPY_MAGIC):
        raise InputError(f"{path}: {what}not a readable .npy array: {_not_npy(head, path)}; expected {expected}")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except DAMAGED_NPY:
        raise InputError(f"{path}: {what}not a readable .npy array: {_why_unreadable(path)}; "
                         f"expected {expected}") from None
    if not isinstance(array, np.ndarray):  # np.load's other results (archives) are ruled out above
        raise InputError(f"{path}: {what}not a readable .npy array; expected {expected}")
    if isinstance(array, np.memmap):       # bytes past the array: two files written into one, or a copy gone wrong
        extra = path.stat().st_size - array.offset - array.nbytes
        if extra > 0:
            logger.warning("%s: %d byte%s past the end of its %s array, which are not read: was something else "
                           "written into the file?", path, extra, "" if extra == 1 else "s", array.shape)
    return array


def file_row(array: np.ndarray, index: int) -> np.ndarray:
    """Row `index` of `array`, a copy. Of a memory map as `open_npy` makes it, or a view of one
    whose rows are whole rows of the file (`PrecompSplit.images` takes every fifth row of a file
    of one row per caption), the row is read from the file with an ordinary read: a file cut
    short since it was mapped (a writer truncating it: `np.save`, `cp`, `sgraf generate
    --overwrite`) gives an OSError here, where touching the mapped page past its end had killed
    the process with SIGBUS (`sgraf serve` explaining while the data was rewritten). The file is
    read by its path: one replaced under that name since (renamed over it) is read as it is now,
    which the caller's own check of the files (serve's) is there to see.

    Raises:
        OSError: the file cannot be read, or ends before the row (errno EIO, naming the file).
    """
    root = array
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base
    filename = getattr(root, "filename", None)
    if not isinstance(array, np.ndarray) or not array.ndim or not isinstance(root, np.memmap) or filename is None \
            or root.offset is None:
        return np.array(array[index])
    index = range(array.shape[0])[index]        # an IndexError for a row outside, as indexing gives
    row = array[index]                          # a view: no data touched
    if not row.flags.c_contiguous:
        return np.array(row)
    start = row.__array_interface__["data"][0] - root.__array_interface__["data"][0] + root.offset
    size = row.nbytes
    with open(filename, "rb") as handle:
        data = os.pread(handle.fileno(), size, start) if hasattr(os, "pread") else None
        if data is None:                        # Windows: no pread
            handle.seek(start)
            data = handle.read(size)
    if len(data) != size:
        raise OSError(errno.EIO, f"the file ends before row {index} of its {array.shape} array (cut short since it "
                                 "was opened?)", str(filename))
    return np.frombuffer(data, dtype=array.dtype).reshape(row.shape).copy()


def _not_npy(head: bytes, path: Path) -> str:
    if not head:
        return "the file is empty"
    if head.startswith(ZIP_MAGIC):
        import zipfile

        try:        # torch.save writes a zip of a pickle: a checkpoint given where a matrix goes
            with zipfile.ZipFile(path) as archive:
                if any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist()):
                    return "it is a PyTorch file (a checkpoint? give it with --checkpoint)"
        except (OSError, zipfile.BadZipFile):
            pass
        return "it is a zip archive (.npz?), not a single array"
    return "it does not start with the NumPy header (another format, or a pickle, which sgraf never loads)"


def _why_unreadable(path: Path) -> str:
    """Why numpy refused a file that starts like a `.npy`, from its header."""
    with open(path, "rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
        except DAMAGED_NPY:
            return "its header is corrupted"
        data_start = handle.tell()
    if dtype.hasobject:
        return f"it holds Python objects (dtype {dtype}), which sgraf never unpickles"
    needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    present = path.stat().st_size - data_start
    if present < needed:
        return (f"truncated: its header describes a {dtype} array of shape {tuple(shape)} ({needed} bytes of "
                f"data) but only {present} bytes follow")
    return f"numpy cannot map its {dtype} array of shape {tuple(shape)}"


def mapped_file(features: Any) -> tuple[str | None, int]:
    """The file of a memory-mapped array (or of a view of whole images of one) and the file row
    of its row 0; (None, 0) for anything else."""
    filename = getattr(features, "filename", None)
    if filename is None or not isinstance(features, np.ndarray):
        return None, 0
    root = features
    while isinstance(root.base, np.ndarray):
        root = root.base
    offset = features.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    row_bytes = root.strides[0] if root.ndim else 0
    if row_bytes <= 0 or offset % row_bytes:
        return None, 0   # not a slice of whole images: no file row to name
    return str(filename), offset // row_bytes


def as_float32(values: Any, copy: bool = False) -> np.ndarray:
    """`values` (an array or memory-map slice of any float dtype) as float32, a copy if `copy`; a
    float64 value beyond float32's range becomes inf quietly (numpy warns, naming its own source
    line), for `check_finite_features` to refuse, naming the file and the value's place."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(values, dtype=np.float32) if copy else np.asarray(values, dtype=np.float32)


def check_finite_features(features: Any, source: str | os.PathLike[str] | None = None, first_image: int = 0,
                          image_ids: Sequence[int] | torch.Tensor | None = None, stored: Any = None) -> None:
    """Raise `InputError` naming the file and the image of the first NaN/inf in region features.

    Args:
        features: (n, K, D) region features (numpy array, memory map or tensor); (K, D) is
            one image.
        source: the file named in the message; default: the file of a memory map (its rows
            then counted from the file's first image), else "image features".
        first_image: the image index of row 0 (a block read from the middle of a file).
        image_ids: the image index of each row instead (a shuffled training batch).
        stored: the dtype of the file the features were read from, when it is not float32: an
            inf there is said to be a value beyond float32's range.
    """
    if isinstance(features, torch.Tensor) and (features.device.type != "cpu" or features.dtype == torch.bfloat16):
        if bool(torch.isfinite(features).all()):
            return
        values = features.detach().float().cpu().numpy()
    else:
        # numpy for CPU tensors too (a view): its isfinite is ~20x cheaper in CPU time than
        # torch's on a (128, 36, 2048) batch (benchmarks/bench_finite_check.py)
        values = features.detach().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
        if np.isfinite(values).all():
            return
    if source is None:
        source, first_row = mapped_file(features)
        source, first_image = source or "image features", first_image + first_row
    if values.ndim == 2:
        values = values[None]
    bad = ~np.isfinite(values)
    row, region, dim = (int(v) for v in np.argwhere(bad)[0])
    images = int(bad.reshape(len(bad), -1).any(axis=1).sum())
    image = int(image_ids[row]) if image_ids is not None else first_image + row
    others = f" ({images - 1} more image{'s' if images > 2 else ''} in this block too)" if images > 1 else ""
    value = values[row, region, dim]
    beyond = (f" (a {np.dtype(stored)} value beyond float32's range, about 3.4e38, read as float32)"
              if stored is not None and np.dtype(stored) != np.float32 and np.isinf(value) else "")
    raise NonFiniteFeatures(f"{source}: feature [image {image}, region {region}, dim {dim}] is {value}{beyond}; "
                     f"expected finite values{others}")


def padded_ids(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Token-id rows of several lengths as one (n, longest) int64 tensor, zero past each row.

    Laid out in a numpy array, a row per assignment: for 25,000 Flickr30K-like captions in
    buckets of 128, 0.04 s against 0.44 s for a tensor filled row by row with `torch.as_tensor`
    (2-core AMD EPYC Zen 3).
    """
    lengths = [len(row) for row in rows]
    out = np.zeros((len(rows), max(lengths, default=0)), dtype=np.int64)
    for index, (row, length) in enumerate(zip(rows, lengths)):
        out[index, :length] = row
    return torch.from_numpy(out)


def row_chunks(n_rows: int, n_cols: int, elements: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive chunks of whole rows of an (n_rows, n_cols) matrix, about
    `elements` values each (at least one row)."""
    rows_per_chunk = max(1, elements // max(n_cols, 1))
    return [(start, min(start + rows_per_chunk, n_rows)) for start in range(0, n_rows, rows_per_chunk)]


def map_row_chunks(function: Callable[[tuple[int, int]], Any], n_rows: int, n_cols: int,
                   elements: int) -> list[Any]:
    """`function((start, stop))` of every chunk of `row_chunks`, results in row order; on
    `torch.get_num_threads()` threads when there are several chunks (NumPy's work on each chunk
    releases the GIL, so a many-core host shares it out)."""
    chunks = row_chunks(n_rows, n_cols, elements)
    workers = min(len(chunks), torch.get_num_threads())
    if workers <= 1:
        return [function(chunk) for chunk in chunks]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(function, chunks))


# Values per chunk of `first_non_finite`: its boolean buffer (1 MiB) is reused from the heap. One
# `isfinite(...).all()` over an MSCOCO-size matrix wrote a 125 MB buffer of fresh pages, 0.4-0.5 s
# of a fresh process on a 2-core AMD EPYC Zen 3; by chunks it takes 0.03-0.05 s.
FINITE_CHUNK_ELEMENTS = 1 << 20


def first_non_finite(matrix: Any, elements: int = FINITE_CHUNK_ELEMENTS) -> tuple[int, int] | None:
    """(row, column) of the first NaN/inf of a 2-d array (a memory map too) in row order, or None
    when every value is finite; checked by chunks of whole rows (`map_row_chunks`)."""
    def chunk(rows: tuple[int, int]) -> tuple[int, int] | None:
        start, stop = rows
        finite = np.isfinite(matrix[start:stop])
        if finite.all():
            return None
        row, column = np.argwhere(~finite)[0]
        return start + int(row), int(column)

    found = [where for where in map_row_chunks(chunk, matrix.shape[0], matrix.shape[1], elements) if where]
    return found[0] if found else None
