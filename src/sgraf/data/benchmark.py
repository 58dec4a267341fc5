"""The embedded benchmark: rendered shape scenes whose captions need fine-grained matching.

Each image shows 2-4 objects (colour x shape x size) in the cells of a 3 x 3 layout, drawn
with Pillow at 192 x 192. Each has 5 captions from a small grammar: relations ("a red square
is to the left of a blue circle", "... above ..."), lists ("a picture of a small green
cross and a large red circle"), counts ("there are two circles and a square", "two red
shapes and a blue shape"), attribute statements ("the square is red and the circle is
blue") and positions ("a blue diamond in the top left corner"), with paraphrases and
function words.

Images come in FAMILIES of 4 kept in the same split, consecutive: a base scene and three
hard negatives, each differing from the base by one change:

- `binding`: two objects swap colours (same words, different binding: "a red square left
  of a blue circle" vs "a blue square left of a red circle");
- `attribute`: one object's colour, shape or size changes;
- `relation`: two objects swap places (left of <-> right of, same words);
- `count`: an object is copied into an empty cell or removed.

So the captions of other images share most words and bag-of-words or global-only matching
cannot tell a family apart: the model has to bind attributes to regions.

Features (`features=`):

- `"cnn"`: real EfficientNet-Lite0 grid features of the rendered images (36 x 1280,
  float32), needs `sgraf[vision]`.
- `"synthetic"`: a fast mode for tests and quick runs, NOT image features: each of the
  36 regions of a 6 x 6 grid is computed from the scene description as
  `sum_objects coverage * (E_colour + E_shape + E_size) + P_row + P_col + noise`, with fixed
  random embedding tables E, P (seed independent) and Gaussian noise from the data seed.
  Binding lives in which region holds which colour AND shape, relations in the position
  codes: learnable, but only by matching words to regions.

Files written to `out_dir`: `{train,dev,test}_ims.npy`, `{train,dev,test}_caps.txt`,
`vocab.json` (from train + dev captions, min count 4, as the authors build theirs),
`{split}_scenes.jsonl` (one JSON object per image: index, family, variant, objects with boxes,
captions, and `false_for`: per caption, the split indices of the images of its family of which
it is false, decided from the scenes by `sgraf.data.scenes`),
`{split}_boxes.npy` and `{split}_image_sizes.npy` (each region's grid cell in pixels of the
192 x 192 picture, `sgraf.data.boxes`: the 6 x 6 grid of both feature modes),
`images/{split}/{index:05d}.png` (the rendered images, for `sgraf explain`), and
`benchmark.json` (the generation settings), and `.sgraf-files.json` (the list of the files
sgraf wrote, see `sgraf.output_folder`). Same seed and settings -> byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from sgraf import text_files
from sgraf.atomic_write import atomic_path, preallocated_memmap, write_text
from sgraf.data.boxes import BOXES_SUFFIX, SIZES_SUFFIX, grid_boxes, write_boxes
from sgraf.data.layout import data_set_family, picture_name
from sgraf.data.render import CANVAS, COLOURS, HALF_SIZE, LAYOUT, SHAPES, SIZES, SceneObject, render_scene
from sgraf.data.scenes import Claim, describe
from sgraf.data.scenes import false_for as captions_false_for
from sgraf.data.vocab import Vocabulary, build_vocab
from sgraf.errors import InputError
from sgraf.output_folder import NewGeneration

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 3  # 2: each caption of {split}_scenes.jsonl carries false_for; 3: region boxes
FAMILY_SIZE = 4
CAPTIONS_PER_IMAGE = 5
SPLITS = ("train", "dev", "test")
GRID = 6  # feature regions per side (CNN at 192 px: 6 x 6)
SYNTHETIC_DIM = 128
SYNTHETIC_TABLE_SEED = 20210202  # fixed: the meaning of synthetic features never depends on the data seed
SYNTHETIC_NOISE = 0.15
VARIANTS = ("binding", "attribute", "relation", "count")
DATA_SET_FILES_WRITTEN = ("vocab.json", "benchmark.json")

NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
PLURAL = {"square": "squares", "circle": "circles", "triangle": "triangles", "diamond": "diamonds",
          "cross": "crosses"}
ROW_NAMES = ("top", "middle", "bottom")
COL_NAMES = ("left", "center", "right")
RELATIONS = {  # relation of A to B -> paraphrases
    "left": ("left of", "to the left of", "on the left of"),
    "right": ("right of", "to the right of", "on the right of"),
    "above": ("above", "over"),
    "below": ("below", "under"),
}


@dataclass(frozen=True)
class Scene:
    """An image's description: its objects, its family and how it differs from the base."""

    objects: tuple[SceneObject, ...]
    family: int
    variant: str  # "base" or one of VARIANTS

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "variant": self.variant, "objects": [o.to_dict() for o in self.objects]}


