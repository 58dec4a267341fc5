"""`sgraf.model.host_copy.HostCopy`: a score matrix copied to the host band by band while the rest
is scored (on CPU tensors here, the path a GPU run takes without streams; on CUDA in
tests/test_gpu.py)."""

import threading

import numpy as np
import pytest
import torch

from sgraf.model.host_copy import HostCopy


def test_bands_are_copied_as_handed_over_and_the_rest_at_the_end():
    share = torch.randn(10, 7)
    with HostCopy((10, 7)) as copy:
        copy.band(share, slice(0, 4))
        copy.band(share, slice(4, 8))
        for future in copy._pending:
            future.result()
        handed = share.clone()
        share[:8] += 100.0            # rows of a band are never written again: the copy made then is kept
        host = copy.result(share)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32 and host.shape == (10, 7)
    assert np.array_equal(host[:8], handed[:8].numpy())
    assert np.array_equal(host[8:], share[8:].numpy())       # no band: copied by `result`


def test_without_bands_the_whole_matrix_is_copied():
    share = torch.randn(5, 3)
    with HostCopy((5, 3)) as copy:
        host = copy.result(share)
    assert np.array_equal(host, share.numpy())
    assert not np.shares_memory(host, share.numpy())


def test_the_copies_run_on_one_worker_thread_in_the_order_handed_over():
    share = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    threads, order = set(), []
    with HostCopy((6, 10)) as copy:
        copy_band = copy._copy

        def spy(share, rows, event):
            threads.add(threading.get_ident())
            order.append(rows.start)
            copy_band(share, rows, event)

        copy._copy = spy
        for start in (0, 2, 4):
            copy.band(share, slice(start, start + 2))
        host = copy.result(share)
    assert order == [0, 2, 4] and len(threads) == 1 and threading.get_ident() not in threads
    assert np.array_equal(host, share.numpy())
    assert not copy._pool._threads or not any(t.is_alive() for t in copy._pool._threads)   # closed


def test_an_ensembles_float64_matrix_is_copied_and_written_in_float64(tmp_path):
    share = torch.randn(6, 5, dtype=torch.float64) / 3
    with HostCopy((6, 5), tmp_path / "sims.npy", dtype=torch.float64) as copy:
        copy.band(share, slice(0, 4))
        host = copy.result(share)
    assert host.dtype == np.float64 and np.array_equal(host, share.numpy())
    np.save(tmp_path / "expected.npy", share.numpy())          # NumPy's own bytes, rows at float64 offsets
    assert (tmp_path / "sims.npy").read_bytes() == (tmp_path / "expected.npy").read_bytes()
    with HostCopy((6, 5), dtype=torch.float64) as copy:        # a float32 band would be widened: refused
        with pytest.raises(ValueError, match="float32.*expected.*float64"):
            copy.band(share.float(), slice(0, 1))
        with pytest.raises(ValueError, match="float32.*expected.*float64"):
            copy.result(share.float())


def test_a_matrix_of_another_shape_is_refused():
    with HostCopy((4, 4)) as copy:
        with pytest.raises(ValueError, match=r"\(3, 4\).*expected \(4, 4\)"):
            copy.band(torch.zeros(3, 4), slice(0, 1))
        with pytest.raises(ValueError, match=r"\(4, 5\).*expected \(4, 4\)"):
            copy.result(torch.zeros(4, 5))


def test_a_failed_copy_is_raised_by_result():
    with HostCopy((4, 4)) as copy:
        copy.band(torch.zeros(4, 4, device="meta"), slice(0, 2))   # a tensor without data: no copy
        with pytest.raises(NotImplementedError):
            copy.result(torch.zeros(4, 4))


def test_the_matrix_is_written_as_numpys_npy_band_by_band_and_the_rest_at_the_end(tmp_path):
    share = torch.randn(10, 6)
    path = tmp_path / "sims.npy"
    with HostCopy((10, 6), file=path) as copy:
        copy.band(share, slice(2, 4))
        copy.band(share, slice(6, 8))
        host = copy.result(share)       # rows 0-1, 4-5 and 8-9 written now
    expected = tmp_path / "expected.npy"
    np.save(expected, share.numpy())
    assert path.read_bytes() == expected.read_bytes()
    assert np.array_equal(np.load(path), host)


def test_without_pwrite_and_fdatasync_the_file_is_the_same(tmp_path, monkeypatch):
    """Windows has neither, macOS no fdatasync: `evaluate --save-sims` on CUDA had stopped there
    with an AttributeError."""
    import os

    monkeypatch.delattr(os, "pwrite")
    monkeypatch.delattr(os, "fdatasync", raising=False)
    share = torch.randn(10, 6)
    path = tmp_path / "sims.npy"
    with HostCopy((10, 6), file=path) as copy:
        copy.band(share, slice(2, 4))
        copy.result(share)
    expected = tmp_path / "expected.npy"
    np.save(expected, share.numpy())
    assert path.read_bytes() == expected.read_bytes()


def test_a_file_that_cannot_be_written_is_raised_by_result(tmp_path):
    with HostCopy((2, 2), file=tmp_path / "missing" / "sims.npy") as copy:
        copy.band(torch.zeros(2, 2), slice(0, 1))
        with pytest.raises(FileNotFoundError):
            copy.result(torch.zeros(2, 2))


def test_a_full_disk_under_the_gpu_plan_is_one_line_naming_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    """`sgraf evaluate --save-sims` whose bands cannot be written (ENOSPC from the worker's
    writes): the `InputError` names the file the user asked for, and no file is left."""
    import errno
    import os
    import pathlib

    from sgraf import evaluate
    from sgraf.errors import InputError
    from sgraf.kernels import plan
    from sgraf.model import host_copy

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(host_copy.os, "pwrite", full)
    e2e = pathlib.Path(__file__).parent / "data" / "e2e"
    out = tmp_path / "out"
    out.mkdir()
    with plan.emulate_gpu(), pytest.raises(InputError) as raised:
        evaluate.evaluate_checkpoints([e2e / "sgr.pth.tar"], e2e / "data" / "toy_precomp", "test",
                                      vocab=e2e / "data" / "toy_vocab.json", save_sims=out / "sims.npy")
    assert str(raised.value) == f"cannot write {out / 'sims.npy'}: No space left on device"
    assert list(out.iterdir()) == []
