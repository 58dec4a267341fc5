"""Drawing the embedded benchmark's scenes (Pillow) and a preview grid of images + captions."""

from __future__ import annotations

import logging
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw, ImageFont

from sgraf.atomic_write import atomic_path

logger = logging.getLogger(__name__)

CANVAS = 192  # pixels; EfficientNet-Lite0 turns 192 x 192 into a 6 x 6 grid of regions
LAYOUT = 3  # objects sit in the cells of a 3 x 3 layout (64 px each)
BACKGROUND = (236, 236, 230)
COLOURS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 20),
    "purple": (148, 70, 189),
    "orange": (250, 127, 14),
}
SHAPES = ("square", "circle", "triangle", "diamond", "cross")
SIZES = ("small", "large")
HALF_SIZE = {"small": 14, "large": 25}  # half the object's extent, pixels


@dataclass(frozen=True)
class SceneObject:
    """One object: attributes, layout cell (row, col in 0..2) and pixel centre."""

    colour: str
    shape: str
    size: str
    row: int
    col: int
    cx: int
    cy: int

    @property
    def half(self) -> int:
        return HALF_SIZE[self.size]

    @property
    def box(self) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1) pixel box, x1/y1 exclusive."""
        h = self.half
        return self.cx - h, self.cy - h, self.cx + h, self.cy + h

    def to_dict(self) -> dict[str, object]:
        return {"colour": self.colour, "shape": self.shape, "size": self.size, "row": self.row,
                "col": self.col, "cx": self.cx, "cy": self.cy, "box": list(self.box)}


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x0, y0, x1, y1 = obj.box
    fill = COLOURS[obj.colour]
    cx, cy, h = obj.cx, obj.cy, obj.half
    if obj.shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif obj.shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(cx, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)
    elif obj.shape == "diamond":
        draw.polygon([(cx, y0), (x1 - 1, cy), (cx, y1 - 1), (x0, cy)], fill=fill)
    elif obj.shape == "cross":
        t = max(3, (2 * h) // 6)  # half the bar thickness
        draw.rectangle((cx - t, y0, cx + t - 1, y1 - 1), fill=fill)
        draw.rectangle((x0, cy - t, x1 - 1, cy + t - 1), fill=fill)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}; expected one of {SHAPES}")


def render_scene(objects: Sequence[SceneObject], size: int = CANVAS) -> Image.Image:
    """An RGB image of the objects on a plain background (deterministic pixels)."""
    image = Image.new("RGB", (CANVAS, CANVAS), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_object(draw, obj)
    if size != CANVAS:
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return image


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` characters, words never cut."""
    return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def preview_grid(images: Sequence[Image.Image], captions: Sequence[Sequence[str]], path: str | os.PathLike[str],
                 columns: int = 4, captions_per_image: int = 3) -> Path:
    """Save a PNG grid: each image with its first captions written below it.

    Args:
        images: the images (any size; shown at 192 px).
        captions: for each image, its captions.
        path: where to write the PNG.
        columns: images per row.
        captions_per_image: how many captions to print under each image.
    """
    font = _font(11)
    text_lines = [[f"{j + 1}. {line}" if i == 0 else f"   {line}"
                   for j, c in enumerate(caps[:captions_per_image]) for i, line in enumerate(_wrap(c, 34))]
                  for caps in captions]
    line_h, pad = 14, 8
    text_h = line_h * max(len(t) for t in text_lines) + pad
    cell_w, cell_h = CANVAS + 2 * pad, CANVAS + text_h + 2 * pad
    rows = (len(images) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for k, (image, lines) in enumerate(zip(images, text_lines)):
        x, y = (k % columns) * cell_w + pad, (k // columns) * cell_h + pad
        sheet.paste(image.convert("RGB").resize((CANVAS, CANVAS)), (x, y))
        for i, line in enumerate(lines):
            draw.text((x, y + CANVAS + 4 + i * line_h), line, fill=(20, 20, 20), font=font)
    path = Path(path)
    with atomic_path(path) as temporary:
        sheet.save(temporary, format="PNG", optimize=True)
    logger.info("wrote %s (%d images)", path, len(images))
    return path
