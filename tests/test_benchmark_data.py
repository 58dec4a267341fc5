"""The embedded benchmark generator: layout, determinism, true captions, hard negatives."""

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sgraf.cli import main
from sgraf.data.benchmark import FAMILY_SIZE, PLURAL, generate_benchmark, load_scenes
from sgraf.data.precomp import PrecompDataset, PrecompSplit
from sgraf.data.render import COLOURS, SHAPES
from sgraf.data.vocab import load_vocab, tokenize
from sgraf.errors import InputError

SIZES = dict(n_train=48, n_dev=16, n_test=24)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "data"
    meta = generate_benchmark(out, seed=7, features="synthetic", **SIZES)
    return out, meta


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_and_shapes(bench):
    out, meta = bench
    for split, n in (("train", 48), ("dev", 16), ("test", 24)):
        data = PrecompSplit(out, split, full_scan=True)
        assert (data.n_images, data.n_captions, data.caps_per_image) == (n, 5 * n, 5)
        assert data.images.shape == (n, 36, 128) and data.images.dtype == np.float32
        assert len(list((out / "images" / split).glob("*.png"))) == n
        assert len(load_scenes(out, split)) == n
    vocab = load_vocab(out / "vocab.json")
    assert meta["vocab_size"] == len(vocab) and meta["feature_shape"] == [36, 128]
    dataset = PrecompDataset(PrecompSplit(out, "test"), vocab)
    ids = [i for k in range(len(dataset)) for i in dataset[k][1]]
    assert ids.count(vocab.unk_id) / len(ids) < 0.01


def test_same_seed_gives_byte_identical_files(bench, tmp_path):
    out, _ = bench
    again = tmp_path / "again"
    generate_benchmark(again, seed=7, features="synthetic", **SIZES)
    assert _files(again) == _files(out)
    # a larger split starts with the same images: sizes can change without changing the data
    bigger = tmp_path / "bigger"
    generate_benchmark(bigger, seed=7, features="synthetic", n_train=48, n_dev=16, n_test=40)
    test_caps = (out / "test_caps.txt").read_bytes()
    assert (bigger / "test_caps.txt").read_bytes()[: len(test_caps)] == test_caps
    np.testing.assert_array_equal(np.load(bigger / "test_ims.npy")[:24], np.load(out / "test_ims.npy"))
    other = tmp_path / "other"
    generate_benchmark(other, seed=8, features="synthetic", **SIZES)
    assert (other / "test_caps.txt").read_bytes() != (out / "test_caps.txt").read_bytes()
    assert not np.array_equal(np.load(other / "test_ims.npy"), np.load(out / "test_ims.npy"))


_NP = r"(?:a|an|the) (?:(small|large) )?(\w+) (\w+)"
_REL = re.compile(rf"^(?:there is )?{_NP}(?: is)? (left of|to the left of|on the left of|right of|to the right of|"
                  rf"on the right of|above|over|below|under) {_NP}$")


def _matches(obj, size, colour, shape):
    return obj["colour"] == colour and obj["shape"] == shape and (size is None or obj["size"] == size)


def test_captions_are_true_of_their_scenes(bench):
    out, _ = bench
    checked = 0
    for scene in load_scenes(out, "train") + load_scenes(out, "test"):
        objects = scene["objects"]
        assert len(set(scene["captions"])) == 5
        for caption in scene["captions"]:
            words = set(tokenize(caption))
            # every colour and shape word names an object of the scene
            assert words & set(COLOURS) <= {o["colour"] for o in objects}, caption
            shapes = {o["shape"] for o in objects}
            plural = {p: s for s, p in PLURAL.items()}
            assert {plural.get(w, w) for w in words if w in SHAPES or w in plural} <= shapes, caption
            m = _REL.match(caption)
            if not m:
                continue
            s1, c1, h1, rel, s2, c2, h2 = m.groups()
            dx = {"left": -1, "right": 1}.get(rel.split()[-2] if "of" in rel else "", 0)
            dy = {"above": -1, "over": -1, "below": 1, "under": 1}.get(rel, 0)
            assert any(_matches(a, s1, c1, h1) and _matches(b, s2, c2, h2) and a is not b
                       and (dx == 0 or np.sign(a["col"] - b["col"]) == dx)
                       and (dy == 0 or np.sign(a["row"] - b["row"]) == dy)
                       for a in objects for b in objects), caption
            checked += 1
    assert checked > 50  # relations are the most frequent caption kind


def test_families_are_hard_negatives(bench):
    out, _ = bench
    scenes = load_scenes(out, "train")
    families = {}
    for s in scenes:
        families.setdefault(s["family"], []).append(s)
    same_words = 0
    for members in families.values():
        assert len(members) <= FAMILY_SIZE and members[0]["variant"] == "base"
        base = members[0]["objects"]
        for variant in members[1:]:
            objects = variant["objects"]
            attrs = lambda objs, *keys: sorted(tuple(o[k] for k in keys) for o in objs)  # noqa: E731
            if variant["variant"] == "binding":  # same colours, same shapes, same places, other pairs
                assert attrs(objects, "colour") == attrs(base, "colour")
                assert attrs(objects, "shape", "row", "col") == attrs(base, "shape", "row", "col")
                assert attrs(objects, "colour", "shape") != attrs(base, "colour", "shape")
            elif variant["variant"] == "relation":  # same objects, two of them swap places
                assert attrs(objects, "colour", "shape", "size") == attrs(base, "colour", "shape", "size")
                assert attrs(objects, "colour", "shape", "size", "row", "col") != \
                    attrs(base, "colour", "shape", "size", "row", "col")
            elif variant["variant"] == "count":
                assert abs(len(objects) - len(base)) == 1
            else:
                assert variant["variant"] == "attribute" and len(objects) == len(base)
                changed = sum(a != b for a, b in zip(attrs(objects, "colour", "shape", "size"),
                                                     attrs(base, "colour", "shape", "size")))
                assert changed >= 1
        # bag-of-words cannot separate them: captions of different images with the same words
        bags = {}
        for i, s in enumerate(members):
            for c in s["captions"]:
                bags.setdefault(tuple(sorted(Counter(tokenize(c)).elements())), set()).add(i)
        same_words += any(len(images) > 1 for images in bags.values())
    assert same_words >= len(families) // 4


