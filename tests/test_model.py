"""The vectorised scorer against the per-caption oracle, every ablation switch, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from model_helpers import random_batch, random_model
from numerics import REORDERED, SAME_PATH, assert_close
from sgraf.config import ModelConfig
from sgraf.errors import InputError
from sgraf.model.oracle import oracle_forward
from sgraf.model.sgraf import SGRAF
from sgraf.precision import autocast

pytestmark = pytest.mark.numeric

LENGTHS = [6, 3, 11, 3, 8, 5, 3, 9]          # unsorted, mixed, several `<start> w <end>` captions

CONFIGS = [
    dict(module="sgr"),
    dict(module="saf"),
    dict(module="joint"),
    dict(module="ave"),
    dict(module="ave", alignments="global"),                       # Table 3 row 1
    dict(module="sgr", alignments="local", sgr_step=1),            # Table 3 row 2
    dict(module="sgr", alignments="local", sgr_step=3),            # Table 3 row 3
    dict(module="sgr", sgr_step=1), dict(module="sgr", sgr_step=2), dict(module="sgr", sgr_step=4),
    dict(module="sgr", alignments="global"),
    dict(module="saf", alignments="local"),
    dict(module="ave", alignments="local", similarity="scalar", attention="i2t"),   # Table 4 row 1
    dict(module="ave", alignments="local", attention="i2t"),                        # row 2
    dict(module="sgr", alignments="local", attention="i2t"),                        # row 3
    dict(module="saf", alignments="local", attention="i2t"),                        # row 4
    dict(module="ave", alignments="local", similarity="scalar"),                    # row 5
    dict(module="ave", alignments="local"),                                         # row 6
    dict(module="joint", attention="i2t"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_vectorised_scores_equal_per_caption_oracle(config):
    model = random_model(11, num_regions=7, **config)
    images, captions, lengths = random_batch(model, 5, LENGTHS, pad_to=13, seed=2)
    scores = model.score(images, captions, lengths)
    assert scores.shape == (5, len(LENGTHS)) and scores.dtype == torch.float32
    with torch.no_grad():
        expected = oracle_forward(model, images, captions, lengths)
        heads = model.similarity_heads(model.encode_images(images), model.encode_captions(captions, lengths), lengths)
    assert set(heads) == set(expected) == set(model.heads)
    for head in expected:
        assert_close(heads[head], expected[head], REORDERED, what=head)
    assert_close(scores, sum(expected.values()) / len(expected), REORDERED)
    assert torch.isfinite(scores).all()
    # values spread: a model that ignored its inputs would give one constant
    assert scores.std() > 1e-4


def test_joint_heads_are_separate_and_the_default_score_is_their_mean():
    model = random_model(3, module="joint")
    images, captions, lengths = random_batch(model, 3, [4, 7, 3])
    with torch.no_grad():
        img, cap = model.encode_images(images), model.encode_captions(captions, lengths)
        sgr, saf = model.similarity(img, cap, lengths, head="sgr"), model.similarity(img, cap, lengths, head="saf")
        both = model.similarity(img, cap, lengths)
        train_out = model(images, captions, lengths)
    assert not torch.allclose(sgr, saf)
    assert_close(both, (sgr + saf) / 2, SAME_PATH)
    assert set(train_out) == {"sgr", "saf"}
    assert_close(train_out["sgr"], sgr, REORDERED)
    with pytest.raises(ValueError, match="head 'ave'"):
        model.similarity(img, cap, lengths, head="ave")


def test_scores_do_not_depend_on_padding_width_or_other_captions():
    model = random_model(5, module="sgr")
    images, captions, lengths = random_batch(model, 4, [5, 3, 8], pad_to=8, seed=3)
    wide = torch.nn.functional.pad(captions, (0, 6))
    full = model.score(images, captions, lengths)
    assert_close(model.score(images, wide, lengths), full, SAME_PATH)
    assert_close(model.score(images, captions[1:2], lengths[1:2]), full[:, 1:2], SAME_PATH)
    assert_close(model.score(images[2:3], captions, lengths), full[2:3], SAME_PATH)


def test_garbage_beyond_length_in_word_embeddings_is_ignored():
    model = random_model(6, module="saf")
    images, captions, lengths = random_batch(model, 3, [4, 6, 3], seed=4)
    with torch.no_grad():
        img, cap = model.encode_images(images), model.encode_captions(captions, lengths)
        dirty = cap.clone()
        for row, length in enumerate(lengths.tolist()):
            dirty[row, length:] = 5.0
        assert_close(model.similarity(img, dirty, lengths), model.similarity(img, cap, lengths), SAME_PATH)


def test_encode_captions_trims_to_the_longest_and_zeroes_padding():
    model = random_model(7)
    _, captions, lengths = random_batch(model, 1, [3, 5], pad_to=9)
    with torch.no_grad():
        words = model.encode_captions(captions, lengths)
    assert words.shape == (2, 5, model.config.embed_size)
    assert words[0, 3:].abs().max() == 0
    assert_close(words.norm(dim=2)[1], torch.ones(5), REORDERED)


def test_score_uses_eval_numerics_and_restores_training_mode():
    model = random_model(8, module="saf", dropout=0.4).train()
    images, captions, lengths = random_batch(model, 3, [4, 6])
    before = model.sim_enc.SAF_module.bn.running_mean.clone()
    first = model.score(images, captions, lengths)
    second = model.score(images, captions, lengths)
    assert model.training
    torch.testing.assert_close(first, second, atol=0, rtol=0)       # dropout off, BN on running stats
    assert torch.equal(model.sim_enc.SAF_module.bn.running_mean, before)


def test_default_initialisation_follows_the_authors():
    model = SGRAF(ModelConfig(vocab_size=50, img_dim=40, embed_size=24, sim_dim=10, word_dim=12, num_regions=4))
    fc = model.img_enc.fc
    bound = math.sqrt(6.0 / (40 + 24))
    assert fc.weight.abs().max() <= bound and fc.weight.abs().max() > 0.8 * bound
    for name, tensor in model.named_parameters():
        if name.endswith("bias") and "cap_rnn" not in name:
            assert tensor.abs().max() == 0, name
    bn = model.sim_enc.v_global_w.embedding_local[1]
    assert torch.equal(bn.weight, torch.ones(4)) and torch.equal(bn.bias, torch.zeros(4))
    assert model.txt_enc.embed.weight.abs().max() <= 0.1
    assert model.txt_enc.cap_rnn.bias_ih_l0.abs().max() > 0           # GRU keeps PyTorch's default


def test_scalar_similarity_is_only_defined_with_average():
    with pytest.raises(ValueError, match="similarity='scalar'"):
        ModelConfig(vocab_size=10, module="sgr", similarity="scalar")


def test_model_state_dict_has_no_unused_parameters_per_config():
    local = random_model(0, module="ave", alignments="local", similarity="scalar")
    names = set(local.state_dict())
    assert not any("v_global_w" in n or "sim_tranloc_w" in n or "sim_eval_w" in n for n in names)
    joint = random_model(0, module="joint", sgr_step=2)
    names = set(joint.state_dict())
    assert {"sim_enc.SGR_module.1.sim_graph_w.weight", "sim_enc.SAF_module.bn.running_var",
            "sim_enc.saf_eval_w.weight", "sim_enc.sim_eval_w.weight"} <= names


# ---------------------------------------------------------------- input validation
@pytest.fixture(scope="module")
def small():
    model = random_model(9, img_dim=20, num_regions=5, vocab_size=30)
    images, captions, lengths = random_batch(model, 2, [4, 3], pad_to=6)
    return model, images, captions, lengths


@pytest.mark.parametrize("case, message", [
    ("img_dim", r"feature dimension is 21, the model expects img_dim=20"),
    ("regions", r"4 regions per image, the model expects K=5"),
    ("nan", r"NaN or inf \(images \[1\]\)"),
    ("inf", r"NaN or inf"),
    ("token_high", r"token id 30 is outside the vocabulary \[0, 30\)"),
    ("token_negative", r"token id -1 is outside"),
    ("zero_length", r"caption 1 has length 0"),
    ("negative_length", r"caption 0 has length -2"),
    ("too_long", r"caption 0 has length 7, longer than the padded captions tensor \(L=6\)"),
    ("count", r"lengths has 3 entries but there are 2 captions"),
    ("float_lengths", r"lengths must be a 1-D sequence of integers"),
    ("float_captions", r"captions must be an integer tensor"),
    ("images_2d", r"images must be a float tensor"),
])
def test_bad_input_raises_value_error_naming_the_problem(small, case, message):
    model, images, captions, lengths = small
    images, captions, lengths = images.clone(), captions.clone(), lengths.clone()
    if case == "img_dim":
        images = torch.randn(2, 5, 21)
    elif case == "regions":
        images = images[:, :4]
    elif case == "nan":
        images[1, 2, 3] = float("nan")
    elif case == "inf":
        images[0, 0, 0] = float("inf")
    elif case == "token_high":
        captions[0, 1] = 30
    elif case == "token_negative":
        captions[1, 1] = -1
    elif case == "zero_length":
        lengths[1] = 0
    elif case == "negative_length":
        lengths[0] = -2
    elif case == "too_long":
        lengths[0] = 7
    elif case == "count":
        lengths = torch.tensor([4, 3, 3])
    elif case == "float_lengths":
        lengths = lengths.float()
    elif case == "float_captions":
        captions = captions.float()
    elif case == "images_2d":
        images = images[0]
    with pytest.raises(ValueError, match=message) as info:
        model.score(images, captions, lengths)
    assert isinstance(info.value, InputError)


def test_tokens_beyond_a_caption_length_are_not_checked(small):
    model, images, captions, lengths = small
    captions = captions.clone()
    captions[1, 5] = 999                     # padding region of a length-3 caption
    assert model.score(images, captions, lengths).shape == (2, 2)


def test_validation_happens_before_any_work(small, monkeypatch):
    model, images, captions, lengths = small
    called = []
    monkeypatch.setattr(model.img_enc, "forward", lambda *a: called.append(1))
    with pytest.raises(ValueError):
        model.score(images, captions, torch.tensor([4, 0]))
    assert not called


FAST_CONFIGS = [dict(module="sgr"), dict(module="saf"), dict(module="joint"), dict(module="ave"),
                dict(module="sgr", alignments="local", sgr_step=2)]


@pytest.mark.parametrize("config", FAST_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_eval_chunks_and_given_global_vectors_change_no_score(monkeypatch, config):
    """The eval path in many cache-sized chunks, and with global vectors computed beforehand
    (as the split scorer does), gives the per-caption oracle's scores."""
    from sgraf.kernels import eval_chunks

    model = random_model(5, num_regions=7, **config)
    images, captions, lengths = random_batch(model, 9, LENGTHS + [4, 12, 7], pad_to=13, seed=4)
    with torch.no_grad():
        expected = oracle_forward(model, images, captions, lengths)
        img_embs, cap_embs = model.encode_images(images), model.encode_captions(captions, lengths)
        # a budget of 6 (image, caption) pairs: chunks of 2 images x 3 captions (fewer at the edges)
        budget = 6 * 13 * model.config.embed_size * 4
        monkeypatch.setattr(eval_chunks, "EVAL_CHUNK_BYTES", budget)
        monkeypatch.setattr(eval_chunks, "EVAL_CHUNK_IMAGES", 2)
        assert model.eval_chunk_bytes(torch.float32) == budget
        grid = eval_chunks.chunk_grid(9, len(lengths), 13, model.config.embed_size, torch.float32,
                                      torch.device("cpu"), budget)
        chunks = list(grid)
        assert len(chunks) > 10
        covered = torch.zeros(9, len(lengths), dtype=torch.int64)
        for rows, cols in chunks:
            covered[rows, cols] += 1
        assert (covered == 1).all()
        chunked = model.similarity_heads(img_embs, cap_embs, lengths)
        img_glo, cap_glo = model.image_globals(img_embs), model.caption_globals(cap_embs, lengths)
        gram = model.region_grams(img_embs)
        given = model.similarity_heads(img_embs, cap_embs, lengths, img_glo=img_glo, cap_glo=cap_glo, gram=gram)
    assert (img_glo is None) == (config.get("alignments") == "local")
    assert gram.shape == (9, 7, 7)
    for head in expected:
        assert_close(chunked[head], expected[head], REORDERED, what=head)
        assert_close(given[head], chunked[head], SAME_PATH, what=head)


