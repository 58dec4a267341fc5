"""`sgraf.stopwatch` and `sgraf evaluate --timings`: where a command's wall time goes."""

import json
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from sgraf import stopwatch as stopwatch_module
from sgraf.cli import main
from sgraf.stopwatch import Stopwatch, format_timings, process_age, stage

E2E = pathlib.Path(__file__).parent / "data" / "e2e"
DATA = E2E / "data" / "toy_precomp"
VOCAB = E2E / "data" / "toy_vocab.json"
CKPT = E2E / "sgr.pth.tar"
CHECKPOINT_STAGES = ["startup", "imports", "device start", "data", "checkpoint", "tokenise", "encode images",
                     "encode captions", "score", "metrics", "save", "other", "total"]


def test_stages_add_up_in_the_order_first_entered():
    watch = Stopwatch(startup=1.5)
    with watch.stage("b"):
        time.sleep(0.02)
    with watch.stage("a"):
        pass
    with watch.stage("b"):      # entered again: added to its first time
        time.sleep(0.02)
    time.sleep(0.03)            # outside any stage: 'other'
    timings = watch.report()
    assert list(timings) == ["startup", "b", "a", "other", "total"]
    assert timings["startup"] == 1.5
    assert timings["b"] >= 0.04 and timings["a"] < 0.02
    assert timings["other"] >= 0.03
    parts = sum(value for name, value in timings.items() if name != "total")
    assert timings["total"] == pytest.approx(parts, abs=0.005)


def test_a_failing_stage_is_still_timed_and_stages_do_not_nest():
    watch = Stopwatch()
    with pytest.raises(KeyError), watch.stage("load"):
        raise KeyError("x")
    assert "load" in watch.report() and "startup" not in watch.report()
    with pytest.raises(RuntimeError, match="'inner' started inside stage 'outer'"), watch.stage("outer"):
        with watch.stage("inner"):
            pass
    with watch.stage("after"):     # the failed nesting left no stage open
        pass
    with stage(None, "nothing"):   # no stopwatch: times nothing
        pass


def test_a_cuda_stage_ends_when_the_device_has_finished(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    watch = Stopwatch(device="cpu")
    with watch.stage("encode"):
        pass
    assert waited == []
    watch.use(torch.device("cuda", 1))
    with watch.stage("score"):
        pass
    assert waited == ["cuda:1"]


def test_process_age():
    age = process_age()
    if not pathlib.Path("/proc/self/stat").exists():
        assert age is None
        return
    uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    assert 0.0 <= age < uptime
    child = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); from sgraf.stopwatch import "
                            "process_age; print(process_age())"], capture_output=True, text=True, check=True)
    assert 0.25 <= float(child.stdout) < 30


def test_process_age_is_none_where_proc_cannot_be_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise FileNotFoundError(2, "No such file", "/proc/self/stat")

    monkeypatch.setattr(stopwatch_module, "open", refuse, raising=False)
    assert process_age() is None


def test_format_timings():
    assert format_timings({"imports": 2.4049, "total": 9.8}) == "imports 2.40 s, total 9.80 s"


def evaluate(capsys, *args):
    assert main(["evaluate", *map(str, args), "--quiet"]) == 0
    return capsys.readouterr()


def test_evaluate_timings_of_a_checkpoint(capsys, tmp_path):
    args = ["--checkpoint", CKPT, "--data", DATA, "--vocab", VOCAB, "--json"]
    plain = json.loads(evaluate(capsys, *args).out)
    timed = evaluate(capsys, *args, "--timings", "--save-sims", tmp_path / "sims.npy")
    result = json.loads(timed.out)
    timings = result.pop("timings")
    assert result == plain                              # the metrics are the same, timings added
    expected = CHECKPOINT_STAGES if process_age() is not None else CHECKPOINT_STAGES[1:]
    assert list(timings) == expected
    assert all(value >= 0 for value in timings.values())
    parts = sum(value for name, value in timings.items() if name != "total")
    assert timings["total"] == pytest.approx(parts, abs=0.01)
    line = [text for text in timed.err.splitlines() if "timings:" in text]
    assert len(line) == 1 and line[0].startswith("sgraf evaluate: timings: ") and line[0].endswith(
        f"total {timings['total']:.2f} s")
    table = evaluate(capsys, *args[:-1], "--timings")    # the table, and the stages on stderr
    assert "rsum" in table.out and "timings" not in table.out and "score " in table.err


def test_evaluate_timings_of_saved_matrices(capsys, tmp_path):
    sims, other = tmp_path / "sims.npy", tmp_path / "other.npy"
    evaluate(capsys, "--checkpoint", CKPT, "--data", DATA, "--vocab", VOCAB, "--save-sims", sims)
    shutil.copyfile(sims, other)          # two matrices to average (one file twice is refused)
    result = json.loads(evaluate(capsys, "--sims", sims, other, "--json", "--timings",
                                 "--save-sims", tmp_path / "mean.npy").out)
    assert [name for name in result["timings"] if name != "startup"] == ["imports", "load", "metrics", "save",
                                                                         "other", "total"]
    assert "timings" not in json.loads(evaluate(capsys, "--sims", sims, "--json").out)
