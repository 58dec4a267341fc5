"""Metrics against the authors' numbers (golden_recall.pt) and a plain argsort oracle."""

import pathlib

import numpy as np
import pytest
import torch

from sgraf import metrics
from sgraf.errors import InputError

KEYS = ("r1", "r5", "r10", "medr", "meanr")


DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def golden():
    return torch.load(DATA / "golden_recall.pt", weights_only=True)


def as_list(result):
    return [result[k] for k in KEYS]


def argsort_ranks(sims, cpi):
    """The authors' per-row loop with a stable descending argsort (the tie rule we promise)."""
    n_img, n_cap = sims.shape
    i2t_ranks, i2t_top1 = np.zeros(n_img, np.int64), np.zeros(n_img, np.int64)
    for i in range(n_img):
        order = np.argsort(sims[i], kind="stable")[::-1]
        i2t_ranks[i] = min(np.where(order == j)[0][0] for j in range(cpi * i, cpi * i + cpi))
        i2t_top1[i] = order[0]
    t2i_ranks, t2i_top1 = np.zeros(n_cap, np.int64), np.zeros(n_cap, np.int64)
    for j in range(n_cap):
        order = np.argsort(sims[:, j], kind="stable")[::-1]
        t2i_ranks[j] = np.where(order == j // cpi)[0][0]
        t2i_top1[j] = order[0]
    return i2t_ranks, i2t_top1, t2i_ranks, t2i_top1


@pytest.mark.parametrize("case", ["single", "single_structured"])
def test_single_matches_official_exactly(golden, case):
    entry = golden[case]
    sims = entry["sims"].numpy()
    result = metrics.evaluate_sims(sims)
    assert as_list(result["i2t"]) == entry["i2t"]
    assert as_list(result["t2i"]) == entry["t2i"]
    r, ri = entry["i2t"], entry["t2i"]
    assert result["rsum"] == r[0] + r[1] + r[2] + ri[0] + ri[1] + ri[2]
    assert (result["n_images"], result["n_captions"]) == (20, 100)
    assert "folds" not in result
    ranks, top1 = metrics.i2t_ranks(sims)
    np.testing.assert_array_equal(ranks, entry["i2t_ranks"].numpy())
    np.testing.assert_array_equal(top1, entry["i2t_top1"].numpy())
    ranks, top1 = metrics.t2i_ranks(sims)
    np.testing.assert_array_equal(ranks, entry["t2i_ranks"].numpy())
    np.testing.assert_array_equal(top1, entry["t2i_top1"].numpy())


@pytest.mark.parametrize("case", ["fold5", "fold5_structured"])
def test_folds_match_official_exactly(golden, case):
    entry = golden[case]
    result = metrics.evaluate_sims(entry["sims"], folds=5)  # a float64 tensor is accepted too
    assert len(result["folds"]) == 5
    for fold, row in zip(result["folds"], entry["per_fold"]):
        assert (fold["n_images"], fold["n_captions"]) == (entry["fold_images"], entry["fold_captions"])
        assert as_list(fold["i2t"]) + as_list(fold["t2i"]) == row[:10]
        assert fold["rsum"] == row[12]
    assert as_list(result["i2t"]) == entry["mean_i2t"]
    assert as_list(result["t2i"]) == entry["mean_t2i"]
    assert result["rsum"] == entry["mean_rsum"]
    # The authors' script prints these means under other names; ours are the true ones.
    printed = entry["official_printed"]
    assert printed["Average t2i Recall"] == result["rsum"]
    assert printed["rsum"] == pytest.approx(2 * sum(result["i2t"][k] for k in ("r1", "r5", "r10")))


@pytest.mark.parametrize("threads", [1, 4])                # chunks counted one after the other or at once
@pytest.mark.parametrize("rows_per_chunk", [None, 2])     # one chunk; ties carried across chunks of 2 rows
@pytest.mark.parametrize("cpi", [1, 3, 5])
def test_vectorised_ranks_equal_argsort_loop_with_ties(monkeypatch, cpi, rows_per_chunk, threads):
    rng = np.random.default_rng(cpi)
    n_img = 13
    monkeypatch.setattr(metrics.torch, "get_num_threads", lambda: threads)
    if rows_per_chunk:
        monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", rows_per_chunk * n_img * cpi)
    # Few distinct values: many ties, within rows, columns and among an image's captions.
    sims = rng.integers(0, 4, size=(n_img, n_img * cpi)).astype(np.float32)
    expected = argsort_ranks(sims, cpi)
    got = metrics.i2t_ranks(sims, cpi) + metrics.t2i_ranks(sims, cpi)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_chunking_does_not_change_ranks(monkeypatch):
    rng = np.random.default_rng(0)
    sims = rng.normal(size=(30, 150)).astype(np.float32)
    sims[3, 17] = sims[3, 15]  # a tie across the chunk boundary search
    whole = metrics.i2t_ranks(sims) + metrics.t2i_ranks(sims)
    monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", 200)  # one row / a few columns per chunk
    chunked = metrics.i2t_ranks(sims) + metrics.t2i_ranks(sims)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole[0], argsort_ranks(sims, 5)[0])