def test_frozen_weights_prepare_constants_once_and_only_inside(monkeypatch):
    """Inside `frozen_weights` the folded SGR weights are computed once per precision; outside,
    every call sees the current weights (a change through `.data` included)."""
    from sgraf.kernels import graph_steps

    model = random_model(6, module="sgr", num_regions=7).eval()
    images, captions, lengths = random_batch(model, 3, LENGTHS, pad_to=13, seed=5)
    folds = []
    fold_steps = graph_steps.fold_steps
    monkeypatch.setattr(graph_steps, "fold_steps", lambda *args: folds.append(1) or fold_steps(*args))
    with torch.no_grad():
        img_embs, cap_embs = model.encode_images(images), model.encode_captions(captions, lengths)
        plain = model.similarity(img_embs, cap_embs, lengths)
        with model.frozen_weights(), model.frozen_weights():  # re-entrant
            frozen = [model.similarity(img_embs, cap_embs, lengths) for _ in range(3)]
            with autocast("bf16"):
                model.similarity(img_embs, cap_embs, lengths)
        assert len(folds) == 1 + 2  # the plain call, then once per precision inside
        model.sim_enc.SGR_module[0].graph_key_w.weight.data.mul_(3.0)
        changed = model.similarity(img_embs, cap_embs, lengths)
        expected = oracle_forward(model, images, captions, lengths)["sgr"]
    for scores in frozen:
        torch.testing.assert_close(scores, plain, atol=0, rtol=0)
    assert_close(changed, expected, REORDERED)
    assert (changed - plain).abs().max() > 1e-4


