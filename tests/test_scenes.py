"""Caption truth (`sgraf.data.scenes`) on hand-made scenes, and `false_for` in generated data."""

import json

import numpy as np
import pytest

from sgraf.data.benchmark import CAPTIONS_PER_IMAGE, Scene, generate_benchmark, load_scenes, scene_claims
from sgraf.data.render import SceneObject
from sgraf.data.scenes import caption_true, describe, false_for


def obj(colour, shape, size, row, col):
    return SceneObject(colour, shape, size, row, col, 64 * col + 32, 64 * row + 32)


# red square (top left), blue circle (top right), green circle (bottom middle, small)
SCENE = (obj("red", "square", "large", 0, 0), obj("blue", "circle", "large", 0, 2),
         obj("green", "circle", "small", 2, 1))
# the binding twin: colours of the square and the blue circle swapped
BOUND = (obj("blue", "square", "large", 0, 0), obj("red", "circle", "large", 0, 2),
         obj("green", "circle", "small", 2, 1))


def relation(a, rel, b):
    return {"kind": "relation", "a": a, "relation": rel, "b": b}


def test_relations_left_right_above_under_and_binding():
    red_square, blue_circle = describe("red", "square"), describe("blue", "circle")
    green_circle = describe("green", "circle")
    assert caption_true(relation(red_square, "left", blue_circle), SCENE)
    assert not caption_true(relation(red_square, "right", blue_circle), SCENE)
    assert caption_true(relation(blue_circle, "right", red_square), SCENE)
    assert caption_true(relation(red_square, "above", green_circle), SCENE)
    assert caption_true(relation(green_circle, "below", blue_circle), SCENE)
    assert not caption_true(relation(green_circle, "above", blue_circle), SCENE)
    assert not caption_true(relation(red_square, "above", blue_circle), SCENE)  # same row
    # the same words, the other binding: false for the twin
    assert not caption_true(relation(red_square, "left", blue_circle), BOUND)
    assert caption_true(relation(describe("blue", "square"), "left", describe("red", "circle")), BOUND)
    # sizes count when said, and an object is never in relation with itself
    assert not caption_true(relation(describe("green", "circle", "large"), "below", blue_circle), SCENE)
    same = relation(red_square, "left", red_square)
    assert not caption_true(same, SCENE)
    assert caption_true(same, SCENE + (obj("red", "square", "small", 1, 1),))


def test_lists_name_every_object_one_to_one():
    items = [describe("green", "circle"), describe("red", "square"), describe("blue", "circle", "large")]
    claim = {"kind": "list", "items": items, "total": None}
    assert caption_true(claim, SCENE)
    assert caption_true({**claim, "total": 3}, SCENE)
    assert not caption_true({**claim, "total": 4}, SCENE)
    assert not caption_true(claim, BOUND)                        # binding
    assert not caption_true(claim, SCENE[:2])                    # an object removed
    assert not caption_true(claim, SCENE + (obj("red", "square", "large", 1, 1),))  # one added
    two_circles = {"kind": "list", "items": [describe("green", "circle"), describe("green", "circle"),
                                             describe("red", "square")], "total": None}
    assert not caption_true(two_circles, SCENE)                 # one green circle cannot count twice


def test_counts_by_shape_and_by_colour_are_exact():
    by_shape = {"kind": "count", "by": "shape", "groups": {"circle": 2, "square": 1}}
    assert caption_true(by_shape, SCENE) and caption_true(by_shape, BOUND)
    assert not caption_true(by_shape, SCENE[:2])
    assert not caption_true(by_shape, SCENE + (obj("red", "cross", "small", 1, 1),))  # an unnamed shape
    by_colour = {"kind": "count", "by": "colour", "groups": {"red": 1, "blue": 1, "green": 1}}
    assert caption_true(by_colour, SCENE)
    assert not caption_true(by_colour, SCENE + (obj("red", "cross", "small", 1, 1),))


def test_attribute_statements_need_a_unique_shape_with_that_colour():
    claim = {"kind": "attribute", "pairs": [describe("red", "square", "large"), describe("blue", "circle")]}
    # two circles: "the circle" names none
    assert not caption_true(claim, SCENE)
    alone = SCENE[:2]
    assert caption_true(claim, alone)
    assert not caption_true(claim, BOUND[:2])
    assert not caption_true({**claim, "pairs": [describe("red", "square", "small"), describe("blue", "circle")]},
                            alone)


def test_positions_corner_side_and_middle():
    def position(o, row, col):
        return {"kind": "position", "object": o, "row": row, "col": col}

    assert caption_true(position(describe("red", "square"), 0, 0), SCENE)       # top left corner
    assert not caption_true(position(describe("red", "square"), 0, 0), BOUND)
    assert caption_true(position(describe("green", "circle", "small"), 2, None), SCENE)  # on the bottom
    assert caption_true(position(describe("blue", "circle"), None, 2), SCENE)   # on the right
    assert not caption_true(position(describe("blue", "circle"), None, 0), SCENE)
    assert not caption_true(position(describe("green", "circle"), 1, 1), SCENE)  # in the middle


def test_false_for_compares_within_a_family():
    claim = relation(describe("red", "square"), "left", describe("blue", "circle"))
    count = {"kind": "count", "by": "shape", "groups": {"circle": 2, "square": 1}}
    out = false_for([[claim, count], [claim], [count]], [SCENE, BOUND, BOUND], families=[0, 0, 1],
                    indices=[10, 11, 12])
    assert out == [[[11], []], [[11]], [[]]]


def test_generated_claims_are_true_of_their_scene_and_keep_the_captions():
    rng = np.random.default_rng(3)
    scene = Scene(SCENE, 0, "base")
    made = scene_claims(scene, rng)
    assert len(made) == CAPTIONS_PER_IMAGE and all(caption_true(claim, SCENE) for _, claim in made)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    generate_benchmark(out, n_train=8, n_dev=4, n_test=22, save_images=False)
    return out


def test_scenes_file_stores_false_for_per_caption(small_data):
    rows = load_scenes(small_data, "test")
    assert [r["index"] for r in rows] == list(range(22))
    kinds_false = {}
    for row in rows:
        assert len(row["false_for"]) == len(row["captions"]) == CAPTIONS_PER_IMAGE
        family = {r["index"] for r in rows if r["family"] == row["family"]}
        for wrong in row["false_for"]:
            assert row["index"] not in wrong and set(wrong) <= family and wrong == sorted(wrong)
        if row["variant"] != "base":
            base = next(r for r in rows if r["family"] == row["family"] and r["variant"] == "base")
            # every negative differs from its base: some caption of one is false for the other
            kinds_false[row["variant"]] = any(row["index"] in f for f in base["false_for"]) or any(
                base["index"] in f for f in row["false_for"])
    assert kinds_false and all(kinds_false.values())
    assert json.loads((small_data / "test_scenes.jsonl").read_text().splitlines()[0])["false_for"]
