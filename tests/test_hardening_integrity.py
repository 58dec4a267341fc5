"""Issue 14, kind 1 and part of kind 4: no silent wrong result from non-finite or mismatched input.

NaN/inf region features anywhere in a file (not only where a sample looks), checkpoints holding
NaN/inf, resuming on other data, vocabularies that leave the words unknown, garbage `.npy`
files and the NaN-in-training message, through every command that reads them.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from sgraf.api import Matcher
from sgraf.checkpoint import load_model, save_model
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.data.precomp import FINITE_SAMPLE, Batch, PrecompSplit
from sgraf.data.vocab import Vocabulary, build_vocab
from sgraf.errors import InputError
from sgraf.model.sgraf import SGRAF
from sgraf.search import build_index
from sgraf.training import loop
from sgraf.training import step as training_step
from sgraf.training.config import preset
from train_helpers import make_toy_precomp

N_DEV = FINITE_SAMPLE + 6   # more images than `sgraf data check` samples: some are never looked at


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def _hidden_images(n: int) -> list[int]:
    """Images the old 64-image sample at opening never read."""
    sampled = set(np.linspace(0, n - 1, FINITE_SAMPLE).astype(int).tolist())
    return [i for i in range(n) if i not in sampled]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("integrity")
    data = make_toy_precomp(root / "data", n_train=24, n_dev=N_DEV)
    captions = (data / "train_caps.txt").read_text().splitlines()
    vocab = build_vocab(captions, min_count=1)
    vocab.save(data / "vocab.json")
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=20, word_dim=8, embed_size=16, sim_dim=8,
                              num_regions=6, module="sgr", sgr_step=1))
    save_model(model, root / "sgr.pt", vocab=vocab)
    return {"root": root, "data": data, "checkpoint": str(root / "sgr.pt"), "vocab": vocab}


def _copy_with_bad_feature(setup: dict, tmp_path: Path, split: str, image: int, bad: float = np.nan) -> Path:
    data = tmp_path / "data"
    shutil.copytree(setup["data"], data)
    images = np.load(data / f"{split}_ims.npy")
    images[image, 3, 7] = bad
    np.save(data / f"{split}_ims.npy", images)
    return data


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------ NaN/inf features, every reader

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_evaluate_refuses_a_non_finite_feature_outside_any_sample(setup, tmp_path, capsys, bad):
    image = _hidden_images(N_DEV)[-1]
    data = _copy_with_bad_feature(setup, tmp_path, "dev", image, bad)
    assert main(["evaluate", "--checkpoint", setup["checkpoint"], "--data", str(data), "--split", "dev",
                 "--quiet", "--batch-size", "16"]) == 2
    err = _one_line_error(capsys)
    assert f"dev_ims.npy: feature [image {image}, region 3, dim 7] is {bad}; expected finite values" in err


def test_index_explain_and_matcher_name_the_file_and_the_image(setup, tmp_path, capsys):
    image = _hidden_images(N_DEV)[2]
    data = _copy_with_bad_feature(setup, tmp_path, "dev", image)
    where = f"dev_ims.npy: feature [image {image}, region 3, dim 7] is nan"
    assert main(["index", "--checkpoint", setup["checkpoint"], "--data", str(data), "--split", "dev",
                 "--out", str(tmp_path / "index"), "--batch-size", "16"]) == 2
    assert where in _one_line_error(capsys)
    assert not (tmp_path / "index").exists()
    assert main(["explain", "--checkpoint", setup["checkpoint"], "--data", str(data), "--split", "dev",
                 "--image-id", str(image), "--text", "a red dog", "--out", str(tmp_path / "x.png")]) == 2
    assert where in _one_line_error(capsys)
    assert main(["explain", "--checkpoint", setup["checkpoint"], "--data", str(data), "--split", "dev",
                 "--image-id", str(image + 1), "--text", "a red dog", "--out", str(tmp_path / "x.png")]) == 0
    capsys.readouterr()
    matcher = Matcher.load(setup["checkpoint"])
    mapped = np.load(data / "dev_ims.npy", mmap_mode="r")
    for features in (mapped, mapped[image - 2:image + 3], mapped[image]):   # the file's own image numbers
        with pytest.raises(InputError, match=rf"dev_ims\.npy: feature \[image {image}, region 3, dim 7\] is nan"):
            matcher.encode_images(features)
    with pytest.raises(InputError, match=rf"dev_ims\.npy: feature \[image {image}, region 3, dim 7\] is nan"):
        build_index(matcher, PrecompSplit(data, "dev").images, ["a dog"] * N_DEV, tmp_path / "lib_index",
                    batch_size=16)


def test_training_refuses_a_non_finite_dev_feature_before_the_first_step(setup, tmp_path, capsys):
    image = _hidden_images(N_DEV)[0]
    data = _copy_with_bad_feature(setup, tmp_path, "dev", image)
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--preset", "tiny"]) == 2
    assert f"dev_ims.npy: feature [image {image}, region 3, dim 7] is nan" in _one_line_error(capsys)
    assert not (run / "last.pt").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("workers", [0, 1])
def test_training_names_the_non_finite_training_image_not_the_learning_rate(tmp_path, capsys, workers):
    data = make_toy_precomp(tmp_path / "data", n_train=N_DEV, n_dev=8)
    images = np.load(data / "train_ims.npy")
    hidden = _hidden_images(N_DEV)
    images[hidden, 0, 1] = np.nan   # the old sample at opening misses all of them
    np.save(data / "train_ims.npy", images)
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny",
                 "--set", f"workers={workers}"]) == 2
    err = _one_line_error(capsys)   # one line even when a DataLoader worker read the batch
    assert "train_ims.npy: feature [image " in err and "loss" not in err and " lr" not in err
    assert int(err.split("feature [image ")[1].split(",")[0]) in hidden


def test_train_step_on_non_finite_inputs_says_so():
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=10, img_dim=20, word_dim=8, embed_size=16, sim_dim=8, num_regions=6,
                              module="sgr", sgr_step=1))
    images = torch.randn(3, 6, 20)
    images[1, 2, 3] = float("inf")
    captions = torch.tensor([[1, 5, 2], [1, 6, 2], [1, 7, 2]])
    batch = Batch(images, captions, torch.tensor([3, 3, 3]), torch.arange(3), torch.tensor([4, 9, 11]))
    config = preset("tiny")
    optimizer = training_step.build_optimizer(model, config)
    with pytest.raises(training_step.NonFiniteLossError,
                       match=r"on non-finite inputs: the features of images \[9\] hold"):
        training_step.train_step(model, optimizer, batch, config)


# ------------------------------------------------------------------ checkpoints holding NaN/inf

def test_commands_refuse_a_checkpoint_with_non_finite_weights(setup, tmp_path, capsys):
    raw = torch.load(setup["checkpoint"], weights_only=True)
    raw["state_dict"]["img_enc.fc.weight"][2, 2] = float("nan")
    broken = tmp_path / "broken.pt"
    torch.save(raw, broken)
    data = str(setup["data"])
    for argv in (["evaluate", "--checkpoint", str(broken), "--data", data, "--split", "dev", "--quiet"],
                 ["index", "--checkpoint", str(broken), "--data", data, "--split", "dev",
                  "--out", str(tmp_path / "index")],
                 ["explain", "--checkpoint", str(broken), "--data", data, "--split", "dev", "--image-id", "0",
                  "--text", "a dog", "--out", str(tmp_path / "x.png")]):
        assert main(argv) == 2, argv
        assert f"{broken}: tensor 'img_enc.fc.weight' (1 NaN/inf of 320 values)" in _one_line_error(capsys)


# ------------------------------------------------------------------ training: NaN loss, weights, messages

def _train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), "--preset", "tiny", *extra])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_precomp(tmp_path_factory.mktemp("toy") / "data", n_train=24, n_dev=8)


def test_nan_loss_before_any_checkpoint_names_none(toy, tmp_path, monkeypatch, capsys):
    real_loss = training_step.batch_loss
    calls = {"n": 0}

    def loss_going_bad(*args, **kwargs):
        calls["n"] += 1
        return real_loss(*args, **kwargs) * (float("nan") if calls["n"] == 3 else 1.0)

    monkeypatch.setattr(training_step, "batch_loss", loss_going_bad)
    run = tmp_path / "run"
    assert _train(toy, run, "--set", "checkpoint_every=5", "precision=bf16") == 1
    err = _one_line_error(capsys)
    assert "the training loss is nan at epoch 1, step 3; stopping. No checkpoint was written " \
           "before it (checkpoint_every=5); the inputs were finite, so training diverged: try a lower lr or " \
           "precision=fp32" in err
    assert "last.pt" not in err and not (run / "last.pt").exists()


def test_weights_gone_non_finite_are_never_saved_as_last_good_checkpoint(toy, tmp_path, monkeypatch, capsys):
    real_step = loop.train_step

    def step_that_breaks_the_weights(model, *args, **kwargs):
        result = real_step(model, *args, **kwargs)
        if model.training and loop_step["n"] == 4:
            with torch.no_grad():
                model.sim_enc.sim_eval_w.bias.fill_(float("inf"))   # the loss of this step was finite
        loop_step["n"] += 1
        return result

    loop_step = {"n": 0}
    monkeypatch.setattr(loop, "train_step", step_that_breaks_the_weights)
    run = tmp_path / "run"
    assert _train(toy, run, "--set", "checkpoint_every=5") == 1
    err = _one_line_error(capsys)
    assert "the weights hold NaN/inf (tensor 'sim_enc.sim_eval_w.bias' (1 NaN/inf of 1 values)) after step 5; " \
           "stopping. No checkpoint was written before it" in err
    assert not (run / "last.pt").exists()


# ------------------------------------------------------------------ resuming on other data

@pytest.fixture(scope="module")
def finished_run(toy, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "run"
    assert _train(toy, run, "--set", "epochs=1") == 0
    return run


def _recorded_data(run: Path) -> str:
    return yaml.safe_load((run / "config.yaml").read_text())["data"]


def test_resume_on_another_data_folder_is_refused_naming_both(toy, finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    other = make_toy_precomp(tmp_path / "other", n_train=24, n_dev=8, seed=5)
    assert main(["train", "--resume", str(run), "--data", str(other)]) == 2
    err = _one_line_error(capsys)
    assert f"--data {other}: not the data this run trained on ({run / 'config.yaml'}): {other.resolve()} is " \
           f"another folder than {toy.resolve()}, with other files (dev_caps.txt, dev_ims.npy, train_caps.txt, " \
           "train_ims.npy differ)" in err
    assert "compare dev rsum across different dev splits. Pass --allow-other-data" in err
    assert _recorded_data(run) == str(toy.resolve())   # config.yaml still names the run's data
    assert main(["train", "--resume", str(run), "--data", str(other), "--allow-other-data"]) == 0
    assert _recorded_data(run) == str(other.resolve())


def test_resume_accepts_the_same_data_moved_and_refuses_it_changed_in_place(toy, finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    moved = tmp_path / "moved"
    shutil.copytree(toy, moved)
    assert main(["train", "--resume", str(run), "--data", str(moved)]) == 0   # same files elsewhere
    assert _recorded_data(run) == str(moved.resolve())
    capsys.readouterr()
    captions = (moved / "dev_caps.txt").read_text().splitlines()
    captions[0] = "a pink boat on the lake"
    (moved / "dev_caps.txt").write_text("\n".join(captions) + "\n")
    assert main(["train", "--resume", str(run)]) == 2   # the recorded folder, changed since
    assert f"the files of {moved.resolve()} changed since the run recorded them (dev_caps.txt differ)" in \
        _one_line_error(capsys)


def test_runs_recorded_without_a_fingerprint_compare_the_folders(toy, tmp_path):
    from sgraf.data.precomp import data_fingerprint
    from sgraf.training import run_dir

    run = tmp_path / "run"
    run.mkdir()
    run_dir.save_run_config(run, preset("tiny"), toy, "tiny")   # as written before fingerprints existed
    copy = tmp_path / "copy"
    shutil.copytree(toy, copy)
    assert run_dir.other_data(run, toy, data_fingerprint(toy)) is None
    assert run_dir.other_data(run, copy, data_fingerprint(copy)) == f"{copy.resolve()} is another folder than " \
        f"{toy.resolve()}"
    run_dir.save_run_config(run, preset("tiny"), toy, "tiny", data_fingerprint(toy))
    assert run_dir.other_data(run, copy, data_fingerprint(copy)) is None   # the same files, moved


def test_train_help_documents_the_permissions(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--allow-other-data" in out and "dev rsum would be compared across different dev splits" in out
    assert "--allow-unknown-words" in out and "over half of the training tokens unknown" in out
    assert main(["train", "--data", "d", "--out", "r", "--allow-other-data"]) == 2
    assert "--allow-other-data applies to --resume RUN_DIR" in capsys.readouterr().err


# ------------------------------------------------------------------ vocabularies that leave the words unknown

def _foreign_vocab(path: Path, size: int | None = None) -> Path:
    words = ["zebra", "kayak", "volcano", "violin", "glacier", "tractor"]
    words += [f"filler{i}" for i in range((size or 10) - 4 - len(words))]
    Vocabulary.from_words(words).save(path)
    return path


def test_training_refuses_a_vocabulary_that_leaves_the_words_unknown(toy, tmp_path, capsys, caplog):
    vocab = _foreign_vocab(tmp_path / "foreign_vocab.json")
    run = tmp_path / "run"
    assert _train(toy, run, "--set", f"vocab={vocab}") == 2
    err = _one_line_error(capsys)
    assert f"{vocab}: 100.0% of the tokens of {toy / 'train_caps.txt'} are unknown to this vocabulary (<unk>), " \
           "above the 50% limit" in err and "--allow-unknown-words" in err
    assert not (run / "last.pt").exists()
    with caplog.at_level("WARNING"):
        assert _train(toy, tmp_path / "run2", "--set", f"vocab={vocab}", "epochs=1", "--allow-unknown-words") == 0
    assert f"{vocab}: 100.0% of the 768 tokens of {toy / 'train_caps.txt'} are unknown" in caplog.text
    assert "above the 10% warning threshold" in caplog.text


def test_vocabulary_share_between_warning_and_limit_warns_only(toy, caplog):
    split = PrecompSplit(toy, "train")
    # the templates' words but no colour, object or place: 15 of each image's 32 tokens unknown
    half = Vocabulary.from_words(["a", "the", "in", "near", "one", "at", "that", "is", "this", "by"])
    with caplog.at_level("WARNING"):
        share = loop.check_vocab_coverage(half, split)
    assert share == pytest.approx(15 / 32) and "46.9% of the 768 tokens" in caplog.text
    with pytest.raises(InputError, match=r"above the 50% limit"):
        loop.check_vocab_coverage(Vocabulary.from_words(["zebra"]), split)
    assert loop.check_vocab_coverage(Vocabulary.from_words(["zebra"]), split, allow=True) == 1.0


def test_evaluate_and_index_warn_about_a_vocabulary_of_other_words(setup, tmp_path, capsys, caplog):
    """A checkpoint that carries no vocabulary (as the authors' do) with a --vocab of other words:
    a warning names the share of unknown words. (For one that carries its own, another --vocab
    is refused: test_checkpoint.)"""
    vocab = _foreign_vocab(tmp_path / "foreign_vocab.json", size=len(setup["vocab"]))
    bare = tmp_path / "bare.pt"
    model = load_model(setup["checkpoint"])
    model.vocab = None
    save_model(model, bare)
    with caplog.at_level("WARNING"):
        assert main(["evaluate", "--checkpoint", str(bare), "--vocab", str(vocab), "--data",
                     str(setup["data"]), "--split", "dev", "--quiet", "--json"]) == 0
    assert f"{vocab}: 100.0% of the" in caplog.text and "dev_caps.txt are unknown" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main(["index", "--checkpoint", str(bare), "--vocab", str(vocab), "--data",
                     str(setup["data"]), "--split", "dev", "--out", str(tmp_path / "index")]) == 0
    assert f"{vocab}: 100.0% of the" in caplog.text and "the dev captions of" in caplog.text
    assert main(["evaluate", "--checkpoint", setup["checkpoint"], "--vocab", str(vocab), "--data",
                 str(setup["data"]), "--split", "dev", "--quiet"]) == 2
    assert "carries its own vocabulary, which differs from" in _one_line_error(capsys)


# ------------------------------------------------------------------ garbage .npy files, our words

def test_garbage_npy_files_get_one_line_without_numpy_advice(setup, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(setup["data"], data)
    (data / "dev_ims.npy").write_bytes(pickle.dumps(np.zeros((3, 6, 20))))
    assert main(["evaluate", "--checkpoint", setup["checkpoint"], "--data", str(data), "--split", "dev"]) == 2
    err = _one_line_error(capsys)
    assert "dev_ims.npy: not a readable .npy array: it does not start with the NumPy header" in err
    assert "allow_pickle" not in err and "unsafe" not in err
    np.save(tmp_path / "sims.npy", np.array([[1.0, None]], dtype=object), allow_pickle=True)
    assert main(["evaluate", "--sims", str(tmp_path / "sims.npy")]) == 2
    err = _one_line_error(capsys)
    assert "sims.npy: not a readable .npy array: it holds Python objects (dtype object), which sgraf never " \
           "unpickles; expected a float (n_images, n_captions) score matrix" in err
    assert "allow_pickle" not in err and "unsafe" not in err


def test_score_matrix_with_nan_is_named_by_file_and_pair(tmp_path, capsys):
    sims = np.eye(4, 20, dtype=np.float32)
    sims[2, 13] = np.nan
    np.save(tmp_path / "sims.npy", sims)
    assert main(["evaluate", "--sims", str(tmp_path / "sims.npy")]) == 2
    assert "sims.npy: score [image 2, caption 13] is nan; expected finite scores" in _one_line_error(capsys)


def test_explain_region_boxes_garbage_or_non_finite(setup, tmp_path, capsys):
    from sgraf.explain import region_layout

    data = tmp_path / "data"
    shutil.copytree(setup["data"], data)
    (data / "dev_boxes.npy").write_bytes(pickle.dumps([[0, 0, 1, 1]]))
    with pytest.raises(InputError, match=r"dev_boxes\.npy: not a readable \.npy array: .*; expected \(n_images, 6, "
                                         r"4\) float region boxes covering image 1"):
        region_layout(data, "dev", 1, 6)
    boxes = np.tile(np.array([0, 0, 10, 10], np.float32), (N_DEV, 6, 1))
    boxes[1, 4, 2] = np.inf
    np.save(data / "dev_boxes.npy", boxes)
    region_layout(data, "dev", 0, 6)
    with pytest.raises(InputError, match=r"dev_boxes\.npy: the box of image 1, region 4 is \[0\.0, 0\.0, inf, "
                                         r"10\.0\]; expected finite"):
        region_layout(data, "dev", 1, 6)


def test_evaluate_json_still_runs_on_clean_data(setup, capsys):
    assert main(["evaluate", "--checkpoint", setup["checkpoint"], "--data", str(setup["data"]), "--split", "dev",
                 "--quiet", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n_images"] == N_DEV
