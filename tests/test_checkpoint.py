"""Checkpoints: our format, the authors' format, refusals, atomic writes, the converter command."""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest
import torch

from model_helpers import DATA, random_batch, random_model
from sgraf.checkpoint import atomic_save, convert_official, load_checkpoint, load_model, non_finite_tensor, save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.vocab import Vocabulary, load_vocab
from sgraf.errors import InputError

pytestmark = pytest.mark.numeric

E2E_VOCAB = DATA / "e2e" / "data" / "toy_vocab.json"


def test_save_and_load_roundtrip_keeps_config_weights_vocab_and_scores(tmp_path):
    model = random_model(1, module="joint", sgr_step=2, vocab_size=181)
    vocab = load_vocab(E2E_VOCAB)
    path = tmp_path / "model.pt"
    save_model(model, path, vocab=vocab, extra={"epoch": 3})
    raw = torch.load(path, weights_only=True)                 # plain data only
    assert raw["format"] == "sgraf" and raw["version"] == 2 and raw["extra"] == {"epoch": 3}
    assert raw["config"] == model.config.to_dict()
    # the vocabulary as one string: quick for the weights-only unpickler
    assert isinstance(raw["vocab"], str) and json.loads(raw["vocab"]) == vocab.to_dict()
    assert load_checkpoint(path)["vocab"] == vocab.to_dict()
    loaded = load_model(path)
    assert not loaded.training and loaded.config == model.config
    assert isinstance(loaded.vocab, Vocabulary) and loaded.vocab == vocab
    images, captions, lengths = random_batch(model, 3, [4, 3, 6])
    torch.testing.assert_close(loaded.score(images, captions, lengths), model.score(images, captions, lengths),
                               atol=0, rtol=0)


def test_model_vocab_is_saved_when_no_vocab_is_given(tmp_path):
    model = random_model(1, vocab_size=181)
    model.vocab = load_vocab(E2E_VOCAB)
    save_model(model, tmp_path / "m.pt")
    assert load_checkpoint(tmp_path / "m.pt")["vocab"] == model.vocab.to_dict()
    plain = random_model(1)
    save_model(plain, tmp_path / "p.pt")
    assert load_model(tmp_path / "p.pt").vocab is None


def test_vocab_of_the_wrong_size_is_refused(tmp_path):
    model = random_model(1, vocab_size=30)
    save_model(model, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="vocabulary has 181 words but the model's embedding has vocab_size=30"):
        load_model(tmp_path / "m.pt", vocab=E2E_VOCAB)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_official_checkpoint_normalises_to_our_format(module):
    checkpoint = load_checkpoint(DATA / f"official_ckpt_{module}.pth.tar")
    config = ModelConfig.from_dict(checkpoint["config"])
    assert (config.module, config.img_dim, config.word_dim, config.embed_size, config.sim_dim, config.vocab_size) == \
        (module.lower(), 48, 16, 32, 8, 40)
    assert checkpoint["extra"]["official"]["opt"]["module_name"] == module
    assert "img_enc.fc.weight" in checkpoint["state_dict"]


def test_convert_command_writes_a_weights_only_checkpoint_with_vocab(tmp_path, capsys):
    dst = tmp_path / "sgr.pt"
    assert main(["convert-checkpoint", str(DATA / "e2e" / "sgr.pth.tar"), str(dst), "--vocab", str(E2E_VOCAB)]) == 0
    assert "module sgr" in capsys.readouterr().out
    raw = torch.load(dst, weights_only=True)
    assert raw["version"] == 2 and raw["config"]["sgr_step"] == 4
    assert json.loads(raw["vocab"])["word2idx"]["<start>"] == 1
    official = load_model(DATA / "e2e" / "sgr.pth.tar")
    converted = load_model(dst)
    assert isinstance(converted.vocab, Vocabulary) and len(converted.vocab) == 181
    for key, tensor in official.state_dict().items():
        assert torch.equal(converted.state_dict()[key], tensor), key
    # converting again replaces its own output with --overwrite only; the authors' file named as DST by a slip
    # is refused either way
    capsys.readouterr()
    before = dst.read_bytes()
    dst.touch()
    assert main(["convert-checkpoint", str(DATA / "e2e" / "sgr.pth.tar"), str(dst), "--vocab", str(E2E_VOCAB)]) == 2
    assert f"DST {dst} exists (an sgraf checkpoint): pass --overwrite" in capsys.readouterr().err
    assert dst.read_bytes() == before
    assert main(["convert-checkpoint", str(DATA / "e2e" / "sgr.pth.tar"), str(dst), "--vocab", str(E2E_VOCAB),
                 "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(dst), "module": "sgr", "parameters": sum(
        t.numel() for name, t in official.state_dict().items() if "running" not in name and "num_batches" not in name),
        "vocab_size": 181, "vocabulary_words": 181}
    authors = tmp_path / "model_best.pth.tar"
    authors.write_bytes((DATA / "e2e" / "saf.pth.tar").read_bytes())
    capsys.readouterr()
    assert main(["convert-checkpoint", str(dst), str(authors), "--overwrite"]) == 2
    assert "exists and is not an sgraf checkpoint" in capsys.readouterr().err
    assert authors.read_bytes() == (DATA / "e2e" / "saf.pth.tar").read_bytes()
    assert main(["convert-checkpoint", str(authors), str(tmp_path), "--vocab", str(E2E_VOCAB)]) == 2
    assert f"DST {tmp_path} is a folder; give the checkpoint file to write" in capsys.readouterr().err


