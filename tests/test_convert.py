"""Bottom-up-attention TSV -> precomp conversion."""

import base64

import numpy as np
import pytest

from sgraf.cli import main
from sgraf.data.convert import convert_tsv
from sgraf.data.precomp import PrecompSplit
from sgraf.errors import InputError


def b64(array):
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.float32).tobytes()).decode("ascii")


def make_rows(n=3, k=4, d=6, seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.random((n, k, d)).astype(np.float32)
    corners = rng.random((n, k, 2, 2)) * 400          # two corners inside 640 x 480 .. 642 x 478
    boxes = np.concatenate([corners.min(axis=2), corners.max(axis=2)], axis=2).astype(np.float32)
    rows = [f"{1000 + i}\t{640 + i}\t{480 - i}\t{k}\t{b64(boxes[i])}\t{b64(feats[i])}" for i in range(n)]
    return rows, feats, boxes


def write(path, rows):
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def test_convert_streams_rows_into_precomp(tmp_path):
    rows, feats, boxes = make_rows()
    tsv = write(tmp_path / "feats.tsv", rows)
    caps = tmp_path / "caps.tsv"
    # captions listed out of image order: they are regrouped in TSV row order
    caps.write_text("1001\tsecond image one\n1000\tfirst image one\n1002\tthird one\n1000\tfirst two\n"
                    "1001\tsecond two\n1002\tthird two\n", encoding="utf-8")
    info = convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)
    assert info == {"images": 3, "regions": 4, "feature_dim": 6, "captions": 6}
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "train_ims.npy"), feats)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "train_boxes.npy"), boxes)
    sizes = np.load(tmp_path / "out" / "train_image_sizes.npy")
    assert sizes.dtype == np.float32 and sizes.tolist() == [[640, 480], [641, 479], [642, 478]]
    assert (tmp_path / "out" / "train_image_ids.txt").read_text().splitlines() == \
        ["1000\t640\t480", "1001\t641\t479", "1002\t642\t478"]
    split = PrecompSplit(tmp_path / "out", "train")
    assert split.captions == ["first image one", "first two", "second image one", "second two", "third one",
                              "third two"]
    assert split.caps_per_image == 2


def test_cli_convert_tsv(tmp_path, capsys):
    rows, feats, _ = make_rows(n=2)
    tsv = write(tmp_path / "feats.tsv", rows)
    assert main(["convert-tsv", "--tsv", str(tsv), "--out", str(tmp_path / "o"), "--split", "test",
                 "--no-progress"]) == 0
    assert "2 images x 4 regions x 6" in capsys.readouterr().out
    np.testing.assert_array_equal(np.load(tmp_path / "o" / "test_ims.npy"), feats)


