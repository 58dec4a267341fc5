"""Region boxes of a precomp folder (`sgraf.data.boxes`): pixels + picture sizes, read normalised."""

from __future__ import annotations

import numpy as np
import pytest

from sgraf.data.boxes import grid_boxes, read_boxes, write_boxes
from sgraf.data.precomp import PrecompSplit
from sgraf.errors import InputError


def _folder(tmp_path, boxes, sizes, n_regions=2, split="test"):
    """A precomp split of len(boxes) images with these pixel boxes and sizes."""
    n = len(boxes)
    np.save(tmp_path / f"{split}_ims.npy", np.zeros((n, n_regions, 3), dtype=np.float32))
    (tmp_path / f"{split}_caps.txt").write_text("".join(f"caption {i}\n" for i in range(n)))
    write_boxes(tmp_path, split, boxes, sizes)
    return tmp_path


def test_boxes_are_read_normalised_by_the_picture_size(tmp_path):
    boxes = np.array([[[0, 0, 100, 50], [20, 10, 200, 100]],
                      [[10, 30, 40, 60], [0, 0, 60, 60]]], dtype=np.float32)
    sizes = np.array([[200, 100], [60, 60]], dtype=np.float32)
    _folder(tmp_path, boxes, sizes)
    read = read_boxes(tmp_path, "test", 2, 2)
    assert read.dtype == np.float32 and read.shape == (2, 2, 4)
    np.testing.assert_allclose(read, [[[0, 0, 0.5, 0.5], [0.1, 0.1, 1, 1]],
                                      [[1 / 6, 0.5, 2 / 3, 1], [0, 0, 1, 1]]], rtol=1e-6)
    split = PrecompSplit(tmp_path, "test")
    np.testing.assert_array_equal(split.boxes, read)
    assert PrecompSplit(tmp_path, "test", max_captions=1).boxes.shape == (1, 2, 4)


def test_a_box_on_the_edge_within_the_tolerance_is_clipped(tmp_path):
    _folder(tmp_path, np.array([[[-0.5, 0, 100.5, 50], [0, 0, 1, 1]]]), np.array([[100, 50]]))
    np.testing.assert_array_equal(read_boxes(tmp_path, "test", 1, 2)[0, 0], [0, 0, 1, 1])


def test_grid_boxes_are_the_cells_row_major():
    boxes, sizes = grid_boxes(2, 2, 3, 192, 96)
    assert boxes.shape == (2, 6, 4) and sizes.tolist() == [[192, 96], [192, 96]]
    assert boxes[1, 1].tolist() == [64, 0, 128, 48]     # row 0, column 1
    assert boxes[0, 3].tolist() == [0, 48, 64, 96]      # row 1, column 0


def test_absent_boxes_are_none_unless_required(tmp_path):
    np.save(tmp_path / "test_ims.npy", np.zeros((1, 2, 3), dtype=np.float32))
    (tmp_path / "test_caps.txt").write_text("a caption\n")
    assert read_boxes(tmp_path, "test", 1, 2) is None and PrecompSplit(tmp_path, "test").boxes is None
    with pytest.raises(InputError, match=r"test_boxes.npy: missing file; this model uses region positions"):
        read_boxes(tmp_path, "test", 1, 2, required=True)
    with pytest.raises(InputError, match=r"test_boxes.npy: missing file"):
        PrecompSplit(tmp_path, "test").read_boxes(required=True)
    # a folder written before the sizes file: explain still draws its boxes, a model refuses them
    np.save(tmp_path / "test_boxes.npy", np.zeros((1, 2, 4), dtype=np.float32))
    assert read_boxes(tmp_path, "test", 1, 2) is None
    with pytest.raises(InputError, match=r"test_image_sizes.npy: missing file; the boxes of test_boxes.npy are "
                                         r"in pixels and this model with positions needs"):
        read_boxes(tmp_path, "test", 1, 2, required=True)