def test_perfect_and_constant_matrices():
    eye = np.repeat(np.eye(4, dtype=np.float32), 5, axis=1)  # every image scores its own captions 1
    result = metrics.evaluate_sims(eye)
    assert as_list(result["i2t"]) == [100.0, 100.0, 100.0, 1.0, 1.0]
    assert as_list(result["t2i"]) == [100.0, 100.0, 100.0, 1.0, 1.0]
    assert result["rsum"] == 600.0
    # All scores equal: the later index ranks first, so image i's best caption is its last one.
    flat = np.zeros((4, 20), np.float32)
    ranks, top1 = metrics.i2t_ranks(flat)
    np.testing.assert_array_equal(ranks, [15, 10, 5, 0])
    np.testing.assert_array_equal(top1, [19, 19, 19, 19])


def test_float32_and_float64_agree():
    rng = np.random.default_rng(1)
    sims = rng.random((10, 50))
    assert metrics.evaluate_sims(sims) == metrics.evaluate_sims(sims.astype(np.float32))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(InputError, match="whole multiple"):
        metrics.evaluate_sims(np.zeros((3, 7)))
    with pytest.raises(InputError, match=r"shape \(3, 12\): expected 3 x 5 = 15 captions \(caps_per_image=5\)"):
        metrics.evaluate_sims(np.zeros((3, 12)), caps_per_image=5)
    with pytest.raises(InputError, match="2-d"):
        metrics.evaluate_sims(np.zeros(5))
    with pytest.raises(InputError, match="NaN"):
        metrics.evaluate_sims(np.full((2, 10), np.nan))
    with pytest.raises(InputError, match="equal folds"):
        metrics.evaluate_sims(np.zeros((6, 30)), folds=4)
    with pytest.raises(InputError, match="positive integer"):
        metrics.evaluate_sims(np.zeros((6, 30)), folds=0)


