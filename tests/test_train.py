"""Training: configs and presets, the run folder, bad input, NaN handling, schedule, sampler."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch

from numerics import REORDERED, approx
import sgraf
from sgraf.cli import main
from sgraf.config import ModelConfig
from sgraf.errors import InputError, NonFiniteFeatures
from sgraf.training import loop
from sgraf.training import step as training_step
from sgraf.training.config import PRESETS, preset, resolve_config, valid_keys
from sgraf.training.loop import EpochBatchSampler
from sgraf.training.step import batch_loss, learning_rate, same_image_mask
from sgraf.training.state import STATE_KEY
from train_helpers import make_toy_precomp


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one thread is fastest, and avoids OpenMP spin-waiting on a loaded 2-core machine.
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return make_toy_precomp(tmp_path_factory.mktemp("toy") / "data", n_train=24, n_dev=8)


# ------------------------------------------------------------------ config

def test_paper_presets_are_the_authors_recipes():
    for name, (module, epochs, lr_update) in {"f30k-sgr": ("sgr", 40, 30), "f30k-saf": ("saf", 30, 20),
                                              "coco-sgr": ("sgr", 20, 10), "coco-saf": ("saf", 20, 10)}.items():
        config = preset(name)
        assert (config.module, config.epochs, config.lr_update) == (module, epochs, lr_update)
        assert (config.batch_size, config.lr, config.grad_clip, config.margin) == (128, 2e-4, 2.0, 0.2)
        assert config.max_violation and not config.same_image_positive and config.precision == "fp32"
        assert (config.img_dim, config.num_regions, config.val_max_captions) == (2048, 36, 5000)
        assert (config.embed_size, config.sim_dim, config.word_dim, config.sgr_step) == (1024, 256, 300, 3)
    assert {"demo", "tiny"} <= set(PRESETS)


def test_model_fields_mirror_model_config():
    """Every ModelConfig hyper-parameter (but the data-given vocab size) is a training key."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size"}
    assert model_fields <= set(valid_keys())
    config = preset("tiny").replace(sgr_step=4, bi_gru=False)
    model_config = config.model_config(vocab_size=50, img_dim=20, num_regions=6)
    assert (model_config.sgr_step, model_config.bi_gru, model_config.embed_size) == (4, False, 32)


def test_layers_override_in_order(tmp_path):
    yaml_file = tmp_path / "cfg.yaml"
    yaml_file.write_text("epochs: 7\nlr: 0.001\nmodule: saf\ndata: /somewhere\n")
    config, extras = resolve_config("f30k-sgr", yaml_file, ["lr=5e-4", "bi_gru=false", "img_dim=none"])
    assert config.epochs == 7 and config.module == "saf"         # the file beats the preset
    assert config.lr == 5e-4                                      # --set beats the file
    assert config.bi_gru is False and config.img_dim is None      # coerced from strings
    assert config.lr_update == 30                                 # untouched preset value
    assert extras == {"data": "/somewhere"}


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(InputError) as err:
        resolve_config("tiny", None, ["learning_rate=0.1"])
    assert "learning_rate" in str(err.value) and "did you mean 'lr'" in str(err.value)
    assert all(key in str(err.value) for key in valid_keys())
    yaml_file = tmp_path / "typo.yaml"
    yaml_file.write_text("epochs: 3\nbatchsize: 64\n")
    with pytest.raises(InputError, match=r"typo.yaml: unknown training config key 'batchsize'.*batch_size"):
        resolve_config(None, yaml_file)


@pytest.mark.parametrize("override, message", [
    ("epochs=two", "'epochs' expects an integer"),
    ("epochs=0", "'epochs' must be an integer >= 1"),
    ("module=vgg", "'module' must be one of sgr, saf, ave, joint"),
    ("precision=fp8", "'precision' must be one of fp32, bf16, fp16"),
    ("bi_gru=maybe", "'bi_gru' expects true or false"),
    ("lr", "--set expects key=value"),
    ("warmup_epochs=-1", "'warmup_epochs' must be an integer >= 0"),
    ("warmup_epochs=1", "'warmup_epochs' .* it needs max_violation=true"),   # tiny sums throughout
])
def test_bad_values_are_named(override, message):
    with pytest.raises(InputError, match=message):
        resolve_config("tiny", None, [override])


