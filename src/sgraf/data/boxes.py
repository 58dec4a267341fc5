"""Where each region lies in its picture: the boxes files of a precomp folder.

A split `S` may have, beside `S_ims.npy`:

- `S_boxes.npy`: float32 (n_images, K, 4), each region's x1, y1, x2, y2 in PIXELS of its
  picture (x2 >= x1, y2 >= y1), in the order of the regions of `S_ims.npy`;
- `S_image_sizes.npy`: float32 (n_images, 2), each picture's width and height in pixels.

A model reads boxes NORMALISED to [0, 1] (divided by the picture's width and height), so that
pictures of any size mean the same to it: `read_boxes` returns them so. Folders written before
the sizes file existed (boxes alone, `sgraf convert-tsv` of earlier versions) stay readable:
`explain` keeps drawing their pixel boxes; a model with positions refuses them in one line
naming the missing sizes file.

Writers (`sgraf generate`, `extract`, `convert-tsv`) call `write_boxes`, which checks the boxes
as the reader does, so a folder never holds boxes a model would refuse.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from sgraf.atomic_write import atomic_path
from sgraf.data.arrays import open_npy
from sgraf.errors import InputError

BOXES_SUFFIX = "_boxes.npy"
SIZES_SUFFIX = "_image_sizes.npy"
# How far (pixels) a box may reach outside its picture: detectors round their coordinates, and a
# box ending at x = width + 0.5 is the picture's edge. Beyond it the box belongs to another
# picture (or the sizes to another file); within it the normalised box is clipped to [0, 1].
OUTSIDE_TOLERANCE_PX = 1.0


def boxes_files(data_dir: str | os.PathLike[str], split: str) -> tuple[Path, Path]:
    """Paths of a split's boxes file and image sizes file."""
    data_dir = Path(data_dir)
    return data_dir / f"{split}{BOXES_SUFFIX}", data_dir / f"{split}{SIZES_SUFFIX}"


def box_problems(boxes: np.ndarray, widths: np.ndarray, heights: np.ndarray) -> list[np.ndarray]:
    """The four ways a pixel box can be wrong, as boolean masks over the boxes' leading dims.

    `boxes` (..., 4) x1, y1, x2, y2 as float64; `widths` / `heights` broadcast against
    `boxes[..., 0]`. In order: not finite, x2 < x1, y2 < y1, outside the picture by more than
    `OUTSIDE_TOLERANCE_PX`. The one rule for the reader (`check_boxes`) and the TSV converter.
    """
    x1, y1, x2, y2 = (boxes[..., i] for i in range(4))
    with np.errstate(invalid="ignore"):
        return [~np.isfinite(boxes).all(axis=-1), x2 < x1, y2 < y1,
                (x1 < -OUTSIDE_TOLERANCE_PX) | (y1 < -OUTSIDE_TOLERANCE_PX)
                | (x2 > widths + OUTSIDE_TOLERANCE_PX) | (y2 > heights + OUTSIDE_TOLERANCE_PX)]