@pytest.mark.parametrize("mutate,message", [
    (lambda r: r.rsplit("\t", 1)[0], r"feats\.tsv:2: 5 tab-separated fields; expected 6 \(image_id, image_w"),
    (lambda r: r[:-8] + "!!!!" + r[-4:], r"feats\.tsv:2: field 'features' is not valid base64"),
    (lambda r: "\t".join(r.split("\t")[:3] + ["four"] + r.split("\t")[4:]), r"feats\.tsv:2: field 'num_boxes' is 'four'"),
    (lambda r: "\t".join(r.split("\t")[:3] + ["5"] + r.split("\t")[4:]), r"feats\.tsv:2: field 'boxes' decodes to 64 bytes"),
    (lambda r: "\t".join(r.split("\t")[:4] + [b64(np.zeros((5, 4)))] + r.split("\t")[5:]),   # 5 boxes for 4
     r"feats\.tsv:2: field 'boxes' decodes to 80 bytes \(20 float32\); expected num_boxes=4 x 4 float32 \(64 bytes\)"),
    (lambda r: "\t".join(r.split("\t")[:5] + [b64(np.zeros((4, 7)))]),
     r"feats\.tsv:2: num_boxes x feature size is \(4, 7\); expected \(4, 6\)"),
    (lambda r: "\t".join(r.split("\t")[:5] + [b64(np.full((4, 6), np.nan))]),
     r"feats\.tsv:2: field 'features' holds NaN or inf \(region 0, dimension 0\); expected finite base64 float32"),
    (lambda r: "\t".join(r.split("\t")[:5] + [b64(np.where(np.arange(24).reshape(4, 6) == 15, np.inf, 0.0))]),
     r"holds NaN or inf \(region 2, dimension 3\)"),
    (lambda r: "\t".join(r.split("\t")[:1] + ["0"] + r.split("\t")[2:]),
     r"feats\.tsv:2: field 'image_w' is 0; expected the picture's size in pixels"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, mutate, message):
    rows, _, _ = make_rows()
    rows[1] = mutate(rows[1])
    tsv = write(tmp_path / "feats.tsv", rows)
    with pytest.raises(InputError, match=message):
        convert_tsv(tsv, tmp_path / "out", "train", progress=False)
    assert not (tmp_path / "out" / "train_ims.npy").exists()  # nothing half-written left behind
    assert not list((tmp_path / "out").glob(".*tmp"))


def test_convert_keeps_hand_made_boxes_and_sizes_exactly(tmp_path):
    # two pictures of other sizes; boxes on the border (the detector's clip to w, h) are inside
    boxes = np.array([[[0, 0, 100, 50], [10.5, 20.25, 30.75, 40.5]],
                      [[0, 0, 20, 30], [5, 5, 5, 5]]], np.float32)
    feats = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    rows = [f"7\t100\t50\t2\t{b64(boxes[0])}\t{b64(feats[0])}", f"8\t20\t30\t2\t{b64(boxes[1])}\t{b64(feats[1])}"]
    convert_tsv(write(tmp_path / "f.tsv", rows), tmp_path / "out", "test", progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "test_boxes.npy"), boxes)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "test_image_sizes.npy"), [[100, 50], [20, 30]])


def box_row(box, region=2, k=4, d=6, image_id=1001):
    boxes = np.tile(np.array([[1, 2, 30, 40]], np.float32), (k, 1))
    boxes[region] = box
    return f"{image_id}\t64\t48\t{k}\t{b64(boxes)}\t{b64(np.ones((k, d)))}"


@pytest.mark.parametrize("box,problem", [
    ([np.nan, 0, 5, 5], r"box \[nan, 0, 5, 5\] holds NaN or inf"),
    ([0, 0, np.inf, 5], r"box \[0, 0, inf, 5\] holds NaN or inf"),
    ([10, 0, 5, 5], r"box \[10, 0, 5, 5\] has x2 < x1"),
    ([0, 9, 5, 3], r"box \[0, 9, 5, 3\] has y2 < y1"),
    ([0, 0, 70, 5], r"box \[0, 0, 70, 5\] lies outside the 64 x 48 picture \(image_w x image_h\)"),
    ([-3, 0, 5, 5], r"box \[-3, 0, 5, 5\] lies outside the 64 x 48 picture \(image_w x image_h\)"),
    ([0, 0, 5, 49.5], r"box \[0, 0, 5, 49\.5\] lies outside the 64 x 48 picture \(image_w x image_h\)"),
])
def test_bad_boxes_name_file_line_image_and_region(tmp_path, box, problem):
    rows, _, _ = make_rows()
    rows[1] = box_row(box)
    tsv = write(tmp_path / "feats.tsv", rows)
    with pytest.raises(InputError, match=rf"^{tsv}:2: image_id '1001', region 2: {problem}; expected 0 <= x1 <= x2 "
                                         r"<= image_w and 0 <= y1 <= y2 <= image_h \(pixels\)$"):
        convert_tsv(tsv, tmp_path / "out", "train", progress=False)
    assert not (tmp_path / "out" / "train_boxes.npy").exists()


def test_boxes_one_pixel_past_the_border_are_kept(tmp_path):
    rows, _, _ = make_rows(n=1)
    rows.append(box_row([-1, -0.5, 65, 49]))
    convert_tsv(write(tmp_path / "feats.tsv", rows), tmp_path / "out", "train", progress=False)
    assert np.load(tmp_path / "out" / "train_boxes.npy")[1, 2].tolist() == [-1, -0.5, 65, 49]


