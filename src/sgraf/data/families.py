"""Families of hard negatives and which captions are true of which picture, for training.

The embedded benchmark (`sgraf.data.benchmark`) writes its pictures in families: a base scene
and its binding, attribute, relation and count twins, consecutive in the split, and records per
caption the family pictures it is false of (`false_for` in `{split}_scenes.jsonl`). A batch drawn
at random holds a caption's twin only rarely (with 32 captions of 1,500 pictures, about 2 % of
the time), so the ranking loss almost never asks the model to tell a caption's picture from the
picture where two objects changed places. Training with `batches=families` draws whole families
instead (`sgraf.training.families`), and needs to know that "a picture of a red square and a
blue circle" is true of the relation twin as well: such a pair is not a negative.

`read_families` returns both: the families' picture indices, and for each caption the pictures
it is true of (its own and the family pictures not in its `false_for`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgraf.errors import InputError


@dataclass(frozen=True)
class Families:
    """The families of a split and the pictures each caption is true of.

    Attributes:
        groups: one int64 array of picture indices per family, in split order.
        true_of: (n_captions, width) int64: per caption, the indices of the pictures of its family
            it is true of (its own picture first), padded with -1; width = the largest family.
        captions_per_image: captions per picture (caption k belongs to picture k // it).
    """

    groups: list[np.ndarray]
    true_of: np.ndarray
    captions_per_image: int

    @property
    def largest(self) -> int:
        return max((len(g) for g in self.groups), default=0)


def read_families(data_dir: str | os.PathLike[str], split: str, n_images: int,
                  captions_per_image: int) -> Families:
    """The families of `split`'s first `n_images` pictures, from `{split}_scenes.jsonl`.

    Args:
        data_dir: the data folder.
        split: e.g. "train".
        n_images: pictures of the split in use (the features file's first ones).
        captions_per_image: captions per picture in `{split}_caps.txt`.

    Raises:
        InputError: in one line, when the scenes file is missing (data not written by
            `sgraf generate`), a line is malformed (`sgraf.data.benchmark.load_scenes`), the
            scenes carry no `false_for`, or they do not describe the split's pictures and
            captions.
    """
    from sgraf.data.benchmark import load_scenes

    path = Path(data_dir) / f"{split}_scenes.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: missing file; batches=families draws whole families of hard negatives and "
                         f"needs the scenes that sgraf generate writes (use batches=random for other data)")
    scenes = load_scenes(data_dir, split)
    if len(scenes) < n_images:
        raise InputError(f"{path}: {len(scenes)} scenes for {n_images} pictures in {split}_ims.npy; expected one "
                         "scene per picture")
    scenes = scenes[:n_images]
    by_family: dict[int, list[int]] = {}
    for index, row in enumerate(scenes):
        if "false_for" not in row:
            raise InputError(f"{path}:{index + 1}: field 'false_for' is missing (written by an earlier sgraf); "
                             "regenerate the data with sgraf generate")
        if len(row["captions"]) != captions_per_image:
            raise InputError(f"{path}:{index + 1}: field 'captions' holds {len(row['captions'])} captions; "
                             f"expected {captions_per_image}, as {split}_caps.txt has per picture")
        members = by_family.setdefault(row["family"], [])
        if members and members[-1] != index - 1:
            raise InputError(f"{path}:{index + 1}: family {row['family']} is not consecutive (its pictures "
                             f"{members[-1]} and {index}); expected each family's pictures one after another")
        members.append(index)
    groups = [np.asarray(members, dtype=np.int64) for members in by_family.values()]
    width = max(len(g) for g in groups)
    true_of = np.full((n_images * captions_per_image, width), -1, dtype=np.int64)
    for members in groups:
        for image in members:
            for j, wrong in enumerate(scenes[image]["false_for"]):
                truth = [image] + [int(m) for m in members if m != image and int(m) not in wrong]
                true_of[image * captions_per_image + j, : len(truth)] = truth
    return Families(groups=groups, true_of=true_of, captions_per_image=captions_per_image)