def test_synthetic_features_need_local_matching(bench):
    """A binding swap leaves the mean-pooled (global) features almost unchanged, not the regions."""
    out, _ = bench
    images = np.load(out / "train_ims.npy")
    pairs = [(s["family"], s["index"]) for s in load_scenes(out, "train") if s["variant"] == "binding"]
    first = {s["family"]: s["index"] for s in load_scenes(out, "train") if s["variant"] == "base"}
    assert pairs
    for family, index in pairs:
        base, swap = images[first[family]], images[index]
        global_gap = np.linalg.norm(base.mean(0) - swap.mean(0))
        region_gap = np.linalg.norm(base - swap, axis=1).max()
        assert global_gap < 0.1 * region_gap


def test_bad_arguments():
    with pytest.raises(InputError, match="features='resnet'"):
        generate_benchmark("/nonexistent", features="resnet")
    with pytest.raises(InputError, match="n_test=0"):
        generate_benchmark("/nonexistent", n_test=0)


def test_cli_generate_with_preview(tmp_path, capsys):
    out = tmp_path / "bench"
    png = tmp_path / "preview.png"
    code = main(["generate", "--out", str(out), "--features", "synthetic", "--n-train", "8", "--n-dev", "4",
                 "--n-test", "12", "--seed", "1", "--preview", str(png)])
    assert code == 0
    assert "train 8, dev 4, test 12 images" in capsys.readouterr().out
    for name in ("train_ims.npy", "dev_ims.npy", "test_ims.npy", "train_caps.txt", "dev_caps.txt",
                 "test_caps.txt", "vocab.json", "benchmark.json"):
        assert (out / name).is_file(), name
    from PIL import Image

    with Image.open(png) as image:
        assert image.width == 4 * 208 and image.height > 3 * 192  # 3 families x 4 images


def test_boxes_are_the_grid_cells_where_the_objects_lie(bench):
    out, _ = bench
    split = PrecompSplit(out, "test")
    pixels = np.load(out / "test_boxes.npy")
    assert pixels.shape == (24, 36, 4) and np.load(out / "test_image_sizes.npy").tolist() == [[192, 192]] * 24
    assert pixels[0, 7].tolist() == [32, 32, 64, 64]                 # row 1, column 1 of the 6 x 6 grid
    np.testing.assert_allclose(split.boxes, pixels / 192, rtol=1e-6)
    # the synthetic region that holds most of an object is the cell around the object's centre
    from sgraf.data.benchmark import _synthetic_tables
    tables = _synthetic_tables(128)
    for index, scene in enumerate(load_scenes(out, "test")[:4]):
        for obj in scene["objects"]:
            code = tables["colour"][obj["colour"]] + tables["shape"][obj["shape"]] + tables["size"][obj["size"]]
            region = int(np.argmax(split.images[index] @ code))
            x1, y1, x2, y2 = pixels[index, region]
            box = obj["box"]
            assert x1 < box[2] and box[0] < x2 and y1 < box[3] and box[1] < y2, (index, obj, region)


def test_a_preview_among_anothers_files_is_refused_and_a_failed_one_says_the_data_is_written(tmp_path, capsys,
                                                                                            monkeypatch):
    """--preview had replaced another data set's picture or a run's curves (exit 0), and a preview
    that could not be written had left the data set in place with only the preview's error."""
    args = ["--features", "synthetic", "--n-train", "8", "--n-dev", "4", "--n-test", "12", "--seed", "1"]
    assert main(["generate", "--out", str(tmp_path / "first"), *args]) == 0
    picture = tmp_path / "first" / "images" / "test" / "00000.png"
    before = picture.read_bytes()
    capsys.readouterr()
    assert main(["generate", "--out", str(tmp_path / "second"), *args, "--preview", str(picture)]) == 2
    assert "in the pictures of the precomp data set" in capsys.readouterr().err
    assert picture.read_bytes() == before and not (tmp_path / "second").exists()
    (tmp_path / "a-folder.png").mkdir()
    assert main(["generate", "--out", str(tmp_path / "third"), *args, "--preview", str(tmp_path / "a-folder.png")]) == 2
    assert "is a folder; give the PNG file to write" in capsys.readouterr().err
    from sgraf.data import benchmark

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(benchmark, "write_preview", full)
    assert main(["generate", "--out", str(tmp_path / "fourth"), *args, "--preview", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"sgraf generate: error: the data set in {tmp_path / 'fourth'} is written, but not --preview "
                   f"{tmp_path / 'p.png'}: No space left on device (write it again with sgraf generate --overwrite, "
                   "or without --preview)"), err
    assert (tmp_path / "fourth" / "test_ims.npy").is_file()
