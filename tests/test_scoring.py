"""The streaming scorer against a per-pair oracle, with a tiny model honouring the SGRAF contract.

`TinyScorer` implements the three methods the scorer uses (`encode_images`, `encode_captions`,
`similarity`) with the same shapes and masking duties as `sgraf.model.sgraf.SGRAF`, so these
tests exercise bucketing, block assembly, ensembles, precision and several processes on their
own; the real model is covered end to end in test_evaluate.py.
"""

import os
import pathlib
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numerics import BFLOAT16, REORDERED, SAME_PATH, assert_close
from model_helpers import random_model
from sgraf import scoring
from sgraf.model import blocks

pytestmark = pytest.mark.numeric

VOCAB = 40


class TinyScorer(nn.Module):
    """Regions -> FC, words -> GRU, word-attended regions -> per-word cosine -> masked mean."""

    def __init__(self, seed: int = 0, img_dim: int = 12, dim: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(img_dim, dim)
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(1, 1)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))

    def encode_images(self, images):  # (n, K, D) -> (n, K, d)
        return F.normalize(self.fc(images), dim=-1)

    def encode_captions(self, captions, lengths):  # (n, L), (n,) -> (n, max(lengths), d)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(captions), lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        words, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return F.normalize(words, dim=-1)  # padding stays zero

    def similarity(self, img_embs, cap_embs, lengths, head=None):  # -> (n_img, n_cap)
        cap_embs = cap_embs[:, : int(lengths.max())]
        mask = torch.arange(cap_embs.shape[1], device=lengths.device)[None, :] < lengths[:, None]  # (c, L)
        affinity = torch.einsum("ikd,cld->iclk", img_embs, cap_embs)  # (i, c, L, K)
        attended = torch.einsum("iclk,ikd->icld", torch.softmax(9 * affinity, dim=-1), img_embs)
        per_word = F.cosine_similarity(attended, cap_embs[None], dim=-1)  # (i, c, L)
        mean = (per_word * mask).sum(-1) / lengths  # (i, c)
        return torch.sigmoid(self.head(mean[..., None]))[..., 0]


class TinyVocab:
    def encode(self, caption):
        return [1] + [4 + (sum(map(ord, word)) % (VOCAB - 4)) for word in caption.split()] + [2]


