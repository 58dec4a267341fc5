"""Must-show: determinism and resume, and the tiny preset learns.

A run killed with SIGKILL in the middle of an epoch (once a step checkpoint exists), then
resumed with `--resume`, ends with exactly the weights (bit for bit), optimiser state and
validation records of an uninterrupted run with the same seed; the same after SIGTERM, which
saves a checkpoint and exits cleanly with status 143. All runs use one thread, in this process
and in the killed one (OMP_NUM_THREADS=1), so both compute the same floats.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import torch

from sgraf.cli import main
from sgraf.training.state import STATE_KEY
from train_helpers import KILLED_IN_VALIDATION, make_toy_precomp


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one thread is fastest, and avoids OpenMP spin-waiting on a loaded 2-core machine.
    torch.set_num_threads(1)
    yield

ARGS = ["--preset", "tiny", "--set", "epochs=3", "checkpoint_every=4", "seed=3", "dropout=0.2", "val_every=10"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_toy_precomp(tmp_path_factory.mktemp("resume") / "data", n_train=32, n_dev=8)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    torch.set_num_threads(1)
    assert main(["train", "--data", str(data), "--out", str(run), *ARGS]) == 0
    return run


def _start(data: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sgraf", "train", "--data", str(data), "--out", str(run), *ARGS],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step_checkpoint(proc: subprocess.Popen, run: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (run / "last.pt").exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no step checkpoint appeared"
        time.sleep(0.01)


def _progress(run: Path) -> dict:
    return torch.load(run / "last.pt", weights_only=True)["extra"][STATE_KEY]["progress"]


def _assert_same_run(a: Path, b: Path) -> None:
    last_a = torch.load(a / "last.pt", weights_only=True)
    last_b = torch.load(b / "last.pt", weights_only=True)
    assert last_a["state_dict"].keys() == last_b["state_dict"].keys()
    for key, value in last_a["state_dict"].items():
        assert torch.equal(value, last_b["state_dict"][key]), key     # bit for bit
    moments_a = last_a["extra"][STATE_KEY]["optimizer"]["state"]
    moments_b = last_b["extra"][STATE_KEY]["optimizer"]["state"]
    for index, state in moments_a.items():
        for name, tensor in state.items():
            assert torch.equal(tensor, moments_b[index][name]), (index, name)
    assert _progress(a) == _progress(b)
    records_a = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    records_b = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert records_a == records_b                                     # no lost or repeated validation
    best_a = torch.load(a / "best.pt", weights_only=True)["state_dict"]
    best_b = torch.load(b / "best.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_a)


def _resume_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming"))


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(data, uninterrupted, tmp_path, caplog):
    caplog.set_level("INFO", logger="sgraf.training.loop")
    run = tmp_path / "killed"
    proc = _start(data, run)
    _wait_for_step_checkpoint(proc, run)
    proc.kill()                                                       # SIGKILL: no chance to save
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    progress = _progress(run)
    steps_per_epoch = 32 * 5 // 8
    assert not progress["finished"] and progress["global_step"] < 3 * steps_per_epoch
    assert progress["global_step"] % 4 == 0 and progress["epoch_step"] > 0   # a mid-epoch step checkpoint
    assert main(["train", "--resume", str(run)]) == 0
    _assert_same_run(uninterrupted, run)
    line = _resume_line(caplog)                                       # said in words, never "-inf"
    assert "-inf" not in line and "inf" not in line.split("(")[-1], line
    if progress["best_step"] < 0:                                     # killed before the validation at step 10
        assert line.endswith("(no validation yet)"), line
    else:
        assert f"(best rsum {progress['best_rsum']:.2f} at step {progress['best_step']})" in line, line


def test_progress_describes_its_best_validation():
    from sgraf.training.state import Progress

    assert Progress().describe_best() == "no validation yet"
    assert Progress(best_rsum=123.456, best_step=10).describe_best() == "best rsum 123.46 at step 10"
    restored = Progress.from_dict(Progress().to_dict())                  # as a resumed checkpoint holds it
    assert restored.describe_best() == "no validation yet"


def test_sigterm_saves_exits_cleanly_and_resumes_exactly(data, uninterrupted, tmp_path):
    run = tmp_path / "terminated"
    proc = _start(data, run)
    _wait_for_step_checkpoint(proc, run)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "stopped by SIGTERM" in out and f"--resume {run}" in out
    progress = _progress(run)
    assert not progress["finished"] and progress["global_step"] >= 4  # saved at the step it stopped
    epochs = yaml.safe_load((run / "config.yaml").read_text())["epochs"]
    assert f"in epoch {progress['epoch'] + 1} of {epochs} ({progress['epoch']} done, as sgraf runs counts)" in out
    assert main(["train", "--resume", str(run)]) == 0
    _assert_same_run(uninterrupted, run)


@pytest.mark.parametrize("cut, step, pending", [(2, 20, "epoch"), (3, 30, "step"), (6, 60, "epoch")])
def test_a_signal_cuts_a_validation_short_and_resume_runs_it_first(data, uninterrupted, tmp_path, monkeypatch,
                                                                   caplog, cut, step, pending):
    """SIGTERM in the middle of a validation's arithmetic (here as it counts the ranks) stops the
    run there: nothing of that validation is written, `last.pt` says it is pending, and the
    resumed run validates first and ends as the uninterrupted run (the validations at steps 10,
    20 (end of epoch 1), 30, ..., 60 (the last epoch's)."""
    import sgraf.metrics

    caplog.set_level("INFO", logger="sgraf.training.loop")
    counting = sgraf.metrics.evaluate_sims
    calls = []

    def evaluate_sims(*args, **kwargs):
        calls.append(1)
        if len(calls) == cut:
            os.kill(os.getpid(), signal.SIGTERM)      # its handler runs in this thread, here
        return counting(*args, **kwargs)

    monkeypatch.setattr(sgraf.metrics, "evaluate_sims", evaluate_sims)
    run = tmp_path / "cut"
    assert main(["train", "--data", str(data), "--out", str(run), *ARGS]) == 128 + signal.SIGTERM
    progress = _progress(run)
    assert progress["pending_validation"] == pending and progress["global_step"] == step
    assert not progress["finished"] and progress["last_val_step"] == step - 10
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(10, step, 10))
    monkeypatch.undo()
    caplog.clear()
    assert main(["train", "--resume", str(run)]) == 0
    said = [record.getMessage() for record in caplog.records]
    epoch = min(step // 20 + 1, 3)
    said_first = f"resuming {run} at epoch {epoch}, step {step}: first the validation that had not ended there "
    assert said_first in "\n".join(said)
    assert not any(line.startswith(f"resuming {run} at epoch {epoch}, step {step} (") for line in said)
    _assert_same_run(uninterrupted, run)


@pytest.mark.parametrize("killed_in, step, pending", [(2, 20, "epoch"), (3, 30, "step")])
def test_a_process_killed_during_a_validation_loses_that_validation_alone(data, uninterrupted, tmp_path,
                                                                         killed_in, step, pending):
    """`last.pt` is written before each validation, the validation pending: a process killed
    outright during one (SIGKILL, the out-of-memory killer, a scheduler once its grace period is
    out: under torchrun a signal lets a validation run to its end) loses that validation alone, not
    the steps since the last checkpoint (here every 7 steps: the run would have gone back from step 20
    to 14, from 30 to 28), and the resumed run validates first and ends as the uninterrupted one (whose
    checkpoints every 4 steps change none of its numbers)."""
    run = tmp_path / "killed"
    args = [arg.replace("checkpoint_every=4", "checkpoint_every=7") for arg in ARGS]
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_VALIDATION, str(killed_in), "train", "--data", str(data),
                           "--out", str(run), *args], env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    progress = _progress(run)
    assert progress["global_step"] == step and progress["pending_validation"] == pending
    assert progress["last_val_step"] == step - 10 and not progress["finished"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(10, step, 10))
    assert main(["train", "--resume", str(run)]) == 0
    _assert_same_run(uninterrupted, run)


def test_a_resume_where_fewer_gpus_are_visible_restores_the_generators_of_those_there(monkeypatch):
    """`last.pt` keeps the CUDA generator of every GPU its process saw. A run saved where 4 were
    visible and resumed where 2 are (another machine, or CUDA_VISIBLE_DEVICES) sets those 2 (restoring
    all 4 had failed with an IndexError); CUDA's in a file resumed without CUDA are left out."""
    from sgraf.training import state as train_state

    saved = train_state.capture_rng_state()
    saved["cuda"] = [torch.full((16,), index, dtype=torch.uint8) for index in range(4)]
    set_states = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda value, device: set_states.append((int(value[0]), device)))
    train_state.restore_rng_state(saved)
    assert set_states == [(0, 0), (1, 1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_states.clear()
    train_state.restore_rng_state(saved)
    assert set_states == []


def test_resume_can_extend_a_finished_run(data, uninterrupted, tmp_path, caplog):
    import shutil

    caplog.set_level("INFO", logger="sgraf.training.loop")
    run = tmp_path / "extended"
    shutil.copytree(uninterrupted, run)
    best = _progress(run)
    # a finished run resumed as it is trains nothing, and its log says only that
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run)]) == 0
    said = [record.getMessage() for record in caplog.records]
    assert any("nothing to train" in line for line in said) and not any(line.startswith("training ") for line in said)
    assert (run / "metrics.jsonl").read_text() == metrics
    caplog.clear()
    assert main(["train", "--resume", str(run), "--set", "epochs=4"]) == 0
    assert any(record.getMessage().startswith("training ") for record in caplog.records)
    assert _resume_line(caplog).endswith(f"(best rsum {best['best_rsum']:.2f} at step {best['best_step']})")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] == 4 and _progress(run)["finished"]
    assert "epochs: 4" in (run / "config.yaml").read_text()


