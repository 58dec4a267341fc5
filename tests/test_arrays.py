"""Untrusted .npy files, the NaN/inf check of region features and padded token ids (sgraf.data.arrays)."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch

from sgraf.data.arrays import (check_finite_features, file_row, first_non_finite, map_row_chunks, open_npy,
                               padded_ids, row_chunks)
from sgraf.errors import InputError

EXPECTED = "float32 features of shape (n_images, regions, dim)"


def _garbage(path, kind):
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"features": [1.0, 2.0]}))
    elif kind == "object array":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif kind == "truncated":
        np.save(path, np.zeros((4, 3, 5), np.float32))
        path.write_bytes(path.read_bytes()[:-7])
    elif kind == "npz":
        with open(path, "wb") as handle:
            np.savez(handle, images=np.zeros((2, 3, 5), np.float32))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "header":
        np.save(path, np.zeros((4, 3, 5), np.float32))
        raw = bytearray(path.read_bytes())
        raw[12:40] = b"{'descr': <<garbage>>, 'sh"
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind, reason", [
    ("pickle", r"does not start with the NumPy header \(another format, or a pickle, which sgraf never loads\)"),
    ("object array", r"it holds Python objects \(dtype object\), which sgraf never unpickles"),
    ("truncated", r"truncated: its header describes a float32 array of shape \(4, 3, 5\) \(240 bytes of data\) "
                  r"but only 233 bytes follow"),
    ("npz", r"it is a zip archive \(\.npz\?\), not a single array"),
    ("empty", r"the file is empty"),
    ("header", r"its header is corrupted"),
])
def test_garbage_npy_gets_our_one_line_message(tmp_path, kind, reason):
    path = tmp_path / "train_ims.npy"
    _garbage(path, kind)
    with pytest.raises(InputError) as error:
        open_npy(path, EXPECTED)
    message = str(error.value)
    assert message.startswith(f"{path}: not a readable .npy array: ")
    assert message.endswith(f"; expected {EXPECTED}")
    assert re.search(reason, message), message
    # numpy's own advice (allow_pickle, "load it unsafely") never reaches the user
    assert "allow_pickle" not in message and "unsafe" not in message and "\n" not in message


def test_open_npy_maps_a_good_file_read_only(tmp_path):
    values = np.arange(60, dtype=np.float32).reshape(4, 3, 5)
    np.save(tmp_path / "ok.npy", values)
    array = open_npy(tmp_path / "ok.npy", EXPECTED)
    assert isinstance(array, np.memmap) and not array.flags.writeable
    np.testing.assert_array_equal(array, values)
    with pytest.raises(FileNotFoundError):
        open_npy(tmp_path / "missing.npy", EXPECTED)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_feature_is_named_by_file_image_region_dim(tmp_path, bad):
    values = np.ones((6, 3, 5), np.float32)
    values[4, 2, 1] = bad
    values[5, 0, 0] = bad
    check_finite_features(values[:4], "f.npy")  # the good rows pass
    message = r"f\.npy: feature \[image 14, region 2, dim 1\] is (nan|inf|-inf); expected finite values \(1 more"
    with pytest.raises(InputError, match=message):
        check_finite_features(values, "f.npy", first_image=10)
    with pytest.raises(InputError, match=r"feature \[image 14, region 2"):
        check_finite_features(torch.from_numpy(values), "f.npy", first_image=10)   # tensors too
    with pytest.raises(InputError, match=r"feature \[image 14, region 2"):
        check_finite_features(torch.from_numpy(values).bfloat16(), "f.npy", first_image=10)
    # a shuffled batch names each row's own image; one image (K, D) is image 0 (or first_image)
    with pytest.raises(InputError, match=r"feature \[image 31, region 2, dim 1\]"):
        check_finite_features(values[3:5], "f.npy", image_ids=[8, 31])
    with pytest.raises(InputError, match=r"image features: feature \[image 7, region 2, dim 1\]"):
        check_finite_features(values[4], first_image=7)
    # a memory map names its own file
    np.save(tmp_path / "dev_ims.npy", values)
    mapped = np.load(tmp_path / "dev_ims.npy", mmap_mode="r")
    for view in (mapped, mapped[3:6], mapped[4]):   # views count from the file's first image
        with pytest.raises(InputError, match=r"dev_ims\.npy: feature \[image 4, region 2, dim 1\]"):
            check_finite_features(view)
    with pytest.raises(InputError, match=r"^image features: feature \[image 0, region 1, dim 1\]"):
        check_finite_features(mapped[4:5, 1:])   # not whole images: no file position is claimed


def test_padded_ids_lays_rows_of_any_length_and_kind_into_one_zero_padded_tensor():
    rows = [[5, 6, 7], [8], np.array([9, 10], dtype=np.int32), torch.tensor([11, 12, 13, 14])]
    padded = padded_ids(rows)
    assert padded.dtype == torch.int64 and padded.shape == (4, 4)
    assert padded.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 0, 0], [11, 12, 13, 14]]
    assert padded_ids([]).shape == (0, 0)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("elements", [1, 7, 10 ** 6])      # a row per chunk, 2 rows, one chunk
def test_first_non_finite_names_the_first_bad_score_in_row_order_whatever_the_chunks(monkeypatch, tmp_path,
                                                                                     threads, elements):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    matrix = np.random.default_rng(0).random((9, 4)).astype(np.float32)
    assert first_non_finite(matrix, elements) is None
    matrix[7, 0] = np.inf
    matrix[5, 3] = -np.inf
    assert first_non_finite(matrix, elements) == (5, 3)
    matrix[5, 1] = np.nan
    assert first_non_finite(matrix, elements) == (5, 1)
    np.save(tmp_path / "m.npy", matrix)                       # a memory map is read the same way
    assert first_non_finite(np.load(tmp_path / "m.npy", mmap_mode="r"), elements) == (5, 1)
    assert first_non_finite(np.zeros((3, 0), np.float32), elements) is None


def test_map_row_chunks_covers_every_row_once_in_order(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert row_chunks(10, 3, 7) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_chunks(3, 100, 7) == [(0, 1), (1, 2), (2, 3)]     # at least a row
    assert row_chunks(0, 5, 7) == []
    assert map_row_chunks(lambda rows: rows[1] - rows[0], 10, 3, 7) == [2, 2, 2, 2, 2]


def test_file_row_reads_a_mapped_row_and_a_file_cut_short_is_an_oserror_not_sigbus(tmp_path):
    """`sgraf serve` had died of SIGBUS explaining while the features file was rewritten: the
    mapped page past the new end of the file. The row is read from the file instead."""
    import errno
    import os

    values = np.arange(5 * 3 * 4, dtype=np.float32).reshape(5, 3, 4)
    np.save(tmp_path / "a.npy", values)
    mapped = open_npy(tmp_path / "a.npy", "x")
    for index in (0, 3, -1, np.int64(2)):
        row = file_row(mapped, index)
        assert np.array_equal(row, values[index]) and row.flags.writeable and not np.shares_memory(row, mapped)
    with pytest.raises(IndexError):
        file_row(mapped, 5)
    assert np.array_equal(file_row(values, 1), values[1])         # not a map: indexed, a copy
    os.truncate(tmp_path / "a.npy", 128 + 4 * 48 + 10)            # a writer cut it: rows 0-3 whole, 4 not
    assert np.array_equal(file_row(mapped, 3), values[3])
    with pytest.raises(OSError, match=r"ends before row 4 of its \(5, 3, 4\) array") as raised:
        file_row(mapped, 4)
    assert raised.value.errno == errno.EIO and raised.value.filename == str(tmp_path / "a.npy")
    # a view of whole rows (PrecompSplit.images of a file of one row per caption: every fifth row)
    np.save(tmp_path / "b.npy", np.repeat(values, 5, axis=0))
    every_fifth = open_npy(tmp_path / "b.npy", "x")[::5]
    assert [np.array_equal(file_row(every_fifth, i), values[i]) for i in range(5)] == [True] * 5
    os.truncate(tmp_path / "b.npy", 128 + 48 * 16)                     # file rows 0-15: view rows 0-3
    assert np.array_equal(file_row(every_fifth, 3), values[3])
    with pytest.raises(OSError, match=r"ends before row 4 of its \(5, 3, 4\) array"):
        file_row(every_fifth, 4)