def check_boxes(boxes: np.ndarray, sizes: np.ndarray, boxes_source: Any, sizes_source: Any,
                n_images: int | None = None, n_regions: int | None = None) -> None:
    """Raise `InputError` for pixel boxes or picture sizes a model cannot read.

    Checks the shapes ((n_images, K, 4) and (n_images, 2), matching `n_images` / `n_regions`
    when given), finite values, positive sizes, x2 >= x1 and y2 >= y1, and boxes inside their
    picture within `OUTSIDE_TOLERANCE_PX`, and not every box within the first pixel (boxes given
    already divided by the sizes); the message names the file, image and region.
    """
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise InputError(f"{boxes_source}: boxes of shape {boxes.shape}; expected (n_images, regions, 4): "
                         "x1, y1, x2, y2 in pixels per region")
    if sizes.ndim != 2 or sizes.shape[1] != 2:
        raise InputError(f"{sizes_source}: image sizes of shape {sizes.shape}; expected (n_images, 2): width, "
                         "height in pixels per picture")
    if n_images is not None and boxes.shape[0] != n_images:
        raise InputError(f"{boxes_source}: boxes for {boxes.shape[0]} images; expected {n_images}, one per image "
                         "of the features file")
    if sizes.shape[0] != boxes.shape[0]:
        raise InputError(f"{sizes_source}: sizes of {sizes.shape[0]} images; expected {boxes.shape[0]}, one per "
                         f"image of {boxes_source}")
    if n_regions is not None and boxes.shape[1] != n_regions:
        raise InputError(f"{boxes_source}: {boxes.shape[1]} boxes per image; expected {n_regions}, one per region "
                         "of the features file")
    if boxes.dtype.kind not in "fiu" or sizes.dtype.kind not in "fiu":
        raise InputError(f"{boxes_source}: dtype {boxes.dtype} (sizes {sizes.dtype}); expected float32 pixels")
    sizes = np.asarray(sizes, dtype=np.float64)
    bad = ~np.isfinite(sizes) | (sizes <= 0)
    if bad.any():
        image = int(np.argwhere(bad)[0][0])
        raise InputError(f"{sizes_source}: image {image} has size {sizes[image].tolist()}; expected a positive, "
                         "finite width and height in pixels")
    boxes = np.asarray(boxes, dtype=np.float64)
    not_finite, x_order, y_order, outside = box_problems(boxes, sizes[:, None, 0], sizes[:, None, 1])
    problems = (
        (not_finite, "expected finite x1, y1, x2, y2"),
        (x_order | y_order, "expected x2 >= x1 and y2 >= y1"),
        (outside, None),
    )
    for mask, expected in problems:
        if mask.any():
            image, region = (int(v) for v in np.argwhere(mask)[0])
            if expected is None:
                width, height = sizes[image]
                expected = (f"expected inside its {width:g} x {height:g} picture ({sizes_source}), within "
                            f"{OUTSIDE_TOLERANCE_PX:g} pixel")
            raise InputError(f"{boxes_source}: the box of image {image}, region {region} is "
                             f"{boxes[image, region].tolist()}; {expected}")
    divided = divided_images(boxes, sizes)
    if divided.all() and boxes.size:
        smallest = f"{sizes[:, 0].min():g} x {sizes[:, 1].min():g}"
        raise InputError(f"{boxes_source}: every box lies within the first pixel of its picture (all coordinates "
                         f"<= 1, the smallest picture {smallest} pixels): boxes already divided by the picture "
                         f"sizes? expected x1, y1, x2, y2 in pixels (sgraf divides by {sizes_source})")
    if divided.any():     # files of two converters merged: one image's boxes would read as the corner's
        image = int(np.argmax(divided))
        width, height = sizes[image]
        raise InputError(f"{boxes_source}: every box of image {image} lies within the first pixel of its {width:g} x "
                         f"{height:g} picture (all coordinates <= 1; {int(divided.sum())} of {len(divided)} images "
                         f"so): boxes already divided by the picture size? expected x1, y1, x2, y2 in pixels "
                         f"(sgraf divides by {sizes_source})")