def test_tiny_preset_learns(tmp_path):
    """Loss goes down and dev rsum goes up within seconds (20 dev images: chance rsum ~150)."""
    data = make_toy_precomp(tmp_path / "data", n_train=48, n_dev=20)
    run = tmp_path / "run"
    # lr 1e-2 on 48 pairs is chaotic: float rounding alone moves the epoch the loss falls in
    # by one or two, and the dev rsum swings by 50-90 from epoch to epoch once it has risen
    # (168 -> 344 -> 289, or 167 -> 276 -> 187 -> 204 after a change of rounding), so the run is
    # long enough for any of those trajectories and the best of its second half is what counts
    # (the run's best.pt)
    assert main(["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--set", "epochs=6"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6
    assert records[-1]["train_loss"] < 0.5 * records[0]["train_loss"]
    assert max(record["rsum"] for record in records[3:]) > records[0]["rsum"] + 50


def test_a_config_yaml_edited_since_last_pt_is_refused_on_resume(data, uninterrupted, tmp_path, capsys):
    """A resume had read the recipe from config.yaml alone: an edited lr trained on, unsaid, and a
    deleted line took the default and was written back."""
    import re
    import shutil

    for name, edit, said in (("lr", lambda text: re.sub(r"(?m)^lr: .*$", "lr: 0.5", text), "lr: 0.5 there"),
                             ("gone", lambda text: re.sub(r"(?m)^sim_dim: .*\n", "", text), "sim_dim: 256 there")):
        run = tmp_path / name
        shutil.copytree(uninterrupted, run)
        config = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(edit(config))
        assert main(["train", "--resume", str(run), "--set", "epochs=4"]) == 2
        err = capsys.readouterr().err
        assert f"cannot resume {run}: its config.yaml no longer says what last.pt was trained with (" in err, err
        assert said in err and "in last.pt" in err, err
        (run / "config.yaml").write_text(config)
        assert main(["train", "--resume", str(run), "--set", "epochs=4"]) == 0