def test_python_values_take_their_fields_types_as_yaml_and_set_do():
    """TrainConfig built in Python coerces strings ("1e-3", "false") as --set does; overrides may
    be one key=value string or a mapping."""
    import pathlib

    config = sgraf.training.TrainConfig(lr="1e-3", bi_gru="false", epochs=3.0, vocab=pathlib.Path("v.json"),
                                        device=torch.device("cpu"))
    assert (config.lr, config.bi_gru, config.epochs, config.vocab, config.device) == (1e-3, False, 3, "v.json", "cpu")
    with pytest.raises(InputError, match="training config key 'margin' expects a number, got None"):
        sgraf.training.TrainConfig(margin=None)
    with pytest.raises(InputError, match="training config key 'epochs' expects an integer, got 2.5"):
        sgraf.training.TrainConfig(epochs=2.5)
    one, _ = resolve_config("tiny", overrides="epochs=1")
    mapped, _ = resolve_config("tiny", overrides={"epochs": 1, "lr": "0.5"})
    assert (one.epochs, mapped.epochs, mapped.lr) == (1, 1, 0.5) and one == preset("tiny").replace(epochs=1)
    with pytest.raises(InputError, match="--set expects key=value strings, got int 1"):
        resolve_config("tiny", overrides=["epochs=1", 1])
    with pytest.raises(InputError, match=r"config must be a TrainConfig \(resolve_config returns \(config, extras\)\)"):
        loop.fit(resolve_config("tiny"), "data", "run")