def divided_images(boxes: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(n,) bool: the images whose every box coordinate is <= 1, some strictly between 0 and 1,
    while their picture is larger than 2 x 2 pixels: boxes already divided by the picture's size
    (real boxes span pixels), which read as pixels would all sit in the picture's corner. An
    image of zero boxes (padding, no detections) or of whole-pixel ones is not counted."""
    n = boxes.shape[0]
    if not boxes.size:
        return np.zeros(n, dtype=bool)
    flat = np.asarray(boxes).reshape(n, -1)
    fractional = ((flat > 0.0) & (flat < 1.0)).any(axis=1)
    return (flat.max(axis=1) <= 1.0) & fractional & (np.asarray(sizes).min(axis=1) > 2.0)


def normalise_boxes(boxes: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Pixel boxes (n, K, 4) and sizes (n, 2) -> float32 (n, K, 4) in [0, 1] of each picture."""
    scale = np.concatenate([sizes, sizes], axis=1).astype(np.float64)[:, None, :]  # (n, 1, 4): w, h, w, h
    return np.clip(np.asarray(boxes, dtype=np.float64) / scale, 0.0, 1.0).astype(np.float32)


def read_boxes(data_dir: str | os.PathLike[str], split: str, n_images: int, n_regions: int,
               required: bool = False) -> np.ndarray | None:
    """A split's region boxes, normalised to [0, 1] of each picture, checked.

    Args:
        data_dir: the precomp folder.
        split: the split name.
        n_images: images of the features file (the boxes file must have as many rows).
        n_regions: regions K per image of the features file.
        required: whether the caller's model needs them (then absent files are an error).

    Returns:
        float32 (n_images, K, 4) x1, y1, x2, y2 in [0, 1]; None when the split has no boxes
        (or boxes without sizes, written before sizes were recorded) and `required` is False.

    Raises:
        InputError: one line naming the file, and the image and region of a bad box.
    """
    boxes_path, sizes_path = boxes_files(data_dir, split)
    if not boxes_path.is_file():
        if required:
            raise InputError(f"{boxes_path}: missing file; this model uses region positions and needs each "
                             f"region's box ({split}{BOXES_SUFFIX} and {split}{SIZES_SUFFIX}, written by sgraf "
                             "generate, extract and convert-tsv)")
        return None
    if not sizes_path.is_file():
        if required:
            raise InputError(f"{sizes_path}: missing file; the boxes of {boxes_path.name} are in pixels and this "
                             "model with positions needs each picture's width and height beside them (write the "
                             "split again with this sgraf)")
        return None
    boxes = open_npy(boxes_path, f"float32 boxes of shape ({n_images}, {n_regions}, 4)")
    sizes = open_npy(sizes_path, f"float32 image sizes of shape ({n_images}, 2)")
    check_boxes(boxes, sizes, boxes_path, sizes_path, n_images, n_regions)
    return normalise_boxes(boxes, sizes)


def grid_boxes(n_images: int, rows: int, cols: int, width: float, height: float) -> tuple[np.ndarray, np.ndarray]:
    """Pixel boxes of a rows x cols grid over pictures of one size, row-major (as CNN grid
    features are laid out), and their sizes: float32 (n_images, rows * cols, 4), (n_images, 2)."""
    y, x = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    cells = np.stack([x * width / cols, y * height / rows, (x + 1) * width / cols, (y + 1) * height / rows],
                     axis=-1).reshape(rows * cols, 4)
    boxes = np.broadcast_to(cells.astype(np.float32), (n_images, rows * cols, 4)).copy()
    sizes = np.tile(np.array([[width, height]], dtype=np.float32), (n_images, 1))
    return boxes, sizes


def write_boxes(target: Any, split: str, boxes_px: np.ndarray, sizes: np.ndarray) -> None:
    """Write a split's boxes (pixels) and picture sizes, checked as `read_boxes` checks them.

    Args:
        target: a `sgraf.output_folder.NewGeneration` (its `path(name)` gives where each file
            goes) or a folder (each file written atomically).
        split: the split name.
        boxes_px: (n_images, K, 4) x1, y1, x2, y2 in pixels.
        sizes: (n_images, 2) width, height in pixels.

    Raises:
        InputError: boxes a reader would refuse (naming image and region), or an unwritable path.
    """
    boxes_px = np.asarray(boxes_px, dtype=np.float32)
    sizes = np.asarray(sizes, dtype=np.float32)
    names = (f"{split}{BOXES_SUFFIX}", f"{split}{SIZES_SUFFIX}")
    check_boxes(boxes_px, sizes, f"{names[0]} being written", f"{names[1]} being written")
    for name, array in zip(names, (boxes_px, sizes)):
        if hasattr(target, "path"):
            with open(target.path(name), "wb") as handle:
                np.save(handle, array, allow_pickle=False)
        else:
            with atomic_path(Path(target) / name) as temporary, open(temporary, "wb") as handle:
                np.save(handle, array, allow_pickle=False)