def test_convert_command_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["convert-checkpoint", str(tmp_path / "missing.pth.tar"), str(tmp_path / "x.pt")]) == 2
    assert "missing.pth.tar" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_convert_command_never_writes_over_a_run_folders_checkpoint(tmp_path, capsys):
    """A converted checkpoint over a run's best.pt would leave `sgraf runs` describing that run
    with another model's weights."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("module: sgr\n")
    (run / "best.pt").write_bytes(b"the run's own best")
    assert main(["convert-checkpoint", str(DATA / "e2e" / "sgr.pth.tar"), str(run / "best.pt"),
                 "--vocab", str(E2E_VOCAB)]) == 2
    assert f"DST {run / 'best.pt'} is a file of the run folder" in capsys.readouterr().err
    assert (run / "best.pt").read_bytes() == b"the run's own best"
    assert main(["convert-checkpoint", str(DATA / "e2e" / "sgr.pth.tar"), str(run / "converted.pt"),
                 "--vocab", str(E2E_VOCAB)]) == 0   # another name in the folder is no run file


class Payload:
    """Any class other than argparse.Namespace must be refused."""


@pytest.mark.parametrize("restricted", [False, True], ids=["weights-only", "restricted-unpickler"])
def test_pickles_other_than_namespace_are_refused(tmp_path, monkeypatch, restricted):
    if restricted:   # as under PyTorch 2.3 (`torch_compat.load_allowing`), on any PyTorch
        from sgraf import torch_compat

        monkeypatch.setattr(torch_compat, "can_allow_classes", lambda: False)
    path = tmp_path / "evil.pth.tar"
    torch.save({"model": [{}, {}, {}], "opt": argparse.Namespace(), "hook": Payload()}, path)
    with pytest.raises(ValueError, match=r"refusing to load: the checkpoint pickles the class "
                                         r"test_checkpoint.Payload; only tensors"):
        load_checkpoint(path)
    opt_only = tmp_path / "official_like.pth.tar"
    torch.save({"model": [{}, {}, {}], "opt": argparse.Namespace(module_name="SGR")}, opt_only)
    with pytest.raises(ValueError, match=f"^{re.escape(str(opt_only))}: official checkpoint options lack the field "
                                         "'vocab_size'$"):
        load_checkpoint(opt_only)         # Namespace itself is accepted
    options = dict(module_name="SGR", vocab_size=20, img_dim=8, word_dim=6, embed_size=8, sim_dim=4, num_layers=1,
                   bi_gru=True, no_imgnorm=False, no_txtnorm=False)
    for change, expected in ((dict(vocab_size="20"), "option vocab_size must be a whole number, got '20'"),
                             (dict(sim_dim=float("nan")), "option sim_dim must be a whole number, got nan"),
                             (dict(bi_gru="yes"), "option bi_gru must be true or false, got 'yes'"),
                             (dict(embed_size=0), "model config field 'embed_size' must be a positive integer"),
                             (dict(module_name="VSE"), "option module_name must be 'SGR' or 'SAF', got 'VSE'")):
        torch.save({"model": [{}, {}, {}], "opt": argparse.Namespace(**{**options, **change})}, opt_only)
        with pytest.raises(ValueError, match=f"^{re.escape(str(opt_only))}: .*{re.escape(expected)}"):
            load_checkpoint(opt_only)


def test_other_files_are_refused_clearly(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        load_model(text)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="neither an sgraf checkpoint"):
        load_model(other)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "absent.pt")


def test_a_checkpoint_cut_short_is_named_as_such(tmp_path):
    whole = tmp_path / "whole.pt"
    save_model(random_model(1, sim_dim=12), whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=rf"cut\.pt: not a readable PyTorch checkpoint \(a torch\.save archive cut "
                                         rf"short: its {len(data) // 2:,} bytes end before the archive's directory"):
        load_model(cut)
    load_model(whole)   # the whole file still loads


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    model = random_model(1, sim_dim=12)
    save_model(model, tmp_path / "m.pt")
    raw = torch.load(tmp_path / "m.pt", weights_only=True)
    raw["config"]["sim_dim"] = 16
    torch.save(raw, tmp_path / "bad.pt")
    with pytest.raises(InputError, match=r"tensor 'sim_enc.sim_tranloc_w.weight' has shape \(12, 16\) but the "
                                         r"configuration expects \(16, 16\)"):
        load_model(tmp_path / "bad.pt")
    raw["config"]["sim_dim"] = 12
    raw["state_dict"].pop("sim_enc.sim_eval_w.bias")
    torch.save(raw, tmp_path / "missing.pt")
    with pytest.raises(InputError, match=r"missing \['sim_enc.sim_eval_w.bias'\]"):
        load_model(tmp_path / "missing.pt")


def test_official_options_that_disagree_with_tensors_are_reported(tmp_path):
    raw = torch.load(DATA / "official_ckpt_SAF.pth.tar", weights_only=False)
    raw["opt"].embed_size = 64
    torch.save(raw, tmp_path / "bad.pth.tar")
    with pytest.raises(InputError, match=r"'img_enc.fc.weight' has shape \(32, 48\) but the configuration expects \(64, 48\)"):
        load_model(tmp_path / "bad.pth.tar")


def test_atomic_save_leaves_no_partial_file_on_failure(tmp_path):
    path = tmp_path / "out.pt"
    atomic_save({"a": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        atomic_save({"a": Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(2))   # old file intact
    assert os.listdir(tmp_path) == ["out.pt"]                                    # no temp left


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_raw_pickle_is_not_a_safe_checkpoint_and_nothing_suggests_weights_only_false(tmp_path, capsys, protocol):
    import pickle

    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps({"state_dict": {"w": [1.0, 2.0]}, "note": "from pickle.dump"}, protocol=protocol))
    with pytest.raises(InputError, match=r"model\.pkl: not a safe checkpoint: it is a raw Python pickle, a "
                                         r"format that can run code when loaded") as caught:
        load_checkpoint(path)
    assert "weights_only" not in str(caught.value)
    assert main(["convert-checkpoint", str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not a safe checkpoint" in err and "weights_only" not in err


def test_a_pickle_torch_cannot_read_safely_never_echoes_torchs_advice(tmp_path):
    import pickle

    path = tmp_path / "hook.pt"
    path.write_bytes(pickle.dumps(Payload(), protocol=4))   # a class pickled without torch.save
    with pytest.raises(InputError) as caught:
        load_model(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not a safe checkpoint") and "weights_only" not in message


def test_backbone_weights_are_read_as_safely_as_checkpoints(tmp_path):
    import pickle

    from sgraf.weights_file import load_weights_only

    path = tmp_path / "lite0.pth"
    path.write_bytes(pickle.dumps({"conv.weight": [0.0]}, protocol=5))
    with pytest.raises(InputError, match=r"lite0\.pth: not a safe weights file: .*; only tensors, plain values "
                                         r"are allowed$"):
        load_weights_only(path, what="weights file")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_holding_nan_or_inf_are_refused_naming_file_and_tensor(tmp_path, capsys, bad):
    model = random_model(2)
    path = tmp_path / "model.pt"
    save_model(model, path, vocab=Vocabulary.from_words([f"w{i}" for i in range(26)]))
    raw = torch.load(path, weights_only=True)
    raw["state_dict"]["sim_enc.sim_eval_w.weight"][0, 3] = bad
    torch.save(raw, path)
    message = (rf"{path}: tensor 'sim_enc.sim_eval_w.weight' \(1 NaN/inf of \d+ values\); expected finite weights")
    with pytest.raises(InputError, match=message):
        load_model(path)
    assert main(["convert-checkpoint", str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "'sim_enc.sim_eval_w.weight'" in err and err.count("\n") == 1
    assert not (tmp_path / "out.pt").exists()
    # a BatchNorm statistic is a weight too; and the authors' files are checked the same way
    official = torch.load(DATA / "official_ckpt_SGR.pth.tar", weights_only=False)
    next(t for t in official["model"][2].values() if t.is_floating_point()).fill_(bad)
    torch.save(official, tmp_path / "official.pth.tar")
    with pytest.raises(InputError, match=r"official\.pth\.tar: tensor 'sim_enc\."):
        load_model(tmp_path / "official.pth.tar")


def test_a_version_1_checkpoint_with_its_vocabulary_as_a_dict_still_loads_and_converts_to_version_2(tmp_path):
    model = random_model(1, vocab_size=181)
    vocab = load_vocab(E2E_VOCAB)
    save_model(model, tmp_path / "new.pt", vocab=vocab)
    raw = torch.load(tmp_path / "new.pt", weights_only=True)
    atomic_save({**raw, "version": 1, "vocab": vocab.to_dict()}, tmp_path / "old.pt")   # as sgraf wrote it before
    assert load_checkpoint(tmp_path / "old.pt")["vocab"] == vocab.to_dict()
    loaded = load_model(tmp_path / "old.pt")
    assert loaded.vocab == vocab
    convert_official(tmp_path / "old.pt", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)
    assert converted["version"] == 2 and json.loads(converted["vocab"]) == vocab.to_dict()


@pytest.mark.parametrize(("version", "vocab", "message"), [
    (2, "{not json", r"checkpoint field 'vocab' is not valid JSON \("),
    (2, "[1, 2]", r"checkpoint field 'vocab' must be the JSON text of a vocabulary or null, got list"),
    (2, 7, r"checkpoint field 'vocab' must be the JSON text of a vocabulary or null, got int"),
    (1, "{}", r"checkpoint field 'vocab' must be the vocabulary's content \(a dict\) or null, got str"),
    (3, None, r"checkpoint version 3 is not supported \(this sgraf reads up to 2\)"),
])
def test_a_bad_vocabulary_field_or_a_later_version_is_refused_naming_the_file(tmp_path, capsys, version, vocab,
                                                                              message):
    save_model(random_model(1), tmp_path / "model.pt")
    raw = torch.load(tmp_path / "model.pt", weights_only=True)
    atomic_save({**raw, "version": version, "vocab": vocab}, tmp_path / "model.pt")
    with pytest.raises(InputError, match=rf"model\.pt: {message}"):
        load_model(tmp_path / "model.pt")
    assert main(["convert-checkpoint", str(tmp_path / "model.pt"), str(tmp_path / "out.pt")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "out.pt").exists()


def test_the_finite_check_finds_each_bad_value_and_passes_sums_that_overflow_float32():
    finite = {"a": torch.full((4, 5), 3e38), "b": torch.ones(3, dtype=torch.float64) * 1e300,
              "c": torch.ones(2, dtype=torch.bfloat16), "steps": torch.tensor(7)}   # sums overflow float32
    assert non_finite_tensor(finite) is None
    assert non_finite_tensor({}) is None and non_finite_tensor({"n": torch.tensor([1, 2])}) is None
    for name in ("a", "b", "c"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = {key: tensor.clone() for key, tensor in finite.items()}
            broken[name].view(-1)[1] = bad
            assert non_finite_tensor(broken) == f"{name!r} (1 NaN/inf of {broken[name].numel()} values)"
    # infinities of both signs sum to NaN; two in one tensor are counted
    both = {"a": torch.tensor([float("inf"), 1.0, float("-inf")])}
    assert non_finite_tensor(both) == "'a' (2 NaN/inf of 3 values)"


def test_a_model_with_non_finite_weights_is_never_written(tmp_path):
    model = random_model(3)
    with torch.no_grad():
        model.img_enc.fc.bias[1] = float("nan")
    with pytest.raises(ValueError, match=r"refusing to write .*bad\.pt: tensor 'img_enc\.fc\.bias' \(1 NaN/inf"):
        save_model(model, tmp_path / "bad.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_given_vocabulary_that_differs_from_the_stored_one_is_refused(tmp_path, caplog, capsys):
    """Same size, other word ids: every score would be wrong without an error, so it is refused
    where it is read and where it would be stored (convert-checkpoint had swapped it in silently,
    and the refusal had named that command as the way)."""
    words = [f"w{i}" for i in range(26)]
    save_model(random_model(4), tmp_path / "model.pt", vocab=Vocabulary.from_words(words))
    Vocabulary.from_words(reversed(words)).save(tmp_path / "other.json")   # same size, other word ids
    Vocabulary.from_words(words).save(tmp_path / "same.json")
    with caplog.at_level("WARNING", logger="sgraf.checkpoint"):
        load_model(tmp_path / "model.pt", vocab=Vocabulary.from_words(words))
    assert caplog.text == ""
    with pytest.raises(InputError, match=r"model\.pt carries its own vocabulary, which differs from "
                                         r".*other\.json \(other word ids: the scores would be wrong\); leave out "
                                         r"--vocab: the checkpoint's own is the one its model learned$"):
        load_model(tmp_path / "model.pt", vocab=tmp_path / "other.json")
    assert main(["convert-checkpoint", str(tmp_path / "model.pt"), str(tmp_path / "new.pt"),
                 "--vocab", str(tmp_path / "other.json")]) == 2
    assert "model.pt carries its own vocabulary, which differs from" in capsys.readouterr().err
    assert not (tmp_path / "new.pt").exists()
    assert main(["convert-checkpoint", str(tmp_path / "model.pt"), str(tmp_path / "new.pt"),
                 "--vocab", str(tmp_path / "same.json")]) == 0
    assert load_model(tmp_path / "new.pt").vocab.word2idx == Vocabulary.from_words(words).word2idx


def test_loading_draws_no_initial_weights_and_holds_exactly_the_saved_ones(tmp_path, monkeypatch):
    """`load_model` builds the model without drawing the weights the checkpoint overwrites: the
    global random generator is where it was, every parameter and buffer is the saved one, and
    the parameters train. A model with a buffer no state dict holds is built the usual way."""
    from sgraf import checkpoint

    model = random_model(3, module="saf")
    save_model(model, tmp_path / "m.pt")
    first_draw = torch.manual_seed(11) and torch.rand(1)
    torch.manual_seed(11)
    loaded = load_model(tmp_path / "m.pt")
    assert torch.equal(torch.rand(1), first_draw)                      # the generator was not advanced
    saved, held = model.state_dict(), loaded.state_dict()
    assert saved.keys() == held.keys() and all(torch.equal(saved[k], held[k]) for k in saved)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in loaded.parameters())
    assert torch.rand(3).uniform_().abs().sum() > 0                   # draws work again after loading

    built = []
    real = checkpoint.load_state_checked
    monkeypatch.setattr(checkpoint, "load_state_checked", lambda m, *a, **k: built.append(m) or real(m, *a, **k))
    batch_norm = torch.nn.BatchNorm1d.__init__

    def with_a_buffer_of_its_own(self, *args, **kwargs):
        batch_norm(self, *args, **kwargs)
        self.register_buffer("own", torch.ones(1), persistent=False)

    monkeypatch.setattr(torch.nn.BatchNorm1d, "__init__", with_a_buffer_of_its_own)
    torch.manual_seed(11)
    again = load_model(tmp_path / "m.pt")
    assert not torch.equal(torch.rand(1), first_draw)                  # drawn as usual
    assert len(built) == 1 and built[0] is again
    assert all(torch.equal(saved[k], again.state_dict()[k]) for k in saved)


class _Runs:
    """Unpickled, it would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_before_pytorch_2_4_the_authors_options_are_read_by_a_restricted_unpickler(tmp_path, monkeypatch):
    """PyTorch 2.3's `weights_only` accepts no class, so the authors' checkpoints (an
    `argparse.Namespace` of options) are read there by an unpickler that resolves PyTorch's
    allowed globals and Namespace alone (`torch_compat.load_allowing`); forced here on any
    PyTorch: the same checkpoint, and nothing else resolved or run (other classes:
    `test_pickles_other_than_namespace_are_refused`)."""
    from sgraf import torch_compat

    expected = load_checkpoint(DATA / "official_ckpt_SGR.pth.tar")
    monkeypatch.setattr(torch_compat, "can_allow_classes", lambda: False)
    restricted = load_checkpoint(DATA / "official_ckpt_SGR.pth.tar")
    assert restricted["config"] == expected["config"] and restricted["extra"] == expected["extra"]
    assert restricted["state_dict"].keys() == expected["state_dict"].keys()
    assert all(torch.equal(restricted["state_dict"][k], v) for k, v in expected["state_dict"].items())
    evil = tmp_path / "evil.pth.tar"
    marker = tmp_path / "ran"
    torch.save({"model": [{}, {}, {}], "opt": argparse.Namespace(), "hook": _Runs(marker)}, evil)
    with pytest.raises(ValueError, match=r"refusing to load: the checkpoint pickles the class posix.system"):
        load_checkpoint(evil)
    assert not marker.exists()


def test_map_location_names_a_device_as_the_matcher_does():
    """'cuda' on a machine without CUDA had called a good file unreadable; 'auto' had been an
    unknown tag."""
    path = DATA / "e2e" / "sgr.pth.tar"
    assert next(load_model(path, map_location="auto").parameters()).device.type == (
        "cuda" if torch.cuda.is_available() else "cpu")
    assert next(load_model(path, map_location=torch.device("cpu")).parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"^map_location 'cuda': CUDA is not available"):
            load_model(path, map_location="cuda")
    with pytest.raises(InputError, match=r"^map_location 'gpu' is not a device name"):
        load_model(path, map_location="gpu")
