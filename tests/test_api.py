"""The application API: loading, encoding texts and images, scoring, identities."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sgraf
from numerics import REORDERED, SAME_PATH, approx, assert_close
from sgraf.api import Matcher, model_identity
from sgraf.checkpoint import save_model
from sgraf.config import ModelConfig
from sgraf.data.vocab import Vocabulary
from sgraf.errors import InputError
from sgraf.model.sgraf import SGRAF

pytestmark = pytest.mark.numeric

WORDS = "a dog cat runs on the grass man woman red ball".split()


def _model(module: str, vocab: Vocabulary, seed: int, alignments: str = "both") -> SGRAF:
    torch.manual_seed(seed)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=10, word_dim=8, embed_size=12, sim_dim=6,
                              num_regions=5, module=module, sgr_step=2, alignments=alignments))
    model.vocab = vocab
    return model.eval()


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.from_words(WORDS)


@pytest.fixture(scope="module")
def features() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((4, 5, 10)).astype(np.float32)


def _ids(vocab: Vocabulary, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [vocab.encode(t) for t in texts]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64)
    for row, caption in enumerate(ids):
        padded[row, :len(caption)] = torch.tensor(caption)
    return padded, lengths


def test_score_of_an_ensemble_is_the_mean_of_the_models_scores(vocab, features):
    models = [_model("sgr", vocab, 0), _model("saf", vocab, 1)]
    texts = ["a dog runs on the grass", "a red ball", "the woman"]
    padded, lengths = _ids(vocab, texts)
    expected = [m.score(torch.from_numpy(features), padded, lengths).numpy() for m in models]
    ensemble = Matcher(models).score(features, texts)
    assert ensemble.shape == (4, 3) and ensemble.dtype == np.float64     # the exact mean, as the authors keep it
    assert_close(ensemble, (expected[0] + expected[1]) / 2, REORDERED)
    alone = [Matcher([model]).score(features, texts) for model in models]
    assert alone[0].dtype == np.float32 and np.array_equal(ensemble, (alone[0].astype(np.float64) + alone[1]) / 2)
    single = Matcher(models[:1], batch_size=3).score(features, texts)   # blocks smaller than the inputs
    assert_close(single, expected[0], REORDERED)


@pytest.mark.parametrize("alignments", ["both", "local"])
def test_text_global_vectors_do_not_depend_on_padding(vocab, alignments):
    matcher = Matcher([_model("sgr", vocab, 2, alignments=alignments)])
    alone = matcher.encode_texts(["a dog"])
    padded = matcher.encode_texts(["a dog", "the man runs on the red grass a cat"])
    assert padded.words[0].shape[1] == 11 and bool((padded.words[0][0, 4:] == 0).all())
    assert_close(alone.global_vectors[0][0], padded.global_vectors[0][0], SAME_PATH, scale=1.0)
    assert float(alone.global_vectors[0][0].norm()) == approx(1.0, REORDERED)
    assert alone.tokens == [["a", "dog"]]


def test_image_global_vector_is_the_models_self_attention_vector(vocab, features):
    model = _model("saf", vocab, 3)
    encoding = Matcher([model]).encode_images(features)
    with torch.no_grad():
        regions = model.encode_images(torch.from_numpy(features))
        expected = model.sim_enc.v_global_w(regions)
    assert_close(encoding.regions[0], regions, SAME_PATH)
    assert_close(encoding.global_vectors[0], expected, SAME_PATH, scale=1.0)


def test_unknown_words_are_named_or_mapped_to_unk(vocab, features):
    matcher = Matcher([_model("sgr", vocab, 0)])
    with pytest.raises(InputError, match=r"word\(s\) 'zebra', 'savanna', 'by' not in the model's vocabulary"):
        matcher.encode_texts(["a zebra on the savanna by a zebra"])
    tokens, ids = matcher.tokenize("a zebra", allow_unknown=True)
    assert tokens == ["a", "zebra"] and ids == [1, vocab("a"), 3, 2]
    for empty in ("", "   ", "\n"):
        with pytest.raises(InputError, match="^text is empty: give at least one word$"):
            matcher.score(features, [empty])


def test_features_of_the_wrong_shape_are_refused(vocab):
    matcher = Matcher([_model("sgr", vocab, 0)])
    with pytest.raises(InputError, match=r"must have shape \(n_images, 5, 10\) for this model, got \(2, 5, 9\)"):
        matcher.encode_images(np.zeros((2, 5, 9), np.float32))
    bad = np.zeros((1, 5, 10), np.float32)
    bad[0, 0, 0] = np.nan
    with pytest.raises(InputError, match=r"image features: feature \[image 0, region 0, dim 0\] is nan"):
        matcher.encode_images(bad)
    assert len(matcher.encode_images(np.ones((5, 10), np.float32))) == 1   # one image without batch axis


def test_load_needs_a_vocabulary_and_checks_the_ensemble(vocab, tmp_path):
    bare = _model("sgr", vocab, 0)
    bare.vocab = None
    save_model(bare, tmp_path / "sgr.pt")                                       # no vocabulary inside
    with pytest.raises(InputError, match=r"carries no vocabulary .*: vocab=PATH \(on the command line, --vocab PATH\)$"):
        Matcher.load(tmp_path / "sgr.pt")
    vocab.save(tmp_path / "vocab.json")
    matcher = Matcher.load(tmp_path / "sgr.pt", vocab=tmp_path / "vocab.json")
    assert matcher.vocab == vocab and matcher.sources == [str((tmp_path / "sgr.pt").resolve())]
    assert Matcher.load(tmp_path / "sgr.pt", vocab=vocab.to_dict()).vocab == vocab       # its dict content too
    with pytest.raises(InputError, match=r"^the vocabulary given: 5 words, but the word embedding of .*sgr\.pt has"):
        Matcher.load(tmp_path / "sgr.pt", vocab=Vocabulary.from_words(["a"]))
    other = Vocabulary.from_words(list(reversed(WORDS)))
    save_model(_model("saf", vocab, 1), tmp_path / "a.pt", vocab=vocab)
    save_model(_model("saf", other, 1), tmp_path / "b.pt", vocab=other)
    with pytest.raises(InputError, match="different vocabularies"):
        Matcher.load([tmp_path / "a.pt", tmp_path / "b.pt"])
    assert sgraf.Matcher is Matcher


def test_identity_follows_the_weights_not_the_object(vocab):
    a, b = _model("sgr", vocab, 0), _model("sgr", vocab, 0)
    assert model_identity(a)["weights_sha256"] == model_identity(b)["weights_sha256"]
    with torch.no_grad():
        b.sim_enc.sim_eval_w.bias.add_(1e-6)
    assert model_identity(a)["weights_sha256"] != model_identity(b)["weights_sha256"]
    assert model_identity(a)["config"] == a.config.to_dict()


def test_scoring_with_the_stored_global_vectors_is_scoring_without(vocab, features):
    from sgraf.api import shortlist_keys, split_shortlist_keys

    matcher = Matcher([_model("sgr", vocab, 0), _model("saf", vocab, 1)])
    images = matcher.encode_images(features)
    texts = matcher.encode_texts(["a dog runs on the grass", "a red ball", "the woman"])
    keys = shortlist_keys(images.global_vectors)
    back = split_shortlist_keys(keys, [12, 12])
    for vector, original in zip(back, images.global_vectors):
        assert_close(vector.numpy(), original.numpy(), SAME_PATH)
    assert split_shortlist_keys(keys, [12, 8]) is None
    plain = matcher.score_embeddings(images, texts)
    given = matcher.score_embeddings(images, texts, image_globals=back)
    assert_close(given, plain, REORDERED)
    # they are used: other vectors give other scores
    moved = [torch.roll(v, 1, dims=0) for v in back]
    assert np.abs(matcher.score_embeddings(images, texts, image_globals=moved) - plain).max() > 1e-4


def test_a_matcher_refuses_encodings_of_other_models(vocab, features, tmp_path):
    """An ensemble's encodings scored by one of its models (same sizes, so nothing else would
    notice) are refused; the same checkpoint loaded twice shares its encodings."""
    sgr, saf = _model("sgr", vocab, 0), _model("saf", vocab, 1)
    pair, single = Matcher([saf, sgr]), Matcher([sgr])
    images, texts = pair.encode_images(features), pair.encode_texts(["a dog", "a red ball"])
    for argv in ((images, single.encode_texts(["a dog"])), (single.encode_images(features), texts)):
        with pytest.raises(InputError, match=r"encoded by other weights than this matcher's 1 model\(s\) have now "
                                             r"\(2 model\(s\): other models, or these before their weights changed\)"):
            single.score_embeddings(*argv)
    with pytest.raises(InputError, match=r"one encoding per model of the matcher \(1\), got 2 for the images"):
        single.score_embeddings(images.regions, (texts.words[:1], texts.lengths))
    save_model(sgr, tmp_path / "sgr.pt", vocab=vocab)
    first, second = Matcher.load(str(tmp_path / "sgr.pt")), Matcher.load([tmp_path / "sgr.pt"])
    assert first.fingerprints == second.fingerprints == single.fingerprints
    scores = second.score_embeddings(first.encode_images(features), first.encode_texts(["a dog"]))
    assert_close(scores, single.score(features, ["a dog"]), SAME_PATH)
    with pytest.raises(InputError, match="checkpoints: expected a path or a list of paths, got an empty list"):
        Matcher.load([])
    padded, lengths = _ids(vocab, ["a dog"])
    with pytest.raises(InputError, match="batch_size must be a positive integer, got 0"):
        sgr.score(torch.from_numpy(features), padded, lengths, batch_size=0)
    # the model's own encoders name what they were given (not an error deep inside PyTorch)
    for images in (features, torch.from_numpy(features)[..., :8]):
        with pytest.raises(InputError, match=r"images must be a float tensor \(n_img, K, img_dim=10\), got "):
            sgr.encode_images(images)
    for captions, lengths_ in ((padded.numpy(), lengths), (padded, lengths + 5), (padded, torch.tensor([2, 2]))):
        with pytest.raises(InputError, match=r"captions must be an int tensor \(n_cap, L\) with n_cap lengths"):
            sgr.encode_captions(captions, lengths_)


def test_a_matcher_of_a_model_in_training_scores_it_in_eval_mode_and_leaves_it_as_it_was(vocab, features):
    """A training loop puts its model back in train mode; a matcher around it still scores the
    eval-mode model (no dropout, no update of BatchNorm's statistics), a batch of one included."""
    from sgraf.explain import explain_pair

    model = _model("saf", vocab, 4)
    texts = ["a dog runs on the grass", "a red ball"]
    reference = Matcher(model).score(features, texts)
    model.train()
    frozen = next(module for module in model.modules() if isinstance(module, torch.nn.BatchNorm1d))
    frozen.eval()                                                  # a BatchNorm its user froze
    matcher = Matcher(model)                                       # one model, not in a list; left in training
    assert model.training
    buffers = {name: tensor.clone() for name, tensor in model.named_buffers()}
    for _ in range(2):
        assert_close(matcher.score(features, texts), reference, SAME_PATH)
    matcher.score(features[:1], texts[:1])
    explain_pair(matcher, features[0], texts[1])
    assert model.training and all(submodule.training for submodule in model.modules() if submodule is not frozen)
    assert not frozen.training
    assert all(torch.equal(buffers[name], tensor) for name, tensor in model.named_buffers())
    # 'fp32' is fp32 inside a caller's autocast too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_close(matcher.score(features, texts), reference, SAME_PATH)


def test_a_matcher_follows_its_models_weights_as_they_change(vocab, features, tmp_path):
    """Identities and fingerprints are taken again once a weight changed: an index built before
    is refused, and so are encodings made before."""
    model = _model("sgr", vocab, 5)
    matcher = Matcher([model])
    sgraf.build_index(matcher, features, ["a dog", "a red ball", "the man", "a cat"], tmp_path / "index")
    index = sgraf.open_index(tmp_path / "index", matcher=matcher)
    assert index.search_text("a dog", top_k=2, shortlist=None)
    images, fingerprints, identity = matcher.encode_images(features), matcher.fingerprints, matcher.identities
    assert matcher.identities is identity                          # unchanged weights: kept
    # one word's embedding, past the first values of its tensor (a hash of those had missed it)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["txt_enc.embed.weight"][vocab("dog")] += 3.0
    model.load_state_dict(state)
    assert matcher.fingerprints != fingerprints
    assert matcher.identities[0]["weights_sha256"] != identity[0]["weights_sha256"]
    with pytest.raises(InputError, match="these before their weights changed"):
        matcher.score_embeddings(images, matcher.encode_texts(["a dog"]))
    with pytest.raises(InputError, match="weights"):
        sgraf.open_index(tmp_path / "index", matcher=matcher)
    with pytest.raises(InputError, match=r"was built with model 1 = .* but the model given is"):
        index.search_text("a dog", top_k=2, shortlist=None)  # the index opened before: refused too
    with pytest.raises(InputError, match="was built with model 1"):
        index.search_image(image_id=0, top_k=2, shortlist=None)


def test_a_matcher_refuses_what_it_cannot_score_right(vocab, features, tmp_path):
    other = Vocabulary.from_words(list(reversed(WORDS)))           # the same words, other ids
    with pytest.raises(InputError, match="model 1 carries its own vocabulary, which differs from the vocabulary given"):
        Matcher([_model("sgr", vocab, 0)], vocab=other)
    with pytest.raises(InputError, match="model 2 carries its own vocabulary, which differs from model 1's"):
        Matcher([_model("sgr", vocab, 0), _model("saf", other, 1)])
    vocab.save(tmp_path / "vocab.json")
    assert Matcher([_model("sgr", vocab, 0)], vocab=str(tmp_path / "vocab.json")).vocab.word2idx == vocab.word2idx
    with pytest.raises(InputError, match=r"model 1 has float16 weights; .* pass precision='bf16' or 'fp16'"):
        Matcher([_model("sgr", vocab, 0).half()])
    with pytest.raises(InputError, match="model 1 is a str, not an SGRAF network"):
        Matcher(["runs/sgr/best.pt"])
    with pytest.raises(InputError, match="precision must be one of"):
        Matcher([_model("sgr", vocab, 0)], precision="fp8")
    matcher = Matcher([_model("sgr", vocab, 0)])
    for text, message in ((None, "a text must be a str, got NoneType"), (b"a dog", "a text must be a str, got bytes")):
        with pytest.raises(InputError, match=message):
            matcher.score(features, [text])
    assert matcher.score(features, (t for t in ["a dog", "a cat"])).shape == (4, 2)     # any iterable
    # captions as data have the data's limit, not a query's
    long = " ".join(["a dog runs on the grass"] * 16)                                   # 96 words
    assert matcher.score(features, [long]).shape == (4, 1)
    with pytest.raises(InputError, match="text is too long: 96 words, the limit is 64"):
        matcher.tokenize(long)
    with pytest.raises(InputError, match="build_index takes a Matcher"):
        sgraf.build_index("runs/sgr/best.pt", features, ["a dog"] * 4, tmp_path / "index")
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        sgraf.load_model(tmp_path / "missing.pt")
    with pytest.raises(IsADirectoryError, match="a folder, where a checkpoint file is needed"):
        Matcher.load(tmp_path)
    save_model(_model("sgr", vocab, 0), tmp_path / "sgr.pt", vocab=vocab)
    with pytest.raises(InputError, match="^the vocabulary given: missing field 'word2idx'"):
        sgraf.load_model(tmp_path / "sgr.pt", vocab={"a": 1})
    assert {"Matcher", "load_model", "open_index"} <= set(dir(sgraf))


def test_an_explanation_scores_in_the_matchers_precision(vocab, features):
    from sgraf.explain import explain_pair

    models = [_model("sgr", vocab, 0), _model("saf", vocab, 1)]
    text = "a dog runs on the grass"
    for precision in ("fp32", "bf16"):
        matcher = Matcher(models, precision=precision)
        explained = explain_pair(matcher, features[2], text).scores["ensemble"]
        assert explained == approx(float(matcher.score(features[2:3], [text])[0, 0]), REORDERED), precision


def test_a_matcher_changed_after_it_was_made_says_what_changed(vocab, features):
    """Notebook use: a model cast or moved after the matcher was made, a device or precision set
    on it; each a one-line InputError naming it, not PyTorch's error fourteen frames down."""
    model = _model("sgr", vocab, 2)
    matcher = Matcher([model])
    reference = matcher.score(features, ["a dog"])
    matcher.device = "cpu"                                       # a device name, moved and resolved
    assert matcher.device == torch.device("cpu") and np.array_equal(matcher.score(features, ["a dog"]), reference)
    for attribute, value, message in (("device", "gpu", "device 'gpu' is not a device name"),
                                      ("precision", "float16", "precision"), ("batch_size", 0, "batch_size")):
        with pytest.raises(InputError, match=message):
            setattr(matcher, attribute, value)
    model.half()
    with pytest.raises(InputError, match=r"^model 1 has float16 weights; a Matcher computes from float32 weights"):
        matcher.score(features, ["a dog"])
    model.float().to("meta")
    with pytest.raises(InputError, match=r"^model 1 is on meta but the matcher computes on cpu: set matcher.device"):
        matcher.score(features, ["a dog"])


def test_the_packages_modules_are_reached_from_sgraf_and_a_loose_caption_set_is_said(vocab, features, tmp_path,
                                                                                       caplog):
    done = subprocess.run([sys.executable, "-c", "import sys, sgraf; assert callable(sgraf.training.fit); "
                           "assert callable(sgraf.evaluate.evaluate_split); print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    with caplog.at_level("WARNING", logger="sgraf.search"):
        sgraf.build_index(Matcher([_model("sgr", vocab, 0)]), features, ["a dog", "a red ball", "the man"],
                          tmp_path / "index")
    assert f"3 captions for {len(features)} images, not a whole number per image" in caplog.text


@pytest.mark.parametrize("module", ["saf", "sgr"])
def test_threads_scoring_a_model_in_training_share_one_eval_spell(vocab, features, module):
    """Each call had saved and restored the train/eval mode on its own: one call's restore put the
    model in training under another's scores (22 of 37 SAF results differed) and moved its
    BatchNorm statistics."""
    from concurrent.futures import ThreadPoolExecutor

    model = _model(module, vocab, seed=5).train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    matcher = Matcher(model)
    texts = ["a dog runs on the grass", "a man", "the red ball"]
    reference = matcher.score(features, texts)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: matcher.score(features, texts), range(24)))
    assert all(torch.equal(torch.as_tensor(result), torch.as_tensor(reference)) for result in results)
    assert model.training and all(module.training for module in model.modules())
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_the_models_own_calls_refuse_or_take_what_a_notebook_passes(vocab, features, tmp_path):
    """An SGRAF model where a Matcher goes, NumPy arrays, bf16 weights and a module that is no
    SGRAF had each failed deep in PyTorch or Python (AttributeError, RuntimeError)."""
    from sgraf.explain import explain_pair

    model = _model("sgr", vocab, seed=3)
    ids = torch.tensor([vocab.encode("a dog runs")])
    expected = model.score(torch.from_numpy(features), ids, [ids.shape[1]])
    assert torch.equal(model.score(features, ids.numpy(), [ids.shape[1]]), expected)       # NumPy as tensors
    assert explain_pair(model, features[0], "a dog runs").scores == explain_pair(
        Matcher(model), features[0], "a dog runs").scores
    with pytest.raises(InputError, match="^matcher: expected a sgraf.Matcher .or an SGRAF model., got str"):
        explain_pair("best.pt", features[0], "a dog")
    with pytest.raises(InputError, match="^the model has bfloat16 weights; sgraf computes from float32 weights"):
        _model("sgr", vocab, seed=3).to(torch.bfloat16).score(features, ids, [ids.shape[1]])
    with pytest.raises(InputError, match="expected an SGRAF model .one with a ModelConfig., got Linear"):
        save_model(torch.nn.Linear(2, 2), tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_an_unknown_word_is_named_in_a_caption_and_a_decomposed_one_is_explained(features):
    import unicodedata

    vocab = Vocabulary.from_words([*WORDS, "jalape\u00f1o"])
    matcher = Matcher(_model("sgr", vocab, seed=1))
    with pytest.raises(InputError, match="^text 'a zebra': word.s. 'zebra' not in"):      # not called a query
        matcher.tokenize("a zebra", query=False)
    decomposed = unicodedata.normalize("NFD", "a jalape\u00f1o")
    with pytest.raises(InputError, match=r"is written with combining accents, Unicode NFD, and its composed form "
                                         r"is known: unicodedata.normalize\('NFC', text\)"):
        matcher.score(features[:1], [decomposed])
    assert matcher.score(features[:1], [unicodedata.normalize("NFC", decomposed)]).shape == (1, 1)


def test_a_notebook_shows_matchers_encodings_and_steps_in_a_line(vocab, features):
    from sgraf.training.step import NonFiniteLossError, StepResult

    matcher = Matcher(_model("saf", vocab, seed=2))
    assert repr(matcher) == ("Matcher(1 model(s): saf (<in memory>); device cpu, precision fp32, vocabulary "
                             f"{len(vocab)} words)")
    assert repr(matcher.encode_images(features)) == "ImageEncoding(4 images, 1 model(s), regions (4, 5, 12))"
    assert repr(matcher.encode_texts(["a dog", "a red ball"])).startswith(
        "TextEncoding(2 texts, 1 model(s), words (2, ")
    assert repr(StepResult(0.5, 1.25)) == "StepResult(loss=0.5, grad_norm=1.25, skipped=False)"

    def bad() -> None:
        raise NonFiniteLossError("the training loss is nan")

    assert repr(StepResult(float("nan"), 0.0, check=bad)) == "StepResult(loss not finite, skipped=False)"
    assert {"training", "evaluate", "explain", "Matcher"} <= set(dir(sgraf))