def test_bad_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nlr: [1,\n")
    with pytest.raises(InputError, match=r"bad.yaml: line \d+"):
        resolve_config(None, bad)
    # a key given twice: PyYAML kept the last without a word
    bad.write_text("epochs: 1\nlr: 0.001\nepochs: 3\n")
    with pytest.raises(InputError, match=r"bad.yaml: line 3: key 'epochs' is given again \(first on line 1\)"):
        resolve_config(None, bad)
    with pytest.raises(InputError, match=r"--set epochs is given twice \(2, then 3\): give it once"):
        resolve_config("tiny", overrides=["epochs=2", "epochs=3"])
    assert resolve_config("tiny", overrides=["epochs=2", "epochs=2"])[0].epochs == 2   # a repeated line is no change
    bad.write_text("epochs: 1\n[a, b]: 2\n")                                  # an unhashable key: one line
    with pytest.raises(InputError, match=r"bad.yaml: line \d+"):
        resolve_config(None, bad)
    with pytest.raises(InputError, match="epochs"):
        resolve_config("tiny", overrides=["epochs=1_0"])                          # int() had read 10


# ------------------------------------------------------------------ schedule, sampler, loss

def test_learning_rate_steps_down_every_lr_update_epochs():
    config = preset("f30k-sgr")
    assert [learning_rate(config, e) for e in (0, 29, 30, 39)] == pytest.approx([2e-4, 2e-4, 2e-5, 2e-5])
    assert learning_rate(preset("coco-saf"), 19) == pytest.approx(2e-5)


def test_sampler_depends_on_seed_and_epoch_only_and_shards_the_global_batch():
    one = EpochBatchSampler(50, 16, seed=3, epoch=2)
    again = EpochBatchSampler(50, 16, seed=3, epoch=2)
    assert list(one) == list(again)
    assert list(one) != list(EpochBatchSampler(50, 16, seed=3, epoch=3))
    batches = list(one)
    assert [len(b) for b in batches] == [16, 16, 16, 2]       # the last batch of 2 is kept...
    assert [len(b) for b in EpochBatchSampler(49, 16, 3, 2)] == [16, 16, 16]  # ...one of 1 is not (BatchNorm)
    assert sorted(sum(batches, [])) == sorted(set(sum(batches, [])))
    shards = [list(EpochBatchSampler(50, 16, 3, 2, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]              # the batch of 2 cannot feed 3 processes
    for k, batch in enumerate(batches[:3]):
        assert sum((s[k] for s in shards), []) == batch.tolist() if hasattr(batch, "tolist") else batch
    assert list(EpochBatchSampler(50, 16, 3, 2, start_batch=2)) == batches[2:]
    assert len(EpochBatchSampler(50, 16, 3, 2, start_batch=2)) == 2


def test_warm_up_sums_the_hinge_for_its_epochs_then_takes_the_hardest_negatives():
    config = preset("tiny").replace(max_violation=True, warmup_epochs=2)
    assert [config.loss_for_epoch(e).max_violation for e in range(4)] == [False, False, True, True]
    assert config.loss_for_epoch(3) is config and config.loss_for_epoch(0).warmup_epochs == 0
    scores = torch.tensor([[0.9, 0.8, 0.75], [0.85, 0.9, 0.8], [0.8, 0.85, 0.9]])   # two violators per row
    summed, hardest = batch_loss(scores, config.loss_for_epoch(0)), batch_loss(scores, config)
    # violations (0.2 + s - 0.9): rows 0.1 + 0.05, 0.15 + 0.1, 0.1 + 0.15; columns 0.15 + 0.1, 0.1 + 0.15, 0.05 + 0.1
    assert summed.item() == pytest.approx(1.3, abs=1e-6)
    assert hardest.item() == pytest.approx(0.8, abs=1e-6)     # the largest of each: 0.4 over rows, 0.4 over columns


def test_training_with_a_warm_up_switches_the_loss_at_the_epoch(toy_data, tmp_path, monkeypatch, caplog):
    hardest = []
    real_step = loop.train_step

    def step(model, optimizer, batch, config, *args, **kwargs):
        hardest.append(config.max_violation)
        return real_step(model, optimizer, batch, config, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    caplog.set_level("INFO", logger="sgraf.training.loop")
    assert _train(toy_data, tmp_path / "run", "--set", "epochs=3", "max_violation=true", "warmup_epochs=1") == 0
    assert hardest == [False] * 15 + [True] * 30      # 15 steps per epoch
    assert "summed over all negatives for the first 1 epoch, then the hardest negatives" in caplog.text


def test_a_run_with_hardest_negatives_says_and_takes_the_selected_pairs_backward(toy_data, tmp_path, monkeypatch,
                                                                                caplog):
    from sgraf.training import pairs

    listed = []
    real_listing = pairs.loss_and_pairs
    monkeypatch.setattr(pairs, "loss_and_pairs", lambda *args: listed.append(1) or real_listing(*args))
    caplog.set_level("INFO", logger="sgraf.training.loop")
    assert _train(toy_data, tmp_path / "run", "--set", "epochs=1", "max_violation=true", "batch_size=32") == 0
    assert listed and "backward: through the pairs the hardest-negative loss reads" in caplog.text


def test_a_run_takes_no_more_loader_workers_than_its_cpus_and_says_so(toy_data, tmp_path, monkeypatch, caplog):
    """The paper's presets ask for 4 workers (the authors' machines); on 2 CPUs PyTorch's loader
    warned twice per run that it may slow down or freeze. The batches do not depend on it."""
    from sgraf import devices
    from sgraf.data import precomp

    assert [loop.loader_workers(asked) for asked in (0, 1, 64)] == [0, 1, min(64, devices.available_cores())]
    monkeypatch.setattr(loop, "available_cores", lambda: 1)
    made = []
    real_loader = precomp.CheckedLoader
    monkeypatch.setattr(precomp, "CheckedLoader", lambda *args, **kwargs: made.append(kwargs["num_workers"])
                        or real_loader(*args, **kwargs))
    caplog.set_level("INFO", logger="sgraf.training.loop")
    assert _train(toy_data, tmp_path / "run", "--set", "epochs=1", "workers=4") == 0
    assert made == [1]
    assert "data loading: 1 worker processes (workers=4 asked; this process may use 1 CPUs)" in caplog.text


def test_same_image_option_removes_those_pairs_from_the_negatives():
    scores = torch.tensor([[0.9, 0.8, 0.1], [0.85, 0.9, 0.2], [0.1, 0.3, 0.7]])
    image_ids = torch.tensor([4, 4, 7])                        # captions 0 and 1 share an image
    config = preset("tiny")
    mask = same_image_mask(image_ids)
    assert mask.tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    default = batch_loss(scores, config).item()
    masked = batch_loss(scores, config.replace(same_image_positive=True), mask).item()
    # Default (the authors'): the other caption of image 4 is each one's hardest negative.
    # rows (images): 0.2+0.8-0.9, 0.2+0.85-0.9, 0.2+0.3-0.7 -> 0.1, 0.15, 0
    # cols (captions): 0.2+0.85-0.9, 0.2+0.8-0.9, 0.2+0.2-0.7 -> 0.15, 0.1, 0
    assert default == approx(0.5, REORDERED, scale=1.0)     # hinge terms of order 1
    # With the option only image/caption 7 remain as negatives of image 4's pairs: all satisfied.
    assert masked == approx(0.0, REORDERED, scale=1.0)


def test_joint_loss_is_the_sum_of_both_heads():
    gen = torch.Generator().manual_seed(0)
    sgr, saf = torch.rand(5, 5, generator=gen), torch.rand(5, 5, generator=gen)
    config = preset("tiny")
    assert batch_loss({"sgr": sgr, "saf": saf}, config).item() == approx(
        batch_loss(sgr, config).item() + batch_loss(saf, config).item(), REORDERED)


# ------------------------------------------------------------------ runs

def test_a_batch_larger_than_the_training_set_is_one_step_and_says_so(toy_data, tmp_path, monkeypatch, caplog):
    sizes = []
    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda model, optimizer, batch, *args, **kwargs:
                        sizes.append(len(batch.lengths)) or real_step(model, optimizer, batch, *args, **kwargs))
    caplog.set_level("INFO", logger="sgraf.training.loop")
    assert _train(toy_data, tmp_path / "run", "--set", "epochs=2", "batch_size=1000") == 0
    captions = len((toy_data / "train_caps.txt").read_text().splitlines())
    assert sizes == [captions, captions]           # all of them, once per epoch
    assert f"batch_size=1000 is more than the {captions} training captions: every step takes all" in caplog.text


def _train(data, out, *extra):
    return main(["train", "--data", str(data), "--out", str(out), "--preset", "tiny", *extra])


def test_a_dev_split_of_the_training_files_is_said(toy_data, tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train_ims.npy", "train_caps.txt"):
        (data / name).symlink_to(toy_data / name)
    (data / "dev_ims.npy").symlink_to(toy_data / "train_ims.npy")
    (data / "dev_caps.txt").write_bytes((toy_data / "train_caps.txt").read_bytes())    # a copy
    caplog.set_level("WARNING", logger="sgraf.training.loop")
    assert _train(data, tmp_path / "run", "--set", "epochs=1") == 0
    assert "the dev split's captions and features are the training split's (the same files, or copies)" in caplog.text
    caplog.clear()
    assert _train(toy_data, tmp_path / "other", "--set", "epochs=1") == 0
    assert "the training split's" not in caplog.text


def test_run_folder_contents(toy_data, tmp_path):
    import random

    run = tmp_path / "run"
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    draws = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    assert _train(toy_data, run, "--set", "epochs=2", "val_every=10", "seed=1") == 0
    # the run seeds the global generators from its seed, and leaves them as they were
    assert torch.equal(torch.rand(3), draws[0]) and (np.random.rand(3) == draws[1]).all()
    assert random.random() == draws[2]
    assert {"config.yaml", "metrics.jsonl", "last.pt", "best.pt", "curves.png"} <= {p.name for p in run.iterdir()}
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # 120 captions in batches of 8: 15 steps per epoch; every 10 steps and at each epoch's end
    assert [r["step"] for r in records] == [10, 15, 20, 30]
    assert [r["end_of_epoch"] for r in records] == [False, True, False, True]
    assert [r["epoch"] for r in records] == [1, 1, 2, 2]
    for r in records:
        assert {"epoch", "step", "rsum", "i2t", "t2i", "train_loss", "lr"} <= set(r)
        assert r["rsum"] == pytest.approx(sum(r[d][k] for d in ("i2t", "t2i") for k in ("r1", "r5", "r10")))
        assert r["n_captions"] == 40 and math.isfinite(r["train_loss"])

    # config.yaml reproduces the resolved config
    from sgraf.training.run_dir import load_run_config
    config, data, name = load_run_config(run)
    assert config == preset("tiny").replace(epochs=2, val_every=10, seed=1)
    assert data == str(toy_data.resolve()) and name == "tiny"

    # best.pt holds the best rsum's weights; both load with sgraf.load_model (weights_only)
    best = torch.load(run / "best.pt", weights_only=True)
    best_record = max(records, key=lambda r: r["rsum"])
    assert best["extra"]["rsum"] == best_record["rsum"] and best["extra"]["step"] == best_record["step"]
    last = torch.load(run / "last.pt", weights_only=True)
    assert last["extra"][STATE_KEY]["progress"]["finished"] is True
    model = sgraf.load_model(run / "best.pt")
    assert model.config.img_dim == 20 and model.config.num_regions == 6 and model.vocab is not None
    # the validation rsum recorded for best.pt is what its weights score now
    from sgraf.data.precomp import PrecompSplit
    result = loop.validate(model, PrecompSplit(toy_data, "dev"), model.vocab, preset("tiny"))
    assert result["rsum"] == pytest.approx(best_record["rsum"])


def test_joint_training_and_other_precisions(toy_data, tmp_path):
    assert _train(toy_data, tmp_path / "joint", "--set", "epochs=1", "module=joint") == 0
    model = sgraf.load_model(tmp_path / "joint" / "last.pt")
    assert model.heads == ("sgr", "saf")
    for precision in ("bf16", "fp16"):
        run = tmp_path / precision
        assert _train(toy_data, run, "--set", "epochs=1", f"precision={precision}") == 0
        last = torch.load(run / "last.pt", weights_only=True)
        scaler = last["extra"][STATE_KEY]["scaler"]
        assert (scaler is not None) == (precision == "fp16")    # a gradient scaler for fp16 only
        record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        assert math.isfinite(record["train_loss"])
        assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


# ------------------------------------------------------------------ bad input, before the first step

def _no_step_taken(run):
    return not (run / "last.pt").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, message", [
    ("img_dim=2048", r"train_ims.npy: feature size is 20 but the training config has img_dim=2048"),
    ("num_regions=36", r"train_ims.npy: regions per image is 6 but the training config has num_regions=36"),
])
def test_data_that_does_not_fit_the_model(toy_data, tmp_path, capsys, override, message):
    run = tmp_path / "run"
    assert _train(toy_data, run, "--set", override) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(InputError, match=message):
        loop.fit(preset("tiny").replace(**dict([override.split("=")])), toy_data, tmp_path / "direct")
    assert _no_step_taken(run)


def test_paper_preset_on_small_features_fails_before_training(toy_data, tmp_path, capsys):
    assert main(["train", "--data", str(toy_data), "--out", str(tmp_path / "r"), "--preset", "f30k-sgr"]) == 2
    err = capsys.readouterr().err
    assert "feature size is 20" in err and "img_dim=2048" in err and "--set img_dim=20" in err


def test_config_typo_on_the_command_line(toy_data, tmp_path, capsys):
    assert _train(toy_data, tmp_path / "run", "--set", "epoch=3") == 2
    err = capsys.readouterr().err
    assert "unknown training config key 'epoch'" in err and "valid keys: module," in err
    assert not (tmp_path / "run").exists()


def test_unwritable_output_folder(toy_data, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert _train(toy_data, blocker / "run") == 2
    assert f"cannot create output folder {blocker / 'run'}: {blocker} is a file, where a folder is needed" in \
        capsys.readouterr().err
    assert _train(toy_data, blocker) == 2
    assert "is a file, expected a folder" in capsys.readouterr().err


def test_patience_stops_early_a_resume_keeps_it_and_may_lift_it(toy_data, tmp_path, monkeypatch, capsys):
    """The dev rsum each epoch ends with is scripted: 10, 12 (best, epoch 2), 11, 12 (not better),
    9, 13. With patience 2 the run stops after epoch 4; a resume with the same settings trains
    nothing, patience=3 trains epoch 5 and stops again, patience=0 trains to the end."""
    from sgraf.training.state import Progress

    script = iter([10.0, 12.0, 11.0, 12.0, 9.0, 13.0])
    real_validate = loop.validate
    monkeypatch.setattr(loop, "validate", lambda *args, **kwargs: {**real_validate(*args, **kwargs),
                                                                   "rsum": next(script)})
    run = tmp_path / "run"

    def state() -> tuple[str, list[float]]:
        assert main(["runs", str(run), "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["runs"][0]
        return listed["state"], [json.loads(line)["rsum"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert _train(toy_data, run, "--set", "epochs=6", "patience=2") == 0
    assert ("stopped early after 4 of 6 epochs (60 steps; no better dev rsum in the last 2): best dev rsum 12.00 "
            "at epoch 2, step 30") in capsys.readouterr().out
    assert state() == ("stopped early", [10.0, 12.0, 11.0, 12.0])
    assert main(["train", "--resume", str(run)]) == 0
    assert "stopped early after 4 of 6 epochs" in capsys.readouterr().out
    assert state() == ("stopped early", [10.0, 12.0, 11.0, 12.0])      # nothing trained, nothing validated
    assert main(["train", "--resume", str(run), "--set", "patience=3"]) == 0
    assert "stopped early after 5 of 6 epochs" in capsys.readouterr().out
    assert state() == ("stopped early", [10.0, 12.0, 11.0, 12.0, 9.0])
    assert main(["train", "--resume", str(run), "--set", "patience=0"]) == 0
    assert "finished 6 epochs (90 steps): best dev rsum 13.00 at step 90" in capsys.readouterr().out
    assert state() == ("finished", [10.0, 12.0, 11.0, 12.0, 9.0, 13.0])
    best = torch.load(run / "best.pt", weights_only=True)["extra"]
    assert (best["rsum"], best["epoch"]) == (13.0, 6)
    # a last.pt from before best_epoch was recorded counts the patience from where it resumes
    old = Progress(epoch=7, best_step=30, best_rsum=12.0).to_dict()
    del old["best_epoch"]
    assert Progress.from_dict(old).epochs_without_better() == 0
    assert main(["train", "--data", str(toy_data), "--out", str(tmp_path / "bad"), "--preset", "tiny",
                 "--set", "patience=-1"]) == 2
    assert "training config field 'patience' must be an integer >= 0, got -1" in capsys.readouterr().err


def test_existing_run_is_not_overwritten_and_resume_needs_a_run(toy_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(toy_data, run, "--set", "epochs=1") == 0
    before = (run / "last.pt").read_bytes()
    assert _train(toy_data, run) == 2
    assert "already holds a run" in capsys.readouterr().err and (run / "last.pt").read_bytes() == before
    assert main(["train", "--resume", str(tmp_path / "absent")]) == 2
    assert f"cannot resume {tmp_path / 'absent'}: no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    (tmp_path / "empty" / "config.yaml").write_text((run / "config.yaml").read_text())
    (tmp_path / "empty" / "last.pt").mkdir()          # a folder where the checkpoint belongs
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert f"cannot resume {tmp_path / 'empty'}: its last.pt is a folder, where the run's file belongs" in \
        capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--set", "lr=0.1"]) == 2
    assert "cannot change when resuming" in capsys.readouterr().err
    # fit itself holds a resume to the run's config: another model or lr is refused, naming both values
    with pytest.raises(InputError, match=r"cannot resume .*run with another config: module='saf' \(the run's: 'sgr'\), "
                                         r"lr=0\.1 \(the run's: 0\.01\); a resume may change only epochs, "):
        loop.fit(preset("tiny").replace(epochs=2, lr=0.1, module="saf"), toy_data, run, resume=True)
    assert (run / "last.pt").read_bytes() == before
    assert loop.fit(preset("tiny").replace(epochs=2, patience=3), toy_data, run, resume=True)["epoch"] == 2
    config_before = (run / "config.yaml").read_text()
    assert main(["train", "--resume", str(run), "--set", "epochs=1"]) == 2
    assert (f"cannot resume {run} with epochs=1: it has trained 2 epochs (--set epochs=N trains on to N; N >= 2)"
            in capsys.readouterr().err)
    assert (run / "config.yaml").read_text() == config_before          # not rewritten by a refused resume
    # keys set to the values the run has are no change: a script may repeat its whole --set line
    assert main(["train", "--resume", str(run), "--set", "module=sgr", "lr=0.01", "epochs=2"]) == 0
    assert "finished 2 epochs" in capsys.readouterr().out


def test_a_resolved_config_remembers_its_preset_for_the_run_folder(toy_data, tmp_path):
    import yaml

    config = resolve_config("tiny", overrides=["epochs=1"])[0]
    assert config.preset == "tiny" and config.replace(lr=1e-3).preset == "tiny" and preset("demo").preset == "demo"
    assert sgraf.training.TrainConfig().preset is None and "preset" not in config.to_dict()
    assert config == resolve_config(None, overrides=config.to_dict())[0]       # not a field: equal values, equal
    loop.fit(config, toy_data, tmp_path / "run")
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["preset"] == "tiny"
    loop.fit(config.replace(epochs=2), toy_data, tmp_path / "run", resume=True, preset="mine")   # said, taken
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["preset"] == "mine"


def test_missing_dev_split(tmp_path, capsys):
    data = make_toy_precomp(tmp_path / "data", n_train=8, n_dev=4)
    (data / "dev_caps.txt").unlink()
    assert _train(data, tmp_path / "run") == 2
    assert "dev_caps.txt: missing file" in capsys.readouterr().err


# ------------------------------------------------------------------ NaN / inf

def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(toy_data, tmp_path, monkeypatch, capsys):
    real_loss = training_step.batch_loss
    calls = {"n": 0}

    def loss_going_bad(*args, **kwargs):
        calls["n"] += 1
        value = real_loss(*args, **kwargs)
        return value * float("nan") if calls["n"] == 7 else value

    monkeypatch.setattr(training_step, "batch_loss", loss_going_bad)
    run = tmp_path / "run"
    assert _train(toy_data, run, "--set", "checkpoint_every=5") == 1
    err = capsys.readouterr().err
    assert "loss is nan at epoch 1, step 7" in err and str(run / "last.pt") in err
    last = torch.load(run / "last.pt", weights_only=True)
    assert last["extra"][STATE_KEY]["progress"]["global_step"] == 5
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


def test_bad_features_met_mid_run_name_the_checkpoint_kept_and_how_to_go_on(toy_data, tmp_path, monkeypatch,
                                                                             capsys):
    """Features are checked as they are read: a NaN met at step 7 stopped the run (exit 2) with
    last.pt written and kept, but the message had named the image only."""
    from sgraf.data.precomp import PrecompDataset

    real_check = PrecompDataset.check_batch
    calls = {"n": 0}

    def check_going_bad(self, batch):
        calls["n"] += 1
        if calls["n"] == 7:
            raise NonFiniteFeatures("train_ims.npy: feature [image 3, region 0, dim 1] is nan; expected finite "
                                    "features")
        real_check(self, batch)

    monkeypatch.setattr(PrecompDataset, "check_batch", check_going_bad)
    run = tmp_path / "run"
    assert _train(toy_data, run, "--set", "checkpoint_every=5") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"sgraf train: error: train_ims.npy: feature [image 3, region 0, dim 1] is nan; expected finite "
                   f"features. {run / 'last.pt'} (step 5) is kept: once the features are repaired, sgraf train "
                   f"--resume {run} goes on from it"), err
    calls["n"] = -100
    assert _train(toy_data, run) == 2           # --out onto the run is refused; --resume goes on
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--data", str(toy_data)]) == 0


def test_a_checkpoint_that_cannot_be_written_is_said_alone_and_not_counted(toy_data, tmp_path, monkeypatch, capsys):
    """A failed last.pt write had been caught as bad data met mid-run, naming a step the file did
    not hold and advising to repair the data."""
    import sgraf.checkpoint as checkpoint_module

    real_save = checkpoint_module.save_model
    calls = {"n": 0}

    def save_failing_second(model, path, *args, **kwargs):
        if path.name == "last.pt":
            calls["n"] += 1
            if calls["n"] == 2:
                raise InputError(f"cannot write {path}: No space left on device")
        return real_save(model, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_model", save_failing_second)
    run = tmp_path / "run"
    assert _train(toy_data, run, "--set", "checkpoint_every=3") == 2
    said = capsys.readouterr().err.strip()
    assert said == f"sgraf train: error: cannot write {run / 'last.pt'}: No space left on device", said
    assert torch.load(run / "last.pt", weights_only=True)["extra"]["step"] == 3


def test_a_validation_of_few_dev_images_is_said(toy_data, tmp_path, caplog):
    """val_max_captions=5 had validated on one image (every recall 100, rsum 600), unsaid."""
    caplog.set_level("WARNING", logger="sgraf.training.loop")
    assert _train(toy_data, tmp_path / "run", "--set", "val_max_captions=5") == 0
    assert "validation scores 1 dev image (5 captions): R@10 is 100 whatever the model" in caplog.text


def test_a_config_files_data_or_preset_overridden_on_the_command_line_is_said(tmp_path, caplog):
    config = tmp_path / "run.yaml"
    config.write_text("data: elsewhere\npreset: tiny\nepochs: 1\n")
    caplog.set_level("WARNING", logger="sgraf.cli.train")
    assert main(["train", "--config", str(config), "--data", str(tmp_path), "--preset", "demo"]) == 2   # no --out
    assert f"--data {tmp_path} is used; {config}'s data: elsewhere is not" in caplog.text
    assert f"--preset demo is used; {config}'s preset: tiny is not" in caplog.text


def test_settings_without_effect_are_said_and_impossible_ones_refused(caplog):
    caplog.set_level("WARNING", logger="sgraf.training.config")
    resolve_config("tiny", overrides=["module=saf"])              # the preset's sgr_step: not the caller's
    assert caplog.text == ""
    resolve_config("tiny", overrides=["module=saf", "sgr_step=4"])
    assert "--set: sgr_step=4 has no effect: module=saf has no SGR head" in caplog.text
    caplog.clear()
    resolve_config("tiny", overrides={"alignments": "global", "lambda_softmax": 4})
    assert "overrides: lambda_softmax=4.0 has no effect: alignments=global" in caplog.text
    caplog.clear()          # a key at its default (a run's own config.yaml reused lists every key): nothing to say
    resolve_config("tiny", overrides={"module": "saf", "place_sharpness": 1.0, "family_share": 1.0, "sgr_step": 2})
    assert caplog.text == ""
    # the preset's value is the default: 3 over the tiny preset's 2 is a change (it had passed unsaid)
    resolve_config("tiny", overrides={"module": "saf", "sgr_step": 3})
    assert "overrides: sgr_step=3 has no effect: module=saf has no SGR head" in caplog.text
    for pair, message in (("log_every=0", "'log_every'"), ("lambda_softmax=-9", "'lambda_softmax'"),
                          ("lambda_softmax=0", "must be a finite number > 0"), ("device=cudax", "'device'"),
                          ("device=cuda:abc", "'device'"), ("device=mps", "does not run on mps")):
        with pytest.raises(InputError, match=message):
            resolve_config("tiny", overrides=[pair])


def test_a_rule_across_the_fields_names_where_the_value_was_given(tmp_path):
    (tmp_path / "c.yaml").write_text("margin: -1\n")
    for arguments, where in ((("tiny", None, ["lr=-1"]), "--set: training config field 'lr'"),
                             (("tiny", None, {"dropout": 2}), "overrides: training config field 'dropout'"),
                             (("tiny", tmp_path / "c.yaml"),
                              f"{tmp_path / 'c.yaml'}: training config fields 'grad_clip'")):
        with pytest.raises(InputError, match="^" + re.escape(where)):
            resolve_config(*arguments)


def test_several_pairs_in_one_string_are_refused():
    with pytest.raises(InputError, match=r"holds several pairs in one string \(epochs, then lr\)"):
        resolve_config("tiny", overrides="epochs=2 lr=0.1")
    assert resolve_config("tiny", overrides=["vocab=/a folder/with b=c.json"])[0].vocab == "/a folder/with b=c.json"


def test_the_authors_negated_switch_is_named_with_its_meaning():
    with pytest.raises(InputError, match=r"did you mean 'img_norm', whose meaning is the opposite: no_imgnorm=true is "
                                         r"img_norm=false\?"):
        resolve_config("tiny", overrides=["no_imgnorm=true"])


def test_a_preset_named_twice_says_which_is_taken(tmp_path, caplog):
    (tmp_path / "c.yaml").write_text("preset: f30k-saf\nlr: 0.001\n")
    caplog.set_level("WARNING", logger="sgraf.training.config")
    assert resolve_config("tiny", tmp_path / "c.yaml")[0].module == preset("tiny").module
    assert "c.yaml names preset f30k-saf; the preset given, tiny, is the one taken" in caplog.text
    caplog.clear()
    assert resolve_config(None, tmp_path / "c.yaml")[0].module == "saf" and caplog.text == ""


def test_a_validation_of_part_of_an_image_is_refused_naming_the_key(toy_data, tmp_path, capsys):
    assert _train(toy_data, tmp_path / "run", "--set", "epochs=1", "val_max_captions=7") == 2
    assert "training config field 'val_max_captions' is 7: expected a multiple of the 5 captions per image" in \
        capsys.readouterr().err
    assert not (tmp_path / "run" / "last.pt").exists()


def test_a_built_vocabulary_reads_every_dev_caption(toy_data, tmp_path):
    """As the authors' vocab.py: not only the first val_max_captions that validation scores."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train_ims.npy", "train_caps.txt", "dev_ims.npy"):
        (data / name).symlink_to(toy_data / name)
    lines = (toy_data / "dev_caps.txt").read_text().splitlines()
    lines[-5:] = ["a zebra"] * 5                                 # a word only in the last dev image's captions
    (data / "dev_caps.txt").write_text("\n".join(lines) + "\n")
    for cut in ("10", "none"):
        assert _train(data, tmp_path / f"run-{cut}", "--set", "epochs=1", f"val_max_captions={cut}") == 0
        assert "zebra" in sgraf.load_model(tmp_path / f"run-{cut}" / "best.pt").vocab.word2idx