# ---------------------------------------------------------------- scenes and hard negatives

def _place(rng: np.random.Generator, colour: str, shape: str, size: str, row: int, col: int) -> SceneObject:
    cell = CANVAS // LAYOUT
    slack = cell // 2 - HALF_SIZE[size] - 2  # keep the object inside its cell
    cx = col * cell + cell // 2 + int(rng.integers(-slack, slack + 1))
    cy = row * cell + cell // 2 + int(rng.integers(-slack, slack + 1))
    return SceneObject(colour, shape, size, row, col, cx, cy)


def _pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _free_cells(objects: Sequence[SceneObject]) -> list[tuple[int, int]]:
    used = {(o.row, o.col) for o in objects}
    return [(r, c) for r in range(LAYOUT) for c in range(LAYOUT) if (r, c) not in used]


def random_scene(rng: np.random.Generator, family: int) -> Scene:
    """A base scene of 2-4 objects in distinct layout cells."""
    n = int(rng.integers(2, 5))
    cells = rng.permutation(LAYOUT * LAYOUT)[:n]
    objects = tuple(_place(rng, _pick(rng, list(COLOURS)), _pick(rng, SHAPES), _pick(rng, SIZES),
                           int(c) // LAYOUT, int(c) % LAYOUT) for c in cells)
    return Scene(objects, family, "base")


def _signature(objects: Sequence[SceneObject]) -> frozenset:
    return frozenset((o.colour, o.shape, o.size, o.row, o.col) for o in objects)


def _variant_binding(rng: np.random.Generator, objects: tuple[SceneObject, ...]) -> tuple[SceneObject, ...] | None:
    pairs = [(i, j) for i in range(len(objects)) for j in range(i + 1, len(objects))
             if objects[i].colour != objects[j].colour and objects[i].shape != objects[j].shape]
    if not pairs:
        return None
    i, j = _pick(rng, pairs)
    out = list(objects)
    out[i], out[j] = replace(objects[i], colour=objects[j].colour), replace(objects[j], colour=objects[i].colour)
    return tuple(out)


def _variant_attribute(rng: np.random.Generator, objects: tuple[SceneObject, ...]) -> tuple[SceneObject, ...]:
    i = int(rng.integers(len(objects)))
    attribute = _pick(rng, ("colour", "shape", "size"))
    current = getattr(objects[i], attribute)
    choices = {"colour": list(COLOURS), "shape": list(SHAPES), "size": list(SIZES)}[attribute]
    new = _pick(rng, [v for v in choices if v != current])
    out = list(objects)
    o = objects[i]
    if attribute == "size":  # a new size needs a new position that keeps it inside its cell
        out[i] = _place(rng, o.colour, o.shape, new, o.row, o.col)
    else:
        out[i] = replace(o, **{attribute: new})
    return tuple(out)


def _variant_relation(rng: np.random.Generator, objects: tuple[SceneObject, ...]) -> tuple[SceneObject, ...] | None:
    pairs = [(i, j) for i in range(len(objects)) for j in range(i + 1, len(objects))
             if (objects[i].colour, objects[i].shape, objects[i].size)
             != (objects[j].colour, objects[j].shape, objects[j].size)]
    if not pairs:
        return None
    i, j = _pick(rng, pairs)
    a, b = objects[i], objects[j]
    out = list(objects)
    out[i] = _place(rng, a.colour, a.shape, a.size, b.row, b.col)
    out[j] = _place(rng, b.colour, b.shape, b.size, a.row, a.col)
    return tuple(out)


def _variant_count(rng: np.random.Generator, objects: tuple[SceneObject, ...]) -> tuple[SceneObject, ...]:
    if len(objects) < 4 and (len(objects) == 2 or rng.random() < 0.5):
        source = _pick(rng, objects)
        row, col = _pick(rng, _free_cells(objects))
        return objects + (_place(rng, source.colour, source.shape, source.size, row, col),)
    drop = int(rng.integers(len(objects)))
    return objects[:drop] + objects[drop + 1:]


_VARIANT_MAKERS: dict[str, Callable[..., tuple[SceneObject, ...] | None]] = {
    "binding": _variant_binding, "attribute": _variant_attribute,
    "relation": _variant_relation, "count": _variant_count,
}


def scene_family(rng: np.random.Generator, family: int) -> list[Scene]:
    """A base scene and FAMILY_SIZE - 1 hard negatives, each one change away from it."""
    base = random_scene(rng, family)
    scenes, seen = [base], {_signature(base.objects)}
    kinds = [str(v) for v in rng.permutation(VARIANTS)]
    for attempt in range(20):
        if len(scenes) == FAMILY_SIZE:
            break
        kind = kinds[attempt % len(kinds)] if attempt < len(kinds) else _pick(rng, ("attribute", "count"))
        objects = _VARIANT_MAKERS[kind](rng, base.objects)
        if objects is None or _signature(objects) in seen:
            continue
        seen.add(_signature(objects))
        scenes.append(Scene(objects, family, kind))
    return scenes


# ---------------------------------------------------------------- captions

def _np(obj: SceneObject, det: str, size: bool) -> str:
    words = ([obj.size] if size else []) + [obj.colour, obj.shape]
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join([det] + words)


def _said(obj: SceneObject, size: bool) -> dict[str, Any]:
    """The description `_np(obj, ..., size)` says."""
    return describe(obj.colour, obj.shape, obj.size if size else None)


def _join(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _relation(a: SceneObject, b: SceneObject, rng: np.random.Generator) -> str | None:
    options = []
    if a.col != b.col:
        options.append("left" if a.col < b.col else "right")
    if a.row != b.row:
        options.append("above" if a.row < b.row else "below")
    return _pick(rng, options) if options else None


def _caption_relation(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, Claim] | None:
    i, j = (int(x) for x in rng.permutation(len(objects))[:2])
    a, b = objects[i], objects[j]
    rel = _relation(a, b, rng)
    if rel is None:
        return None
    phrase = _pick(rng, RELATIONS[rel])
    size = bool(rng.random() < 0.4)
    form = int(rng.integers(4))
    claim = {"kind": "relation", "a": _said(a, size), "relation": rel, "b": _said(b, size)}
    if form == 0:
        return f"{_np(a, 'a', size)} is {phrase} {_np(b, 'a', size)}", claim
    if form == 1:
        return f"there is {_np(a, 'a', size)} {phrase} {_np(b, 'a', size)}", claim
    if form == 2:
        return f"{_np(a, 'a', size)} {phrase} {_np(b, 'a', size)}", claim
    return f"the {_np(a, '', size).strip()} is {phrase} the {_np(b, '', size).strip()}", claim


def _caption_list(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, Claim]:
    order = [objects[int(i)] for i in rng.permutation(len(objects))]
    size = bool(rng.random() < 0.5)
    items = _join([_np(o, "a", size) for o in order])
    prefix = _pick(rng, ("a picture of", "an image with", "there is", "we see", "a scene with"))
    claim = {"kind": "list", "items": [_said(o, size) for o in order], "total": None}
    if rng.random() < 0.3:
        return f"{NUMBERS[len(objects)]} shapes : {items}", {**claim, "total": len(objects)}
    return f"{prefix} {items}", claim


def _caption_count(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, Claim]:
    by_colour = rng.random() < 0.4
    groups: dict[str, int] = {}
    for o in objects:
        key = o.colour if by_colour else o.shape
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for key, n in groups.items():
        if by_colour:
            noun = f"{key} {'shape' if n == 1 else 'shapes'}"
        else:
            noun = key if n == 1 else PLURAL[key]
        det = _pick(rng, ("a", "one")) if n == 1 else NUMBERS[n]
        parts.append(f"{'an' if det == 'a' and noun[0] in 'aeiou' else det} {noun}")
    order = [parts[int(i)] for i in rng.permutation(len(parts))]
    verb = "is" if order[0].split()[0] in ("a", "an", "one") else "are"
    claim = {"kind": "count", "by": "colour" if by_colour else "shape", "groups": groups}
    return (f"there {verb} {_join(order)}" if rng.random() < 0.6 else _join(order)), claim


def _caption_attribute(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, Claim] | None:
    shapes = [o.shape for o in objects]
    unique = [o for o in objects if shapes.count(o.shape) == 1]
    if len(unique) < 2:
        return None
    a, b = (unique[int(i)] for i in rng.permutation(len(unique))[:2])
    if rng.random() < 0.3:
        return (f"the {a.shape} is {a.size} and {a.colour} and the {b.shape} is {b.colour}",
                {"kind": "attribute", "pairs": [_said(a, True), _said(b, False)]})
    return (f"the {a.shape} is {a.colour} and the {b.shape} is {b.colour}",
            {"kind": "attribute", "pairs": [_said(a, False), _said(b, False)]})


def _caption_position(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, Claim]:
    o = objects[int(rng.integers(len(objects)))]
    row: int | None = o.row
    col: int | None = o.col
    if (o.row, o.col) == (1, 1):
        where = "in the middle"
    elif o.row == 1 or o.col == 1:
        side = ROW_NAMES[o.row] if o.col == 1 else COL_NAMES[o.col]
        where = f"on the {side}"
        # "on the top" says the row only, "on the left" the column only
        row, col = (o.row, None) if o.col == 1 else (None, o.col)
    else:
        where = f"in the {ROW_NAMES[o.row]} {COL_NAMES[o.col]} corner"
    size = bool(rng.random() < 0.5)
    claim = {"kind": "position", "object": _said(o, size), "row": row, "col": col}
    return (f"{_np(o, 'a', size)} {where}" if rng.random() < 0.5 else f"there is {_np(o, 'a', size)} {where}"), claim


# Order of preference: relations and lists carry the binding; others add counts and positions.
_CAPTION_PLAN = (_caption_relation, _caption_list, _caption_relation, _caption_count, _caption_attribute,
                 _caption_position, _caption_relation, _caption_list, _caption_position, _caption_count)


def scene_claims(scene: Scene, rng: np.random.Generator) -> list[tuple[str, Claim]]:
    """Five distinct true captions of a scene, each with its claim (`sgraf.data.scenes`)."""
    captions: list[tuple[str, Claim]] = []
    plan = list(_CAPTION_PLAN)
    attempt = 0
    while len(captions) < CAPTIONS_PER_IMAGE:
        make = plan[attempt % len(plan)] if attempt < 40 else _caption_list
        attempt += 1
        made = make(scene.objects, rng)
        # Distinct captions; a repeat only if a scene ever ran out of them (never seen in practice).
        if made is not None and (made[0] not in [c for c, _ in captions] or attempt > 400):
            captions.append(made)
    return captions


# ---------------------------------------------------------------- features

def _synthetic_tables(dim: int) -> dict[str, Any]:
    rng = np.random.default_rng(SYNTHETIC_TABLE_SEED)

    def table(names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: rng.standard_normal(dim).astype(np.float64) / np.sqrt(dim) * 2.0 for n in names}

    return {"colour": table(list(COLOURS)), "shape": table(SHAPES), "size": table(SIZES),
            "row": rng.standard_normal((GRID, dim)) / np.sqrt(dim), "col": rng.standard_normal((GRID, dim)) / np.sqrt(dim)}


def synthetic_features(scenes: Sequence[Scene], rng: np.random.Generator, dim: int = SYNTHETIC_DIM) -> np.ndarray:
    """(n, 36, dim) float32 features computed from scene descriptions (see module docstring)."""
    tables = _synthetic_tables(dim)
    cell = CANVAS / GRID
    edges = np.arange(GRID + 1) * cell
    position = (tables["row"][:, None, :] + tables["col"][None, :, :]).reshape(GRID * GRID, dim)
    out = np.empty((len(scenes), GRID * GRID, dim), dtype=np.float32)
    for n, scene in enumerate(scenes):
        regions = position.copy()
        for o in scene.objects:
            x0, y0, x1, y1 = o.box
            # fraction of each grid cell covered by the object's box: (GRID,) x (GRID,)
            cover_x = np.clip(np.minimum(edges[1:], x1) - np.maximum(edges[:-1], x0), 0, None) / cell
            cover_y = np.clip(np.minimum(edges[1:], y1) - np.maximum(edges[:-1], y0), 0, None) / cell
            coverage = np.outer(cover_y, cover_x).reshape(-1, 1)  # (36, 1), row-major like the CNN
            regions += coverage * (tables["colour"][o.colour] + tables["shape"][o.shape] + tables["size"][o.size])
        regions += SYNTHETIC_NOISE / np.sqrt(dim) * rng.standard_normal(regions.shape)
        out[n] = regions
    return out


# ---------------------------------------------------------------- writing a split

def _split_scenes(n_images: int, seed: int, split_index: int
                  ) -> tuple[list[Scene], list[list[str]], list[list[list[int]]], np.random.Generator]:
    """Scenes, captions and their `false_for` lists of a split, plus the generator of its feature noise.

    Family by family from one stream, and the noise from another, so the first m images of
    a split are the same whatever its size.
    """
    rng = np.random.default_rng([seed, split_index, 0])
    scenes: list[Scene] = []
    claims: list[list[tuple[str, Claim]]] = []
    family = 0
    while len(scenes) < n_images:
        for scene in scene_family(rng, family):
            scenes.append(scene)
            claims.append(scene_claims(scene, rng))
        family += 1
    scenes, claims = scenes[:n_images], claims[:n_images]
    # truth within the split: a family cut short by the split's end is compared among what is kept
    false_for = captions_false_for([[claim for _, claim in c] for c in claims], [s.objects for s in scenes],
                                   [s.family for s in scenes])
    return (scenes, [[caption for caption, _ in c] for c in claims], false_for,
            np.random.default_rng([seed, split_index, 1]))


def _write_split(generation: NewGeneration, split: str, split_index: int, n_images: int, seed: int,
                 features: str, backbone: Any, save_images: bool, synthetic_dim: int, progress: bool) -> list[str]:
    started = time.perf_counter()
    scenes, captions, false_for, rng = _split_scenes(n_images, seed, split_index)
    flat = [c for caps in captions for c in caps]
    write_text(generation.path(f"{split}_caps.txt"), "".join(c + "\n" for c in flat))
    write_text(generation.path(f"{split}_scenes.jsonl"),
               "".join(json.dumps({"index": i, **s.to_dict(), "captions": captions[i],
                                   "false_for": false_for[i]}, sort_keys=True) + "\n"
                       for i, s in enumerate(scenes)))

    def rendered() -> Iterator[Any]:
        for i, scene in enumerate(scenes):
            image = render_scene(scene.objects)
            if save_images:
                image.save(generation.path(_image_name(split, i)), format="PNG", compress_level=6)
            yield image

    ims_path = generation.path(f"{split}_ims.npy")
    if features == "cnn":
        from sgraf.data.features import extract_to_npy

        extract_to_npy(rendered(), len(scenes), backbone, ims_path, progress=progress)
    else:
        if save_images:
            for _ in rendered():
                pass
        with atomic_path(ims_path) as temporary:
            out = preallocated_memmap(temporary, np.float32, (len(scenes), GRID * GRID, synthetic_dim))
            chunk = 512
            for start in range(0, len(scenes), chunk):
                out[start: start + chunk] = synthetic_features(scenes[start: start + chunk], rng, synthetic_dim)
            out.flush()
            del out
    # both feature modes lay their 36 regions out as the 6 x 6 grid of the picture, row-major
    write_boxes(generation, split, *grid_boxes(len(scenes), GRID, GRID, CANVAS, CANVAS))
    logger.info("%s: %d images, %d captions in %.1fs", split, len(scenes), len(flat), time.perf_counter() - started)
    return flat


def generate_benchmark(out_dir: str | os.PathLike[str], seed: int = 0, features: str = "synthetic",
                       n_train: int = 3000, n_dev: int = 500, n_test: int = 500, save_images: bool = True,
                       synthetic_dim: int = SYNTHETIC_DIM, min_count: int = 4, backbone: Any = None,
                       progress: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Write the embedded benchmark in the precomp layout (see the module docstring).

    The files are written into a staging folder inside `out_dir` and moved into place at the end
    (`sgraf.output_folder.NewGeneration`): an interrupted run leaves the folder as it was, and a
    folder that already holds data (files of the precomp layout) is refused unless `overwrite`,
    which replaces the earlier generation as a whole (pictures included).

    Args:
        out_dir: directory to write (created).
        seed: data seed; the same seed and settings give byte-identical files.
        features: "cnn" (EfficientNet-Lite0, needs `sgraf[vision]`) or "synthetic".
        n_train: training images (5 captions each).
        n_dev: validation images.
        n_test: test images.
        save_images: also write the rendered PNGs under `images/{split}/`.
        synthetic_dim: feature size of the synthetic mode.
        min_count: vocabulary threshold (the authors' is 4).
        backbone: a `GridBackbone` for the cnn mode (default: EfficientNet-Lite0 at 192 px).
        progress: show progress bars.
        overwrite: replace the data a folder already holds (only files sgraf wrote are deleted).

    Returns:
        The metadata written to `benchmark.json`.

    Raises:
        InputError: bad settings, `out_dir` is a file, or it holds other data (see above).
    """
    if features not in ("cnn", "synthetic"):
        raise InputError(f"features={features!r}: expected 'cnn' or 'synthetic'")
    for name, n in (("n_train", n_train), ("n_dev", n_dev), ("n_test", n_test)):
        if n < 1:
            raise InputError(f"{name}={n}: expected at least 1 image")
    if synthetic_dim < 1:
        raise InputError(f"synthetic_dim={synthetic_dim}: expected a positive size")
    out_dir = Path(out_dir)
    sizes = {"train": n_train, "dev": n_dev, "test": n_test}
    outputs = _outputs(sizes, save_images)
    with NewGeneration(out_dir, outputs, data_set_family, "generate", overwrite=overwrite, exclusive=True,
                       earlier=_generated_before(out_dir)) as generation:
        if features == "cnn" and backbone is None:
            from sgraf.data.features import efficientnet_lite0

            backbone = efficientnet_lite0(image_size=CANVAS)
        started = time.perf_counter()
        captions: dict[str, list[str]] = {}
        for index, split in enumerate(SPLITS):
            captions[split] = _write_split(generation, split, index, sizes[split], seed, features, backbone,
                                           save_images, synthetic_dim, progress)
        vocab: Vocabulary = build_vocab(captions["train"] + captions["dev"], min_count=min_count)
        vocab.save(generation.path("vocab.json"))
        meta = {
            "name": "sgraf-shapes",
            "generator_version": GENERATOR_VERSION,
            "seed": seed,
            "features": features,
            "backbone": getattr(backbone, "name", None) if features == "cnn" else None,
            "feature_shape": [GRID * GRID, int(backbone.feature_dim) if features == "cnn" else synthetic_dim],
            "images": sizes,
            "captions_per_image": CAPTIONS_PER_IMAGE,
            "family_size": FAMILY_SIZE,
            "vocab_size": len(vocab),
            "images_dir": "images" if save_images else None,
            "fingerprint": benchmark_fingerprint(Path(generation.path("vocab.json")).parent),
        }
        write_text(generation.path("benchmark.json"), json.dumps(meta, indent=2, sort_keys=True) + "\n")
    logger.info("benchmark written to %s in %.1fs (%s features)", out_dir, time.perf_counter() - started, features)
    return meta


def benchmark_fingerprint(folder: str | os.PathLike[str]) -> dict[str, str]:
    """What a benchmark's files are, to tell later whether they changed (`sgraf demo` reuses one
    only if not): `sgraf.data.precomp.data_fingerprint` of the three splits, and the sha256 of
    their scenes, boxes and picture sizes and of the vocabulary."""
    from sgraf.data.precomp import EXTRA_FILES, data_fingerprint

    folder = Path(folder)
    fingerprint = data_fingerprint(folder, SPLITS, extras=EXTRA_FILES)   # a file gone is absent: it differs
    fingerprint["vocab.json"] = hashlib.sha256((folder / "vocab.json").read_bytes()).hexdigest()
    return fingerprint


def load_scenes(data_dir: str | os.PathLike[str], split: str) -> list[dict[str, Any]]:
    """The scene descriptions of a generated split (`{split}_scenes.jsonl`), checked line by line.

    Raises:
        InputError: a line that is not JSON, not an object, or whose `index`, `family`,
            `variant`, `captions` or `false_for` is missing or not what the generator writes,
            naming the file, the line and the field.
    """
    path = Path(data_dir) / f"{split}_scenes.jsonl"
    rows = []
    for number, line in text_files.lines(path):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        except UnicodeDecodeError:
            raise InputError(f"{path}:{number}: bytes are not valid UTF-8; expected a JSON object per "
                             "line") from None
    for number, row in enumerate(rows, start=1):
        _check_scene(row, f"{path}:{number}", number - 1, len(rows))
    return rows


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_scene(row: Any, where: str, index: int, n_scenes: int) -> None:
    """InputError naming `where` (file:line) and the field when `row` is not a scene as written
    by the generator. `false_for` may be missing (data of an earlier sgraf; `sgraf diagnose`
    names that case itself)."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object (one scene), got {json.dumps(row)[:40]}")

    def refuse(field: str, expected: str) -> InputError:
        shown = json.dumps(row[field])[:40] if field in row else "missing"
        return InputError(f"{where}: field {field!r} is {shown}; expected {expected}")

    if not _is_int(row.get("index")) or row["index"] != index:
        raise refuse("index", f"{index} (the scene's line number - 1)")
    if not _is_int(row.get("family")) or row["family"] < 0:
        raise refuse("family", "an integer >= 0")
    if row.get("variant") not in ("base", *VARIANTS):
        raise refuse("variant", "one of " + ", ".join(("base", *VARIANTS)))
    captions = row.get("captions")
    if not isinstance(captions, list) or not captions or not all(isinstance(c, str) and c.strip() for c in captions):
        raise refuse("captions", "a list of caption texts")
    if "false_for" not in row:
        return
    false_for = row["false_for"]
    if not isinstance(false_for, list) or len(false_for) != len(captions):
        raise refuse("false_for", f"a list of {len(captions)} lists (one per caption) of scene indices")
    for wrong in false_for:
        if not isinstance(wrong, list) or not all(_is_int(i) and 0 <= i < n_scenes for i in wrong):
            past = isinstance(wrong, list) and any(_is_int(i) and i >= n_scenes for i in wrong)
            raise refuse("false_for", f"a list of {len(captions)} lists of scene indices in 0..{n_scenes - 1}"
                         + (f" (an index past the file's {n_scenes} scenes: is the file cut short?)" if past else ""))


def _generated_before(out_dir: Path) -> list[str]:
    """The files an earlier `generate_benchmark` wrote into `out_dir`, as its benchmark.json tells
    (folders generated before sgraf recorded the files it writes)."""
    try:
        meta = json.loads((out_dir / "benchmark.json").read_text(encoding="utf-8"))
        sizes = {split: int(meta["images"][split]) for split in SPLITS}
        with_images = bool(meta.get("images_dir"))
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if meta.get("name") != "sgraf-shapes":
        return []
    return _outputs(sizes, with_images, boxes=int(meta.get("generator_version", 0)) >= 3)


def output_names(n_train: int, n_dev: int, n_test: int, save_images: bool = True) -> list[str]:
    """The relative paths `generate_benchmark` writes for these split sizes."""
    return _outputs({"train": n_train, "dev": n_dev, "test": n_test}, save_images)


def _outputs(sizes: dict[str, int], save_images: bool, boxes: bool = True) -> list[str]:
    """The files `generate_benchmark` writes for these split sizes (relative paths); `boxes`
    False: as generators before version 3 wrote them."""
    suffixes = ("_ims.npy", "_caps.txt", "_scenes.jsonl") + ((BOXES_SUFFIX, SIZES_SUFFIX) if boxes else ())
    return [*DATA_SET_FILES_WRITTEN,
            *(f"{split}{suffix}" for split in SPLITS for suffix in suffixes),
            *(_image_name(split, i) for split in SPLITS if save_images for i in range(sizes[split]))]


def _image_name(split: str, index: int) -> str:
    return picture_name(split, index, ".png")


def image_path(data_dir: str | os.PathLike[str], split: str, index: int) -> Path:
    """Where the rendered image `index` of `split` is stored."""
    return Path(data_dir) / _image_name(split, index)


def write_preview(data_dir: str | os.PathLike[str], path: str | os.PathLike[str], split: str = "test",
                  families: int = 3) -> Path:
    """Draw the first `families` families of `split` as a PNG grid, one family per row.

    Each row shows the base scene and its hard negatives with their first captions.
    """
    from sgraf.data.render import preview_grid

    rows = [r for r in load_scenes(data_dir, split) if r["family"] < families]
    if not rows:
        raise InputError(f"{data_dir}: split {split!r} has no scenes to preview")
    images = [render_scene([SceneObject(**{k: o[k] for k in ("colour", "shape", "size", "row", "col", "cx", "cy")})
                            for o in r["objects"]]) for r in rows]
    captions = [[f"[{r['variant']}] {r['captions'][0]}"] + r["captions"][1:] for r in rows]
    return preview_grid(images, captions, path, columns=FAMILY_SIZE, captions_per_image=3)
