"""Caption truth: what each benchmark caption claims, and whether a scene makes it true.

The generator (`sgraf.data.benchmark`) keeps, beside every caption it writes, the claim the
caption makes as a small plain dict; `caption_true(claim, objects)` decides it on any scene
from the objects alone (colours, shapes, sizes, layout cells), never from the caption's words.
An object description is ``{"colour", "shape", "size"}`` where ``size`` is None when the
caption does not say it. The claims, one per caption kind:

- ``relation`` ``{"a", "relation", "b"}``: two distinct objects match `a` and `b`, and `a` is
  left of / right of (a smaller / larger layout column) or above / below (a smaller / larger
  row) `b`. Paraphrases ("to the left of", "over", "under", "the ... is ...") share the claim.
- ``list`` ``{"items", "total"}``: the list names every object of the picture: the objects
  can be paired one to one with the items (so the counts agree); `total` ("three shapes :")
  is then implied.
- ``count`` ``{"by": "shape" | "colour", "groups": {key: n}}``: exactly `n` objects of each
  named shape (or colour), and no others (the count names every group of the picture).
- ``attribute`` ``{"pairs": [(description), ...]}``: "the square is red and the circle is
  blue": each named shape is held by exactly one object ("the"), which has the stated colour
  (and size).
- ``position`` ``{"object", "row", "col"}``: an object matching the description lies in the
  named place: "in the middle" is the centre cell, "in the top left corner" that corner cell,
  "on the top" / "on the bottom" the top / bottom row and "on the left" / "on the right" the
  left / right column (`row` or `col` is None when the phrase leaves it open).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

Claim = dict[str, Any]


def describe(colour: str, shape: str, size: str | None = None) -> dict[str, Any]:
    """An object description as claims hold it (`size` None: not said)."""
    return {"colour": colour, "shape": shape, "size": size}


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def matches(description: Mapping[str, Any], obj: Any) -> bool:
    """Whether an object (a `SceneObject` or its dict) fits a description."""
    return all(value is None or _get(obj, key) == value for key, value in description.items())


def _one_to_one(items: Sequence[Mapping[str, Any]], objects: Sequence[Any]) -> bool:
    """Whether items and objects pair up one to one, each object fitting its item (bipartite
    matching by augmenting paths; scenes hold at most 4 objects)."""
    if len(items) != len(objects):
        return False
    owner: dict[int, int] = {}  # object -> item

    def assign(item: int, seen: set[int]) -> bool:
        for o, obj in enumerate(objects):
            if o not in seen and matches(items[item], obj):
                seen.add(o)
                if o not in owner or assign(owner[o], seen):
                    owner[o] = item
                    return True
        return False

    return all(assign(i, set()) for i in range(len(items)))


def _holds_relation(a: Any, b: Any, relation: str) -> bool:
    if relation == "left":
        return _get(a, "col") < _get(b, "col")
    if relation == "right":
        return _get(a, "col") > _get(b, "col")
    if relation == "above":
        return _get(a, "row") < _get(b, "row")
    if relation == "below":
        return _get(a, "row") > _get(b, "row")
    raise ValueError(f"unknown relation {relation!r}")


def caption_true(claim: Mapping[str, Any], objects: Sequence[Any]) -> bool:
    """Whether a caption's claim holds in a scene (`objects`: `SceneObject`s or their dicts)."""
    kind = claim["kind"]
    if kind == "relation":
        return any(i != j and matches(claim["a"], a) and matches(claim["b"], b)
                   and _holds_relation(a, b, claim["relation"])
                   for i, a in enumerate(objects) for j, b in enumerate(objects))
    if kind == "list":
        total = claim.get("total")
        return (total is None or total == len(objects)) and _one_to_one(claim["items"], objects)
    if kind == "count":
        counts: dict[str, int] = {}
        for o in objects:
            counts[_get(o, claim["by"])] = counts.get(_get(o, claim["by"]), 0) + 1
        return counts == dict(claim["groups"])
    if kind == "attribute":
        for description in claim["pairs"]:
            same_shape = [o for o in objects if _get(o, "shape") == description["shape"]]
            if len(same_shape) != 1 or not matches(description, same_shape[0]):
                return False
        return True
    if kind == "position":
        return any(matches(claim["object"], o)
                   and (claim["row"] is None or _get(o, "row") == claim["row"])
                   and (claim["col"] is None or _get(o, "col") == claim["col"]) for o in objects)
    raise ValueError(f"unknown claim kind {kind!r}")


def false_for(claims: Sequence[Sequence[Mapping[str, Any]]], scenes: Sequence[Sequence[Any]],
              families: Sequence[int], indices: Sequence[int] | None = None) -> list[list[list[int]]]:
    """For every image's captions, the images of its family (their `indices`) of which each is false.

    Args:
        claims: per image, the claims of its captions in caption order.
        scenes: per image, its objects.
        families: per image, its family number (members of a family are compared).
        indices: per image, its index in the split (default: 0, 1, ...).

    Returns:
        Per image, one sorted list per caption of the family members' indices it is false for.
    """
    indices = list(range(len(scenes))) if indices is None else list(indices)
    members: dict[int, list[int]] = {}
    for position, family in enumerate(families):
        members.setdefault(family, []).append(position)
    return [[sorted(indices[m] for m in members[families[position]] if not caption_true(claim, scenes[m]))
             for claim in image_claims]
            for position, image_claims in enumerate(claims)]