@pytest.mark.parametrize("change, message", [
    (lambda b, s: b.__setitem__((1, 0, 2), np.nan),
     r"test_boxes.npy: the box of image 1, region 0 is \[0.0, 0.0, nan, 10.0\]; expected finite"),
    (lambda b, s: b.__setitem__((0, 1, 0), 50.0),
     r"test_boxes.npy: the box of image 0, region 1 is \[50.0, 0.0, 10.0, 10.0\]; expected x2 >= x1 and y2 >= y1"),
    (lambda b, s: b.__setitem__((1, 1, 3), 40.0),
     r"test_boxes.npy: the box of image 1, region 1 is \[0.0, 0.0, 10.0, 40.0\]; expected inside its 20 x 30 "
     r"picture .*test_image_sizes.npy\), within 1 pixel"),
    (lambda b, s: s.__setitem__((0, 1), 0.0),
     r"test_image_sizes.npy: image 0 has size \[20.0, 0.0\]; expected a positive, finite width and height"),
    (lambda b, s: b.__setitem__(Ellipsis, b / 20.0),      # divided by the sizes already: every box in pixel 0
     r"test_boxes.npy: every box lies within the first pixel of its picture \(all coordinates <= 1, the "
     r"smallest picture 20 x 30 pixels\): boxes already divided by the picture sizes\? expected x1, y1, x2, y2 "
     r"in pixels"),
    (lambda b, s: b.__setitem__(1, b[1] / 20.0),          # one image's only: two files merged
     r"test_boxes.npy: every box of image 1 lies within the first pixel of its 20 x 30 picture \(all coordinates "
     r"<= 1; 1 of 2 images so\): boxes already divided by the picture size\? expected x1, y1, x2, y2 in pixels"),
])
def test_bad_boxes_are_refused_naming_file_image_and_region(tmp_path, change, message):
    boxes = np.tile(np.array([0, 0, 10, 10], dtype=np.float32), (2, 2, 1))
    sizes = np.array([[20, 30], [20, 30]], dtype=np.float32)
    _folder(tmp_path, boxes, sizes)
    change(boxes, sizes)
    np.save(tmp_path / "test_boxes.npy", boxes)     # written by something other than write_boxes
    np.save(tmp_path / "test_image_sizes.npy", sizes)
    with pytest.raises(InputError, match=message):
        read_boxes(tmp_path, "test", 2, 2)
    with pytest.raises(InputError, match=message.replace("test_boxes.npy", "test_boxes.npy being written")
                       .replace("test_image_sizes.npy", "test_image_sizes.npy being written")):
        write_boxes(tmp_path / "elsewhere", "test", boxes, sizes)
    assert not (tmp_path / "elsewhere").exists()


def test_wrong_shapes_are_refused(tmp_path):
    boxes = np.zeros((2, 2, 4), dtype=np.float32)
    sizes = np.ones((2, 2), dtype=np.float32)
    _folder(tmp_path, boxes, sizes)
    with pytest.raises(InputError, match=r"test_boxes.npy: 2 boxes per image; expected 3, one per region"):
        read_boxes(tmp_path, "test", 2, 3)
    with pytest.raises(InputError, match=r"test_boxes.npy: boxes for 2 images; expected 4, one per image"):
        read_boxes(tmp_path, "test", 4, 2)
    np.save(tmp_path / "test_boxes.npy", np.zeros((2, 2, 5), dtype=np.float32))
    with pytest.raises(InputError, match=r"test_boxes.npy: boxes of shape \(2, 2, 5\); expected \(n_images, "
                                         r"regions, 4\)"):
        read_boxes(tmp_path, "test", 2, 2)
    np.save(tmp_path / "test_boxes.npy", boxes)
    np.save(tmp_path / "test_image_sizes.npy", np.ones((3, 2), dtype=np.float32))
    with pytest.raises(InputError, match=r"test_image_sizes.npy: sizes of 3 images; expected 2"):
        read_boxes(tmp_path, "test", 2, 2)
