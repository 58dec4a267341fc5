"""The block scorer every entry point shares (`sgraf.model.blocks`): buckets, constants once, sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_helpers import random_batch, random_model
from numerics import BFLOAT16, REORDERED, SAME_PATH, assert_close
from sgraf.api import Matcher
from sgraf.data.vocab import Vocabulary
from sgraf.model import blocks
from sgraf.model.oracle import oracle_forward
from sgraf.precision import autocast

pytestmark = pytest.mark.numeric

LENGTHS = [6, 3, 11, 3, 8, 5, 3, 9, 4, 12, 7]


def _recording(monkeypatch, model):
    """Record the caption width of every `similarity` call and count the per-call constants."""
    from sgraf.kernels import graph_steps

    widths, folds, globals_ = [], [], []
    similarity = model.similarity
    fold_steps = graph_steps.fold_steps
    visual = model.sim_enc.v_global_w.forward

    def similarity_recording(img_embs, cap_embs, lengths, *args, **kwargs):
        widths.append((int(cap_embs.shape[1]), int(torch.as_tensor(lengths).max())))
        return similarity(img_embs, cap_embs, lengths, *args, **kwargs)

    monkeypatch.setattr(model, "similarity", similarity_recording)
    monkeypatch.setattr(graph_steps, "fold_steps", lambda *a: folds.append(1) or fold_steps(*a))
    monkeypatch.setattr(model.sim_enc.v_global_w, "forward", lambda *a: globals_.append(1) or visual(*a))
    return {"widths": widths, "folds": folds, "image_globals": globals_}


def test_score_pads_each_bucket_to_its_own_longest_caption_and_prepares_constants_once(monkeypatch):
    model = random_model(3, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 5, LENGTHS, pad_to=15, seed=2)
    with torch.no_grad():
        expected = oracle_forward(model, images, captions, lengths)["sgr"]
    record = _recording(monkeypatch, model)
    scores = model.score(images, captions, lengths, batch_size=3)       # buckets of 3 captions
    assert_close(scores, expected, REORDERED)
    # 11 captions in 4 length buckets, each block no wider than its own longest caption
    assert len(record["widths"]) == 4
    assert all(width == longest for width, longest in record["widths"])
    assert sorted(w for w, _ in record["widths"]) == [3, 5, 8, 12]
    assert len(record["folds"]) == 1                 # SGR weights folded once for the call
    assert len(record["image_globals"]) == 2         # image global vectors once per image (5 in batches of 3)


def test_score_follows_the_autocast_it_is_called_in():
    model = random_model(4, module="saf", num_regions=7)
    images, captions, lengths = random_batch(model, 4, LENGTHS, seed=3)
    fp32 = model.score(images, captions, lengths)
    with autocast("bf16"):
        bf16 = model.score(images, captions, lengths)
    assert bf16.dtype == torch.float32
    assert_close(bf16, fp32, BFLOAT16, scale=1.0)
    assert not torch.equal(bf16, fp32)


def test_matcher_scores_through_the_same_buckets(monkeypatch):
    words = "a dog cat runs on the grass man woman red ball in park".split()
    vocab = Vocabulary.from_words(words)
    models = [random_model(s, module=m, vocab_size=len(vocab), num_regions=7) for s, m in ((5, "sgr"), (6, "saf"))]
    texts = ["a dog", "the man runs on the grass in the park", "red ball", "a cat on a man", "woman"]
    features = np.random.default_rng(0).standard_normal((6, 7, 20)).astype(np.float32)
    matcher = Matcher(models, vocab=vocab, batch_size=2)
    record = _recording(monkeypatch, models[0])
    ensemble = matcher.score(features, texts)
    ids = [vocab.encode(t) for t in texts]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64)
    for row, caption in enumerate(ids):
        padded[row, :len(caption)] = torch.tensor(caption)
    with torch.no_grad():
        expected = [oracle_forward(m, torch.from_numpy(features), padded, lengths)[m.config.module] for m in models]
    assert_close(ensemble, (expected[0].double() + expected[1].double()) / 2, REORDERED)
    assert len(record["widths"]) == 3 and all(width == longest for width, longest in record["widths"])
    assert len(record["folds"]) == 1


def test_rows_of_a_split_equal_the_whole():
    model = random_model(7, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 9, LENGTHS, seed=4)
    encoded = blocks.encode(model, images, captions, lengths, batch_size=4)
    whole = blocks.score_encoded([model], [encoded], image_block=2)
    part = blocks.score_encoded([model], [encoded], rows=(4, 8), image_block=2)
    assert part.shape == (4, len(LENGTHS))
    assert_close(part, whole[4:8], SAME_PATH)


def test_an_ensemble_must_share_its_buckets():
    model = random_model(7, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 3, LENGTHS, seed=4)
    a = blocks.encode(model, images, captions, lengths, batch_size=4)
    b = blocks.encode(model, images, captions, lengths, batch_size=5)
    with pytest.raises(ValueError, match="bucketed differently"):
        blocks.score_encoded([model, model], [a, b])


def test_block_sizes_follow_the_device(monkeypatch):
    assert blocks.block_sizes(torch.device("cpu"), "fp32") == (blocks.IMAGE_BLOCK, blocks.BLOCK_ELEMENTS)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * 2**30, 80 * 2**30))
    images, elements = blocks.block_sizes(torch.device("cuda"), "bf16")
    assert images == blocks.GPU_IMAGE_BLOCK
    assert elements == min(blocks.GPU_MAX_ELEMENTS, int(64 * 2**30 * blocks.GPU_MEMORY_SHARE) // 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))   # nearly full
    assert blocks.block_sizes(torch.device("cuda"), "fp32")[1] == blocks.BLOCK_ELEMENTS


def test_joined_caption_buckets_score_the_same_and_pad_little(monkeypatch):
    """On a GPU consecutive buckets are joined into larger caption blocks (`caption_block`);
    joined, each block is padded to its own longest caption and the scores do not change."""
    model = random_model(8, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 5, LENGTHS, pad_to=15, seed=5)
    encoded = blocks.encode(model, images, captions, lengths, batch_size=2)     # 6 buckets of <= 2
    merged = blocks.merge_buckets(encoded.buckets, 5)
    assert [len(b.index) for b in merged] == [4, 4, 3]
    assert sorted(torch.cat([b.index for b in merged]).tolist()) == list(range(len(LENGTHS)))
    for bucket in merged:
        assert bucket.embs.shape[1] == int(bucket.lengths.max())
        beyond = torch.arange(bucket.embs.shape[1]) >= bucket.lengths.unsqueeze(1)
        assert not bucket.embs[beyond].any()                                     # zero beyond each length
    assert len(blocks.merge_buckets(encoded.buckets, 1)) == len(encoded.buckets)  # a bucket is never cut
    record = _recording(monkeypatch, model)
    separate = blocks.score_encoded([model], [encoded])
    joined = blocks.score_encoded([model], [encoded], caption_block=5)
    assert len(record["widths"]) == 6 + 3
    assert_close(joined, separate, SAME_PATH)
    with pytest.raises(ValueError, match="caption_block"):
        blocks.score_encoded([model], [encoded], caption_block=0)


def test_a_call_with_few_captions_scores_its_images_in_one_block(monkeypatch):
    """A search re-ranking its shortlist (many images, one caption) is one block per model on the
    CPU, not one per 16 images; split scorers, which pass their blocks, keep them."""
    model = random_model(9, module="sgr", num_regions=7)
    images, captions, lengths = random_batch(model, 40, [6], seed=6)
    encoded = blocks.encode(model, images, captions, lengths)
    record = _recording(monkeypatch, model)
    one_block = blocks.score_encoded([model], [encoded])
    assert len(record["widths"]) == 1
    fixed = blocks.score_encoded([model], [encoded], image_block=blocks.IMAGE_BLOCK)
    assert len(record["widths"]) == 1 + 3
    assert_close(one_block, fixed, SAME_PATH)


@pytest.mark.parametrize("gpu_plan", [False, True], ids=["the caller's thread", "the GPU plan's threads"])
def test_image_batches_are_read_ahead_in_order_and_a_bad_one_is_named_when_reached(tmp_path, gpu_plan, monkeypatch):
    """`read_ahead` gives every batch of a memory map once, in order, as float32 copies (from
    float16 features too), on the caller's thread or the GPU plan's threads reading ahead; NaN in
    a later batch raises the error naming that image when the caller reaches it, after the
    batches before it."""
    from sgraf.errors import InputError
    from sgraf.kernels import plan

    import threading

    readers = set()
    check = blocks.check_finite_features
    monkeypatch.setattr(blocks, "check_finite_features",
                        lambda *args, **kwargs: readers.add(threading.current_thread().name) or check(*args, **kwargs))
    features = np.random.default_rng(0).standard_normal((23, 3, 4)).astype(np.float16)
    np.save(tmp_path / "f.npy", features)
    mapped = np.load(tmp_path / "f.npy", mmap_mode="r")
    context = plan.emulate_gpu() if gpu_plan else blocks.contextlib.nullcontext()
    with context:
        with blocks.read_ahead(mapped, 5, "f.npy", 0, torch.device("cpu")) as batches:
            read = list(batches)
        assert [start for start, _ in read] == [0, 5, 10, 15, 20]
        assert all(batch.dtype == torch.float32 for _, batch in read)
        assert torch.equal(torch.cat([batch for _, batch in read]), torch.from_numpy(features.astype(np.float32)))
        if gpu_plan:
            assert readers and all(name.startswith("sgraf-read") for name in readers)
            assert len(readers) <= blocks.READ_THREADS_GPU
        else:
            assert readers == {threading.current_thread().name}
        features[17, 1, 2] = np.nan
        np.save(tmp_path / "f.npy", features)
        mapped = np.load(tmp_path / "f.npy", mmap_mode="r")
        reached = []
        with pytest.raises(InputError, match=r"f\.npy.*image 17"):
            with blocks.read_ahead(mapped, 5, "f.npy", 0, torch.device("cpu")) as batches:
                for start, _ in batches:
                    reached.append(start)
        assert reached == [0, 5, 10]


def test_under_the_gpu_plan_captions_are_encoded_in_buckets_of_a_scoring_blocks_captions(monkeypatch):
    """Under the GPU plan the caption buckets hold `GPU_CAPTION_BLOCK` captions (the scorer joins
    buckets that far anyway): the same captions in the same order and the same word features as
    buckets of the asked size, joined."""
    from sgraf.kernels import plan

    monkeypatch.setattr(blocks, "GPU_CAPTION_BLOCK", 8)
    model = random_model(8, module="sgr", num_regions=7)
    lengths = torch.randint(2, 12, (21,), generator=torch.Generator().manual_seed(3))
    token_ids = [list(range(4, 4 + int(n))) for n in lengths]
    small = blocks.merge_buckets(blocks.encode_token_buckets(model, token_ids, batch_size=2), 8)
    with plan.emulate_gpu():
        large = blocks.encode_token_buckets(model, token_ids, batch_size=2)
        words = blocks.bucket_words(model, torch.zeros(21, 11, model.config.embed_size), lengths, batch_size=2)
    assert [len(b.index) for b in large] == [8, 8, 5] == [len(b.index) for b in words]
    for joined, bucket in zip(small, large):
        assert torch.equal(joined.index, bucket.index) and torch.equal(joined.lengths, bucket.lengths)
        assert_close(bucket.embs, joined.embs, SAME_PATH)


def test_a_copied_model_has_the_same_weights_in_memory_of_its_own():
    from sgraf.model.blocks import copied

    model = random_model(3, module="sgr")
    twin = copied(model)
    for (name, ours), theirs in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(ours, theirs) and ours.data_ptr() != theirs.data_ptr(), name
    next(twin.parameters()).data.add_(1.0)
    assert not torch.equal(next(model.parameters()), next(twin.parameters()))
