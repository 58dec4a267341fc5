"""Bottom-up-attention TSV -> precomp features.

The `generate_tsv` tool of bottom-up-attention writes one image per line, 6 tab-separated
fields: `image_id, image_w, image_h, num_boxes, boxes, features`, where `boxes` and
`features` are base64 of float32 arrays of shape (num_boxes, 4) and (num_boxes, D). This
module streams such a file (rows can be ~400 KB each) into:

- `{split}_ims.npy`: (n, K, D) float32 features (K = num_boxes, the same for every row);
- `{split}_boxes.npy`: (n, K, 4) float32 boxes (x1, y1, x2, y2 in pixels of the picture), as
  the detector gave them; `explain` draws them and a model with positions reads them;
- `{split}_image_sizes.npy`: (n, 2) float32 width, height in pixels (`image_w`, `image_h`),
  which turn the boxes into positions relative to the picture;
- `{split}_image_ids.txt`: `image_id<TAB>image_w<TAB>image_h` per row, in file order;
- `{split}_caps.txt` when a captions file (`image_id<TAB>caption` lines) is given: each
  image's captions grouped in row order (every image needs the same number).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgraf import text_files
from sgraf.atomic_write import preallocated_memmap
from sgraf.data.boxes import box_problems, divided_images, write_boxes
from sgraf.data.layout import check_split_name, split_family
from sgraf.errors import InputError
from sgraf.output_folder import NewGeneration

logger = logging.getLogger(__name__)

TSV_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")


@dataclass(frozen=True)
class TsvRow:
    image_id: str
    image_w: int
    image_h: int
    boxes: np.ndarray  # (num_boxes, 4) float32
    features: np.ndarray  # (num_boxes, D) float32


def _count_rows(path: Path) -> int:
    rows = 0
    for _, line in text_files.lines(path):
        rows += bool(line.strip())
    return rows


def _int_field(value: str, path: Path, line: int, field: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{path}:{line}: field {field!r} is {value[:30]!r}; expected an integer") from None


def _array_field(value: str, path: Path, line: int, field: str, rows: int, width: int | None) -> np.ndarray:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{path}:{line}: field {field!r} is not valid base64 ({exc})") from None
    if rows <= 0 or len(raw) % (4 * rows):
        raise InputError(f"{path}:{line}: field {field!r} decodes to {len(raw)} bytes; expected num_boxes={rows} "
                         "rows of float32")
    if width is not None and len(raw) != 4 * rows * width:   # another count of boxes, or of values per box
        raise InputError(f"{path}:{line}: field {field!r} decodes to {len(raw)} bytes ({len(raw) // 4} float32); "
                         f"expected num_boxes={rows} x {width} float32 ({4 * rows * width} bytes)")
    return np.frombuffer(raw, dtype=np.float32).reshape(rows, -1)


def parse_tsv_line(text: str, path: Path, line: int) -> TsvRow:
    """Parse one TSV line; errors name the file, the line and the field."""
    fields = text.rstrip("\r\n").split("\t")
    if len(fields) != len(TSV_FIELDS):
        raise InputError(f"{path}:{line}: {len(fields)} tab-separated fields; expected {len(TSV_FIELDS)} "
                         f"({', '.join(TSV_FIELDS)})")
    image_id, w, h, n, boxes, features = fields
    num_boxes = _int_field(n, path, line, "num_boxes")
    sizes = {}
    for field, value in (("image_w", w), ("image_h", h)):
        sizes[field] = _int_field(value, path, line, field)
        if sizes[field] <= 0:
            raise InputError(f"{path}:{line}: field {field!r} is {sizes[field]}; expected the picture's size in "
                             "pixels (a positive integer)")
    return TsvRow(
        image_id=image_id,
        image_w=sizes["image_w"],
        image_h=sizes["image_h"],
        boxes=_array_field(boxes, path, line, "boxes", num_boxes, 4),
        features=_array_field(features, path, line, "features", num_boxes, None),
    )


def check_row_boxes(row: TsvRow, path: Path, line: int) -> None:
    """Refuses a row whose boxes are not finite x1, y1, x2, y2 inside its picture.

    The message names the file, the line, the image and the first bad region. A box may reach
    `sgraf.data.boxes.OUTSIDE_TOLERANCE_PX` past the border (detectors clip to [0, w - 1] or
    [0, w]), as the reader allows.
    """
    problems = zip(box_problems(row.boxes.astype(np.float64), row.image_w, row.image_h),
                   ("holds NaN or inf", "has x2 < x1", "has y2 < y1",
                    f"lies outside the {row.image_w} x {row.image_h} picture (image_w x image_h)"))
    for bad, what in problems:
        if bad.any():
            region = int(np.flatnonzero(bad)[0])
            box = ", ".join(f"{v:g}" for v in row.boxes[region].tolist())
            raise InputError(f"{path}:{line}: image_id {row.image_id!r}, region {region}: box [{box}] {what}; "
                             "expected 0 <= x1 <= x2 <= image_w and 0 <= y1 <= y2 <= image_h (pixels)")


def read_caption_table(path: Path, key: str = "image_id") -> dict[str, list[str]]:
    """`key<TAB>caption` lines -> {key: [captions]} in order of first appearance (`key` names the
    first field in messages: 'image_id' for convert-tsv, 'file_name' for extract). A line of more
    than two tab-separated fields is refused: its caption would carry the rest of the line."""
    if not path.is_file():
        raise InputError(f"{path}: missing captions file")
    table: dict[str, list[str]] = {}
    data = text_files.read_bytes(path)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}:{number}: bytes are not valid UTF-8") from None
        image_id, tab, caption = text.partition("\t")
        if not tab:
            raise InputError(f"{path}:{number}: expected '{key}<TAB>caption'")
        if "\t" in caption:
            raise InputError(f"{path}:{number}: {text.count(chr(9)) + 1} tab-separated fields; expected "
                             f"'{key}<TAB>caption' (a caption holds no tab)")
        if not caption.strip():
            raise InputError(f"{path}:{number}: empty caption for {image_id.strip()!r}")
        table.setdefault(image_id.strip(), []).append(caption.strip())
    return table


def check_caption_counts(counts: dict[str, int], path: str | os.PathLike[str], what: str = "image") -> None:
    """Every image needs the same number of captions (precomp pairs caption k with image k // c):
    otherwise an InputError naming the first image whose count is not the most common one."""
    tally: dict[int, int] = {}
    for count in counts.values():
        tally[count] = tally.get(count, 0) + 1
    if len(tally) <= 1:
        return
    usual = max(tally, key=lambda count: (tally[count], count))
    name, count = next((name, count) for name, count in counts.items() if count != usual)
    raise InputError(f"{path}: {what} {name!r} has {count} caption{'s' if count != 1 else ''} where {tally[usual]} "
                     f"of the {len(counts)} images have {usual}; precomp needs the same number for every image")


def convert_tsv(tsv_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], split: str,
                captions_path: str | os.PathLike[str] | None = None, progress: bool = True,
                overwrite: bool = False) -> dict[str, int]:
    """Stream a bottom-up-attention TSV into the precomp layout (see the module docstring).

    Every row must have the same number of boxes and feature size. The files are one
    generation (`sgraf.output_folder.NewGeneration`): written aside and moved into place only
    when the whole TSV has been read; a folder that already holds files of the split is
    refused unless `overwrite`, which replaces them and removes the split's files an earlier
    sgraf run wrote that this one does not (captions of a run with `captions_path`, say).
    Without `captions_path`, captions the user put there (not written by sgraf) stay, paired
    with the new features; any other file of the split that sgraf did not write is refused.

    Returns:
        `{"images", "regions", "feature_dim", "captions"}`.
    """
    check_split_name(split)
    tsv_path, out_dir = Path(tsv_path), Path(out_dir)
    if not tsv_path.is_file():
        raise InputError(f"{tsv_path}: missing TSV file")
    table = read_caption_table(Path(captions_path)) if captions_path is not None else None
    n_rows = _count_rows(tsv_path)
    if n_rows == 0:
        raise InputError(f"{tsv_path}: no rows")
    names = {"ims": f"{split}_ims.npy", "boxes": f"{split}_boxes.npy", "sizes": f"{split}_image_sizes.npy",
             "ids": f"{split}_image_ids.txt"}   # boxes and sizes: `sgraf.data.boxes.write_boxes`
    if table is not None:
        names["caps"] = f"{split}_caps.txt"
    with NewGeneration(out_dir, names.values(), split_family(split), "convert-tsv", overwrite=overwrite,
                       paired=[f"{split}_caps.txt"] if table is None else [],
                       inputs=[("--tsv", tsv_path), ("--captions", captions_path)]) as generation:
        shape, n_caps, boxes, sizes, lines = _convert_rows(tsv_path, n_rows, table, captions_path,
                                                    {key: generation.path(name) for key, name in names.items()},
                                                    progress)
        divided = divided_images(boxes, sizes)          # as the reader refuses them
        if divided.all() and boxes.size:
            raise InputError(f"{tsv_path}: every box of its {shape[0]} rows lies within the first pixel of its "
                             "picture (all coordinates <= 1): field 'boxes' holds boxes already divided by image_w "
                             "and image_h? expected x1, y1, x2, y2 in pixels (sgraf divides them)")
        if divided.any():
            raise InputError(f"{tsv_path}:{lines[int(np.argmax(divided))]}: every box lies within the first pixel "
                             f"of its picture (all coordinates <= 1; {int(divided.sum())} of {shape[0]} rows so): "
                             "field 'boxes' holds boxes already divided by image_w and image_h? expected x1, y1, "
                             "x2, y2 in pixels (sgraf divides them)")
        write_boxes(generation, split, boxes, sizes)
    logger.info("%s -> %s: %d images x %d regions x %d", tsv_path, out_dir / names["ims"], *shape)
    return {"images": shape[0], "regions": shape[1], "feature_dim": shape[2], "captions": n_caps}


def _convert_rows(tsv_path: Path, n_rows: int, table: dict[str, list[str]] | None,
                  captions_path: str | os.PathLike[str] | None, paths: dict[str, Path],
                  progress: bool) -> tuple[tuple[int, int, int], int, np.ndarray, np.ndarray, list[int]]:
    """Writes the TSV's rows to `paths` ('ims', 'ids', 'caps' when `table`).

    Returns:
        ((images, regions, feature size), captions written, the boxes (n, K, 4) in pixels,
        the pictures' sizes (n, 2), each row's line in the file), the boxes checked row by row
        (`check_row_boxes`).
    """
    from sgraf.progress import bar as progress_bar

    ims = boxes = None
    ids: list[str] = []
    first_line: dict[str, int] = {}                   # image_id -> its line: each image once
    sizes = np.zeros((n_rows, 2), dtype=np.float32)  # width, height
    with progress_bar(n_rows, tsv_path.name, "img", progress, leave=True) as bar:
        row_index = 0
        for number, raw in text_files.lines(tsv_path):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{tsv_path}:{number}: bytes are not valid UTF-8") from None
            row = parse_tsv_line(text, tsv_path, number)
            key = str(row.image_id)
            if key in first_line:
                raise InputError(f"{tsv_path}:{number}: image_id {key!r} again (first on line {first_line[key]}); "
                                 "expected each image once")
            first_line[key] = number
            if ims is None:
                k, d = row.features.shape
                ims = preallocated_memmap(paths["ims"], np.float32, (n_rows, k, d))
                boxes = np.zeros((n_rows, k, 4), dtype=np.float32)   # 16 bytes a region: kept in memory
            elif row.features.shape != ims.shape[1:]:
                raise InputError(f"{tsv_path}:{number}: num_boxes x feature size is {row.features.shape}; "
                                 f"expected {ims.shape[1:]} like the first row (precomp needs a fixed "
                                 "number of regions)")
            if not np.isfinite(row.features).all():
                region, dim = (int(i) for i in np.argwhere(~np.isfinite(row.features))[0])
                raise InputError(f"{tsv_path}:{number}: field 'features' holds NaN or inf (region {region}, dimension "
                                 f"{dim}); expected finite base64 float32 values (float64 ones decode to such values)")
            check_row_boxes(row, tsv_path, number)
            ims[row_index] = row.features
            boxes[row_index] = row.boxes
            sizes[row_index] = (row.image_w, row.image_h)
            ids.append(f"{row.image_id}\t{row.image_w}\t{row.image_h}")
            row_index += 1
            bar.update(1)
    n_caps = 0
    if table is not None:
        image_ids = list(first_line)                  # the rows' image_ids, in row order
        missing = [key for key in image_ids if key not in table]
        if missing:
            raise InputError(f"{captions_path}: no captions for image_id {missing[0]!r} "
                             f"({len(missing)} images without captions)")
        check_caption_counts({key: len(table[key]) for key in image_ids}, captions_path, "image_id")
        unused = [key for key in table if key not in first_line]
        if unused:
            logger.warning("%s: the captions of %d image_id(s) not in %s are left out (%r first)", captions_path,
                           len(unused), tsv_path, unused[0])
        lines = [c for key in image_ids for c in table[key]]
        n_caps = len(lines)
        paths["caps"].write_bytes("".join(c + "\n" for c in lines).encode("utf-8"))
    paths["ids"].write_text("".join(i + "\n" for i in ids), encoding="utf-8")
    shape = ims.shape
    ims.flush()
    del ims
    return (int(shape[0]), int(shape[1]), int(shape[2])), n_caps, boxes, sizes, list(first_line.values())