def tiny_split(n_img=7, cpi=5, seed=0, regions=6, img_dim=12):
    rng = np.random.default_rng(seed)
    words = "a dog cat runs on the grass red ball man woman street bike water jumps over".split()
    captions = [" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(n_img * cpi)]
    images = rng.normal(size=(n_img, regions, img_dim)).astype(np.float32)
    return types.SimpleNamespace(images=images, captions=captions)


def oracle_matrix(model, split, vocab):
    """One pair at a time, captions unpadded: the obviously correct score matrix."""
    sims = np.zeros((len(split.images), len(split.captions)), np.float64)
    with torch.no_grad():
        for j, caption in enumerate(split.captions):
            ids = torch.tensor([vocab.encode(caption)])
            length = torch.tensor([ids.shape[1]])
            words = model.encode_captions(ids, length)
            for i, image in enumerate(split.images):
                regions = model.encode_images(torch.from_numpy(image)[None])
                sims[i, j] = model.similarity(regions, words, length).item()
    return sims


def score(models, split, batch_size=4, precision="fp32", **kwargs):
    encoded = [scoring.encode_split(m, split, TinyVocab(), batch_size=batch_size, precision=precision)
               for m in models]
    return scoring.score_matrix(models, encoded, precision=precision, **kwargs)


def test_matches_per_pair_oracle_in_caption_file_order():
    model, split = TinyScorer(), tiny_split()
    sims = score([model], split, batch_size=4, image_block=3)
    assert sims.dtype == np.float32 and sims.shape == (7, 35)
    assert_close(sims, oracle_matrix(model, split, TinyVocab()), REORDERED)


def test_encoded_buckets_cover_every_caption_sorted_by_length():
    model, split = TinyScorer(), tiny_split()
    encoded = scoring.encode_split(model, split, TinyVocab(), batch_size=4)
    index = torch.cat([b.index for b in encoded.buckets])
    assert sorted(index.tolist()) == list(range(35))
    true_lengths = torch.tensor([len(TinyVocab().encode(c)) for c in split.captions])
    assert torch.equal(encoded.lengths, true_lengths)
    bucket_max = [int(b.lengths.max()) for b in encoded.buckets]
    assert bucket_max == sorted(bucket_max, reverse=True)
    for bucket in encoded.buckets:  # each bucket padded only to its own longest caption
        assert bucket.embs.shape[:2] == (len(bucket.index), int(bucket.lengths.max()))
    assert encoded.img_embs.shape == (7, 6, 8)  # each image once
    assert encoded.cap_embs.shape == (35, int(true_lengths.max()), 8)


@pytest.mark.parametrize("batch_size,image_block,block_elements", [(1, 1, 1), (3, 2, 50), (64, 16, 1 << 25)])
def test_block_and_batch_sizes_do_not_change_scores(batch_size, image_block, block_elements):
    model, split = TinyScorer(), tiny_split()
    reference = score([model], split, batch_size=5)
    sims = score([model], split, batch_size=batch_size, image_block=image_block, block_elements=block_elements)
    assert_close(sims, reference, SAME_PATH)


def test_ensemble_is_the_float64_mean_kept_in_float64():
    models, split = [TinyScorer(1), TinyScorer(2)], tiny_split()
    singles = [score([m], split) for m in models]
    both = score(models, split)
    expected = (singles[0].astype(np.float64) + singles[1]) / 2
    assert singles[0].dtype == np.float32 and both.dtype == np.float64
    np.testing.assert_array_equal(both, expected)
    assert not np.allclose(singles[0], singles[1], atol=1e-3)  # the two models really differ
    np.testing.assert_array_equal(scoring.average_matrices(singles, rows_per_chunk=2), expected)


@pytest.mark.parametrize("threads", [1, 3])
def test_averaged_matrices_are_the_float64_sum_from_zero_in_order_divided(monkeypatch, threads):
    """`average_matrices` (`sgraf evaluate --sims A B C`) by chunks and threads gives the bits of
    `sum(float64 matrices) / n`, negative zeros and sums that depend on order included."""
    rng = np.random.default_rng(3)
    matrices = [rng.standard_normal((37, 50)).astype(np.float32) * scale for scale in (1e8, 1.0, 1e-8)]
    matrices[0][0, :4] = matrices[1][0, :4] = matrices[2][0, :4] = -0.0     # 0.0 + -0.0 is +0.0
    matrices[2][1, 0] = -matrices[0][1, 0]
    expected = sum(np.asarray(m, dtype=np.float64) for m in matrices) / 3
    monkeypatch.setattr(scoring.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(scoring, "AVERAGE_CHUNK_ELEMENTS", 4 * 50)          # 10 chunks of 4 rows
    for got in (scoring.average_matrices(matrices), scoring.average_matrices(matrices, rows_per_chunk=5)):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got.view(np.uint64), expected.view(np.uint64))


def test_bf16_is_close_to_fp32():
    model, split = TinyScorer(), tiny_split()
    fp32 = score([model], split)
    bf16 = score([model], split, precision="bf16")
    assert bf16.dtype == np.float32
    assert_close(bf16, fp32, BFLOAT16, scale=1.0)
    assert not np.array_equal(bf16, fp32)  # autocast really ran in bfloat16


def test_restores_training_mode_and_needs_no_grad():
    model, split = TinyScorer(), tiny_split(n_img=2)
    model.train()
    sims = score([model], split)
    assert model.training
    assert np.isfinite(sims).all()


def test_ensemble_with_different_bucketing_is_refused():
    models, split = [TinyScorer(1), TinyScorer(2)], tiny_split()
    encoded = [scoring.encode_split(models[0], split, TinyVocab(), batch_size=4),
               scoring.encode_split(models[1], split, TinyVocab(), batch_size=5)]
    with pytest.raises(ValueError, match="bucketed differently"):
        scoring.score_matrix(models, encoded)


WORKER = r"""
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_scoring import TinyScorer, TinyVocab, tiny_split
from sgraf import distributed, scoring
info = distributed.init_from_env(device="cpu")
split = tiny_split(n_img=11)
model = TinyScorer(3)
encoded = scoring.encode_split(model, split, TinyVocab(), batch_size=4)
sims = scoring.score_matrix([model], [encoded], image_block=2)
np.save({out!r} + f"/sims_{{info.world_size}}_{{info.rank}}.npy", sims)
distributed.cleanup()
"""


def run_torchrun(tmp_path, nproc):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(pathlib.Path(__file__).parent), out=str(tmp_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", str(script)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]


def test_two_gloo_processes_give_the_same_matrix_as_one(tmp_path):
    run_torchrun(tmp_path, 1)
    run_torchrun(tmp_path, 2)
    one = np.load(tmp_path / "sims_1_0.npy")
    for rank in (0, 1):  # every process holds the whole gathered matrix, bit for bit
        np.testing.assert_array_equal(np.load(tmp_path / f"sims_2_{rank}.npy"), one)
    assert_close(one, oracle_matrix(TinyScorer(3), tiny_split(n_img=11), TinyVocab()), REORDERED)


def test_shard_ranges_cover_the_blocks_once_in_order():
    from sgraf.distributed import all_gather_cat, shard_range

    for n_items in (0, 1, 5, 6, 11):
        for world in (1, 2, 3, 8):
            shares = [shard_range(n_items, rank, world) for rank in range(world)]
            assert [i for share in shares for i in share] == list(range(n_items))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    tensor = torch.arange(6.0).reshape(3, 2)
    assert all_gather_cat(tensor) is tensor  # one process: nothing to gather


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_global_vectors_are_encoded_once_and_change_no_score(monkeypatch, precision):
    """With the real model, `encode_split` keeps each image's and caption's self-attention
    vector; scoring with them equals scoring that recomputes them per block."""
    model = random_model(3, vocab_size=VOCAB, img_dim=12, num_regions=6).eval()
    split = tiny_split()
    calls = []
    monkeypatch.setattr(model.sim_enc.v_global_w, "forward", counting(model.sim_enc.v_global_w.forward, calls))
    encoded = scoring.encode_split(model, split, TinyVocab(), batch_size=4, precision=precision)
    assert encoded.img_glo.shape == (7, model.config.embed_size)
    assert all(b.glo.shape == (len(b.index), model.config.embed_size) for b in encoded.buckets)
    encoded_calls = len(calls)
    grams = []
    monkeypatch.setattr(model.sim_enc, "region_gram", counting(model.sim_enc.region_gram, grams))
    cached = scoring.score_matrix([model], [encoded], precision=precision, image_block=2)
    assert len(calls) == encoded_calls  # no image's global vector computed again while scoring
    assert len(encoded.buckets) > 1 and len(grams) == 4  # Gram matrices once per image block of 2
    encoded.img_glo = None
    recomputed = scoring.score_matrix([model], [encoded], precision=precision, image_block=2)
    assert len(calls) > encoded_calls
    assert_close(cached, recomputed, SAME_PATH)
    if precision == "fp32":
        assert_close(cached, oracle_matrix(model, split, TinyVocab()), REORDERED)


def counting(forward, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)
    return wrapped


def test_blocks_scored_by_several_threads_fill_the_same_matrix(monkeypatch):
    """The threaded scorer (bf16 on CPU by default) fills each block once, without autograd."""
    model = random_model(4, vocab_size=VOCAB, img_dim=12, num_regions=6).eval()
    split = tiny_split(n_img=9)
    encoded = scoring.encode_split(model, split, TinyVocab(), batch_size=4)
    # without a model to measure, the defaults: ops-parallel in fp32, one block per core in bf16
    assert blocks.score_workers(torch.device("cpu"), "fp32", 5) == 1
    assert blocks.score_workers(torch.device("cpu"), "bf16", 5) == min(torch.get_num_threads(), 5)
    monkeypatch.setattr(blocks, "score_workers", lambda *args: 1)
    sequential = scoring.score_matrix([model], [encoded], image_block=2)
    monkeypatch.setattr(blocks, "score_workers", lambda *args: 3)
    calls = []  # (grad mode, thread) of each eval fast-path call
    fast_forward = model.sim_enc.fast_forward

    def recording(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), threading.get_ident()))
        return fast_forward(*args, **kwargs)

    monkeypatch.setattr(model.sim_enc, "fast_forward", recording)
    threads = torch.get_num_threads()
    threaded = scoring.score_matrix([model], [encoded], image_block=2)
    assert torch.get_num_threads() == threads
    assert calls and not any(grad for grad, _ in calls)
    assert threading.get_ident() not in {thread for _, thread in calls}
    assert_close(threaded, sequential, SAME_PATH)
    assert_close(threaded, oracle_matrix(model, split, TinyVocab()), REORDERED)