def test_format_table_shows_means_and_folds(golden):
    result = metrics.evaluate_sims(golden["fold5"]["sims"].numpy(), folds=5)
    text = metrics.format_table(result)
    assert f"mean over 5 folds of {result['n_images'] // 5} images" in text     # the fold size said
    assert ("(R@10 is 100 in a fold of" in text) == (result["n_images"] // 5 <= 10)
    assert f"rsum {result['rsum']:.1f}" in text
    assert sum(line.startswith("fold ") for line in text.splitlines()) == 5


# A matrix on a GPU is counted there with PyTorch (`sgraf evaluate` scores on the device); here the
# same path runs on CPU tensors, and tests/test_gpu.py runs it on a CUDA device.
@pytest.fixture
def counted_with_torch(monkeypatch):
    monkeypatch.setattr(metrics, "_stays_on_device", lambda sims: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_matrix_counted_with_torch_matches_the_authors_exactly(golden, counted_with_torch, dtype):
    entry = golden["single_structured"]
    sims = entry["sims"].to(dtype)
    assert isinstance(metrics.as_score_matrix(sims), torch.Tensor)
    result = metrics.evaluate_sims(sims)
    assert as_list(result["i2t"]) == entry["i2t"] and as_list(result["t2i"]) == entry["t2i"]
    for got, expected in zip(metrics.i2t_ranks(sims) + metrics.t2i_ranks(sims),
                             ("i2t_ranks", "i2t_top1", "t2i_ranks", "t2i_top1")):
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, entry[expected].numpy())
    folds = golden["fold5_structured"]
    result = metrics.evaluate_sims(folds["sims"].to(dtype), folds=5)   # each fold a strided view
    assert as_list(result["i2t"]) == folds["mean_i2t"] and as_list(result["t2i"]) == folds["mean_t2i"]
    assert result["rsum"] == folds["mean_rsum"]


@pytest.mark.parametrize("rows_per_chunk", [None, 2])     # one chunk; ties carried across chunks of 2 rows
@pytest.mark.parametrize("cpi", [1, 3, 5])
def test_ranks_counted_with_torch_equal_the_argsort_loop_with_ties(monkeypatch, counted_with_torch, cpi,
                                                                   rows_per_chunk):
    rng = np.random.default_rng(10 + cpi)
    n_img = 13
    if rows_per_chunk:
        monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", rows_per_chunk * n_img * cpi)
    sims = rng.integers(0, 4, size=(n_img, n_img * cpi)).astype(np.float32)
    expected = argsort_ranks(sims, cpi)
    got = metrics.i2t_ranks(torch.from_numpy(sims), cpi) + metrics.t2i_ranks(torch.from_numpy(sims), cpi)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    assert metrics.evaluate_sims(torch.from_numpy(sims)) == metrics.evaluate_sims(sims)


def test_a_matrix_counted_with_torch_refuses_bad_input_alike(counted_with_torch):
    with pytest.raises(InputError, match=r"score matrix: expected a non-empty 2-d .* got shape \(5,\)"):
        metrics.evaluate_sims(torch.zeros(5))
    with pytest.raises(InputError, match=r"got shape \(0, 5\)"):
        metrics.evaluate_sims(torch.zeros(0, 5))
    with pytest.raises(InputError, match="score matrix: contains NaN or infinite scores"):
        metrics.evaluate_sims(torch.tensor([[0.0, float("inf")]]))
    with pytest.raises(InputError, match="whole multiple"):
        metrics.evaluate_sims(torch.zeros(3, 7))
    # integer and half scores are compared as float32, as in NumPy
    half = torch.tensor([[2.0, 1.0, 0.0, 0.0], [1.0, 1.0, 3.0, 0.5]], dtype=torch.float16)
    assert metrics.evaluate_sims(half) == metrics.evaluate_sims(half.float().numpy())


def test_a_cpu_tensor_is_counted_in_numpy():
    sims = torch.rand(4, 20)
    assert isinstance(metrics.as_score_matrix(sims), np.ndarray)
    assert not metrics._stays_on_device(sims)


def test_evaluate_hands_the_metrics_the_matrix_where_it_was_scored(monkeypatch):
    """`evaluate_split` keeps the matrix where it was scored for the metrics (on a GPU: there),
    then returns it as NumPy; counted with torch or NumPy, the metrics are the same."""
    from sgraf.evaluate import evaluate_checkpoints_with_sims

    e2e = DATA / "e2e"
    args = ([e2e / "sgr.pth.tar"], e2e / "data" / "toy_precomp", "test")
    seen = []
    count = metrics._evaluate_one
    monkeypatch.setattr(metrics, "_evaluate_one", lambda sims, cpi: seen.append(type(sims)) or count(sims, cpi))
    in_numpy, sims = evaluate_checkpoints_with_sims(*args, vocab=e2e / "data" / "toy_vocab.json")
    monkeypatch.setattr(metrics, "_stays_on_device", lambda sims: True)
    with_torch, again = evaluate_checkpoints_with_sims(*args, vocab=e2e / "data" / "toy_vocab.json")
    assert seen == [np.ndarray, torch.Tensor]
    assert with_torch == in_numpy and isinstance(again, np.ndarray) and np.array_equal(again, sims)