def test_caption_table_errors(tmp_path):
    rows, _, _ = make_rows(n=2)
    tsv = write(tmp_path / "feats.tsv", rows)
    caps = tmp_path / "caps.tsv"
    caps.write_text("1000\ta\n1000\tb\n1001\tc\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv: image_id '1001' has 1 caption where 1 of the 2 images have 2; "
                                         "precomp needs the same number for every image"):
        convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)
    caps.write_text("1000\ta\n1001\t   \n", encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv:2: empty caption for '1001'"):
        convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)
    caps.write_text("1000\ta\nno tab here\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv:2: expected 'image_id<TAB>caption'"):
        convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)
    caps.write_text("1000\ta\n1001\t80\t4\tAAAA\n", encoding="utf-8")     # the TSV's own rows given as captions
    with pytest.raises(InputError, match=r"caps\.tsv:2: 4 tab-separated fields; expected 'image_id<TAB>caption' "
                                         r"\(a caption holds no tab\)"):
        convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)
    from sgraf.data.convert import read_caption_table
    caps.write_text("a.jpg x\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.tsv:1: expected 'file_name<TAB>caption'"):
        read_caption_table(caps, key="file_name")
    caps.write_text("1000\ta\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"no captions for image_id '1001'"):
        convert_tsv(tsv, tmp_path / "out", "train", captions_path=caps, progress=False)


def test_an_image_twice_in_the_tsv_is_refused_and_unused_captions_named(tmp_path, caplog):
    """A duplicate image_id had been written twice, its captions too, with exit 0."""
    rows, _, _ = make_rows(n=3)
    rows[2] = rows[0]
    tsv = write(tmp_path / "feats.tsv", rows)
    with pytest.raises(InputError, match=r"feats\.tsv:3: image_id '1000' again \(first on line 1\); expected each "
                                         "image once"):
        convert_tsv(tsv, tmp_path / "out", "train", progress=False)
    assert not (tmp_path / "out" / "train_ims.npy").exists()
    rows, _, _ = make_rows(n=2)
    caps = tmp_path / "caps.tsv"
    caps.write_text("1000\ta\n1001\tb\n1007\tc\n", encoding="utf-8")
    convert_tsv(write(tmp_path / "two.tsv", rows), tmp_path / "out", "train", captions_path=caps, progress=False)
    assert "the captions of 1 image_id(s) not in" in caplog.text and "'1007' first" in caplog.text


def test_boxes_already_divided_by_the_picture_size_name_the_tsv(tmp_path):
    rows, feats, boxes = make_rows()
    sizes = np.array([[640 + i, 480 - i] for i in range(len(rows))], np.float32)
    normalised = boxes / np.concatenate([sizes, sizes], axis=1)[:, None, :]
    rows = [f"{1000 + i}\t{640 + i}\t{480 - i}\t4\t{b64(normalised[i])}\t{b64(feats[i])}" for i in range(len(rows))]
    tsv = write(tmp_path / "normed.tsv", rows)
    with pytest.raises(InputError, match=rf"^{tsv}: every box of its 3 rows lies within the first pixel of its picture "
                                         r"\(all coordinates <= 1\): field 'boxes' holds boxes already divided by "
                                         r"image_w and image_h\? expected x1, y1, x2, y2 in pixels"):
        convert_tsv(tsv, tmp_path / "out", "train", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # one row divided among pixel rows (two converters' outputs merged): named by its line
    rows = [f"{1000 + i}\t{640 + i}\t{480 - i}\t4\t{b64(normalised[i] if i == 1 else boxes[i])}\t{b64(feats[i])}"
            for i in range(len(rows))]
    tsv = write(tmp_path / "mixed.tsv", [rows[0], "", rows[1], rows[2]])        # a blank line before it
    with pytest.raises(InputError, match=rf"^{tsv}:3: every box lies within the first pixel of its picture \(all "
                                         r"coordinates <= 1; 1 of 3 rows so\)"):
        convert_tsv(tsv, tmp_path / "out", "train", progress=False)
    # an image of zero boxes (padding, no detections) is no image of divided boxes
    rows[1] = f"1001\t641\t479\t4\t{b64(np.zeros_like(boxes[1]))}\t{b64(feats[1])}"
    convert_tsv(write(tmp_path / "padded.tsv", rows), tmp_path / "padded", "train", progress=False)