def test_fast_forward_alone_gives_the_plain_nodes():
    """`fast_forward` without precomputed global nodes, Gram matrices or cast weights computes
    them itself and gives the nodes of the plain forward pass."""
    from sgraf.model.sgraf import _masked_words

    model = random_model(7, module="sgr", num_regions=7).eval()
    images, captions, lengths = random_batch(model, 3, LENGTHS, pad_to=13, seed=6)
    with torch.no_grad():
        img_embs = model.encode_images(images)
        words, word_mask, _ = _masked_words(model.encode_captions(captions, lengths), lengths)
        nodes, node_mask = model.sim_enc(img_embs, words, word_mask)
        fast, fast_mask, places = model.sim_enc.fast_forward(img_embs, words, word_mask, torch.float32)
    assert places is None
    assert torch.equal(fast_mask, node_mask)
    valid = node_mask.unsqueeze(0).unsqueeze(3)
    assert_close(fast * valid, nodes * valid, REORDERED)


def test_eval_constants_do_not_depend_on_the_callers_autocast():
    """The folded SGR weights and cast similarity layers are float32 math cast once to the matmul
    dtype, whether prepared inside a bf16 autocast region (a scorer's tuning) or not."""
    model = random_model(8, module="sgr", num_regions=7)
    plain = model.eval_constants(torch.bfloat16)
    with autocast("bf16"):
        under = model.eval_constants(torch.bfloat16)
    flat = [t for pair in plain["layers"].values() for t in pair] + [t for step in plain["folded"] for t in step
                                                                     if isinstance(t, torch.Tensor)]
    flat_under = [t for pair in under["layers"].values() for t in pair] + [
        t for step in under["folded"] for t in step if isinstance(t, torch.Tensor)]
    assert len(flat) == len(flat_under) > 4
    assert all(torch.equal(a, b) for a, b in zip(flat, flat_under))


def test_l2norms_written_out_gradient_is_autograds():
    """`norms.l2norm`'s backward (`_L2Norm`, fewer launches) is the gradient of its forward:
    gradcheck in float64, and the same values as autograd through the plain formula, along either
    dimension; a bf16 input gets a bf16 gradient."""
    from sgraf.model.norms import EPS, l2norm

    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    for dim in (-1, 1):
        assert torch.autograd.gradcheck(lambda t: l2norm(t, dim), (x,))
        grad = torch.randn(3, 5, 7, dtype=torch.float64)
        ours, = torch.autograd.grad(l2norm(x, dim), x, grad)
        plain, = torch.autograd.grad(x / ((x * x).sum(dim=dim, keepdim=True).sqrt() + EPS), x, grad)
        assert_close(ours, plain, REORDERED)
        assert torch.equal(l2norm(x, dim), (x / ((x * x).sum(dim=dim, keepdim=True).sqrt() + EPS)))  # same forward
    low = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    l2norm(low).sum().backward()
    assert low.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_l2norm_gradient_is_its_formula_bit_for_bit(dtype):
    """`_L2Norm.backward` reuses a buffer for `y * along`: the bits of the formula written out,
    `g / (n + eps) - y (y . g) / n`, in float32 and with a bf16 input beside a float32 gradient."""
    from sgraf.model.norms import EPS, FLOAT32_TINY, l2norm

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 64, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(4, 5, 64, generator=generator)
    out = l2norm(x)
    ours, = torch.autograd.grad(out, x, grad.to(out.dtype))
    with torch.no_grad():
        norm = (x * x).sum(dim=-1, keepdim=True).sqrt()
        y, g = out, grad.to(out.dtype)
        along = (y * g).sum(dim=-1, keepdim=True) / norm.clamp_min(FLOAT32_TINY)
        formula = (g / (norm + EPS) - y * along).to(dtype)
    assert ours.dtype == dtype and torch.equal(ours, formula)


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_all_zero_regions_train_with_finite_gradients(module):
    """An all-zero region (padding, a file cut short) meets the image encoder's zero initial bias:
    its embedding is 0, where autograd's gradient of the norm is NaN, and the first step had
    turned every weight NaN. The gradient there is its limit, g / eps."""
    from sgraf.model.norms import EPS, l2norm

    zero = torch.zeros(2, 3, requires_grad=True)
    grad = torch.randn(2, 3)
    assert torch.equal(torch.autograd.grad(l2norm(zero), zero, grad)[0], grad / EPS)
    from sgraf.model.norms import FLOAT32_TINY

    small = torch.tensor([0.0, 1e-45, 1e-39, 1e-30, 1e-20, 1e-17, 1e-12, 3e-5, 1.0])   # squared norms
    for dtype in (torch.float32, torch.bfloat16, torch.float16):   # the floor changes no forward bit
        values = small.to(dtype)
        assert torch.equal(values.clamp(min=FLOAT32_TINY).sqrt() + EPS, values.clamp(min=0).sqrt() + EPS), dtype
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=30, img_dim=20, word_dim=8, embed_size=16, sim_dim=12, num_regions=5,
                              module=module))
    images, captions, lengths = random_batch(model, 3, [5, 4, 6])
    images[0, 3:] = 0        # two padded regions
    images[1] = 0            # an image of nothing
    model.train()
    sims = model.similarity(model.encode_images(images), model.encode_captions(captions, lengths), lengths)
    sims.sum().backward()
    assert torch.isfinite(sims).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), module
