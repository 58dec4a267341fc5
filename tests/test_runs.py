"""`sgraf runs` (`sgraf.training.runs`): run folders side by side, each run's state read from its
files (finished, stopped with the command that resumes it, running, never started, unreadable),
and the settings and data that set the runs apart."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
from pathlib import Path

import pytest
import torch

from sgraf.cli import main
from sgraf.training import runs
from train_helpers import make_toy_precomp


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two finished tiny runs on one split (`a`: 2 epochs; `b`: 1 epoch at another lr) and one
    on a copy of the split with one dev caption changed (`other/d`)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    data = make_toy_precomp(root / "data", n_train=32, n_dev=8)
    other = root / "data-other"
    shutil.copytree(data, other)
    captions = (other / "dev_caps.txt").read_text().splitlines()
    (other / "dev_caps.txt").write_text("\n".join(["a red dog in the park", *captions[1:]]) + "\n")
    for name, folder, extra in (("a", data, ["epochs=2"]), ("b", data, ["epochs=1", "lr=0.001"]),
                                ("other/d", other, ["epochs=1"])):
        assert main(["train", "--data", str(folder), "--out", str(root / "runs" / name), "--preset", "tiny",
                     "--set", *extra]) == 0
    return root


def listing(capsys, *argv) -> dict:
    assert main(["runs", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_finished_runs_with_their_best_and_what_sets_them_apart(trained, capsys):
    summary = listing(capsys, trained / "runs" / "a", trained / "runs" / "b")
    a, b = summary["runs"]
    assert [a["state"], b["state"]] == ["finished", "finished"]
    assert (a["epochs_done"], a["epochs"], b["epochs_done"], b["epochs"]) == (2, 2, 1, 1)
    best = max(records(trained / "runs" / "a"), key=lambda record: record["rsum"])
    assert a["best"] == {key: best[key] for key in ("rsum", "epoch", "step")}
    assert a["last_rsum"] == records(trained / "runs" / "a")[-1]["rsum"]
    assert summary["differ"] == ["epochs", "lr"]          # the data is the same; nothing else differs
    assert a["settings"] == {"epochs": 2, "lr": 0.01} and b["settings"] == {"epochs": 1, "lr": 0.001}
    assert main(["runs", str(trained / "runs" / "a"), str(trained / "runs" / "b")]) == 0
    text = capsys.readouterr().out
    assert "settings that differ:" in text and "finished" in text and f"{best['rsum']:.2f}" in text


def test_a_folder_of_runs_is_searched_and_other_data_is_named(trained, capsys):
    summary = listing(capsys, trained / "runs", "--sort", "rsum")
    paths = [Path(run["path"]).relative_to(trained / "runs").as_posix() for run in summary["runs"]]
    assert sorted(paths) == ["a", "b", "other/d"]
    rsums = [run["best"]["rsum"] for run in summary["runs"]]
    assert rsums == sorted(rsums, reverse=True)
    assert summary["differ"][0] == "data"
    by_path = {Path(run["path"]).name: run for run in summary["runs"]}
    assert by_path["d"]["settings"]["data"] == str((trained / "data-other").resolve())
    assert main(["runs", str(trained / "runs")]) == 0
    text = capsys.readouterr().out
    assert "train on different data: their dev rsums are on different dev splits" in text
    assert "(files " not in text                  # two folders: their paths tell them apart
    # one folder whose files changed between two runs: the table names the files too
    changed = trained / "changed-data-run"
    shutil.copytree(trained / "runs" / "b", changed)
    config = changed / "config.yaml"
    config.write_text(config.read_text().replace("dev_caps.txt: ", "dev_caps.txt: 0", 1))
    try:
        assert main(["runs", str(trained / "runs" / "a"), str(changed)]) == 0
        rows = [line for line in capsys.readouterr().out.splitlines() if "(files " in line]
        assert len(rows) == 2 and len({line.split("(files ")[1][:8] for line in rows}) == 2, rows
    finally:
        shutil.rmtree(changed)
    # a run that also recorded the boxes, sizes and scenes files (a model with positions) on the same
    # files trains on the same data: its dev rsum compares (the demo's runs had been told apart)
    positioned = trained / "positions-run"
    shutil.copytree(trained / "runs" / "b", positioned)
    config = positioned / "config.yaml"
    assert "\ndata_fingerprint:\n" in config.read_text()
    config.write_text(config.read_text().replace("data_fingerprint:\n", "data_fingerprint:\n  dev_boxes.npy: 1234\n"
                                                 "  train_scenes.jsonl: 5678\n", 1))
    try:
        summary = listing(capsys, trained / "runs" / "a", positioned)
        assert "data" not in summary["differ"] and len({run["data_files"] for run in summary["runs"]}) == 1
        assert main(["runs", str(trained / "runs" / "a"), str(positioned)]) == 0
        assert "different data" not in capsys.readouterr().out
    finally:
        shutil.rmtree(positioned)
    # one data set, validated on different shares of its dev split: said too
    shorter = trained / "shorter-validation"
    shutil.copytree(trained / "runs" / "b", shorter)
    config = shorter / "config.yaml"
    config.write_text(config.read_text().replace("val_max_captions: null", "val_max_captions: 20"))
    log = shorter / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    whole = records[-1]["n_captions"]
    assert whole > 20
    log.write_text("".join(json.dumps({**r, "n_captions": 20, "n_images": 4}) + "\n" for r in records))
    try:
        assert main(["runs", str(trained / "runs" / "b"), str(shorter)]) == 0
        assert "validate on different shares of the dev split, val_max_captions" in capsys.readouterr().out
        # a cap above the dev split's size validates all of it, as none does: the same share
        config.write_text(config.read_text().replace("val_max_captions: 20", f"val_max_captions: {whole + 5}"))
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
        summary = listing(capsys, trained / "runs" / "b", shorter)
        assert "val_max_captions" not in summary["differ"], summary["differ"]
        assert main(["runs", str(trained / "runs" / "b"), str(shorter)]) == 0
        assert "different shares" not in capsys.readouterr().out
    finally:
        shutil.rmtree(shorter)


def test_a_stopped_run_says_how_to_resume_and_that_command_finishes_it(trained, tmp_path, capsys):
    run = tmp_path / "c"
    shutil.copytree(trained / "runs" / "a", run)
    config = run / "config.yaml"     # a run of 3 epochs with 2 done: what a kill after epoch 2 leaves
    config.write_text(config.read_text().replace("\nepochs: 2\n", "\nepochs: 3\n"))
    (stopped,) = listing(capsys, run)["runs"]
    assert (stopped["state"], stopped["epochs_done"], stopped["epochs"]) == ("stopped", 2, 3)
    assert stopped["resume"] == f"sgraf train --resume {run}"
    spaced = tmp_path / "my run"                                   # quoted for the shell (it had not been)
    shutil.copytree(run, spaced)
    (listed,) = listing(capsys, spaced)["runs"]
    assert listed["resume"] == f"sgraf train --resume '{spaced}'"
    shutil.rmtree(spaced)
    torch.set_num_threads(1)
    assert main(shlex.split(stopped["resume"])[1:]) == 0
    assert capsys.readouterr().out.startswith("finished 3 epochs")
    (resumed,) = listing(capsys, run)["runs"]
    assert (resumed["state"], resumed["epochs_done"], resumed["step"]) == ("finished", 3, records(run)[-1]["step"])


def test_running_never_started_and_unreadable_runs(trained, tmp_path, capsys):
    running = tmp_path / "running"
    shutil.copytree(trained / "runs" / "b", running)
    config = running / "config.yaml"
    config.write_text(config.read_text().replace("\nepochs: 1\n", "\nepochs: 5\n"))
    lock = running / ".sgraf-lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-12-02 20:00:00 UTC",
                                "command": "sgraf train --resume running"}))
    failed = tmp_path / "failed"
    failed.mkdir()
    shutil.copy(trained / "runs" / "b" / "config.yaml", failed / "config.yaml")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("epochs: [2\n")
    (broken / "metrics.jsonl").write_text("")
    summary = listing(capsys, tmp_path)
    states = {Path(run["path"]).name: run for run in summary["runs"]}
    assert states["running"]["state"] == "running" and f"pid {os.getpid()}" in states["running"]["holder"]
    assert states["failed"]["state"] == "not started" and states["failed"]["best"] is None
    assert states["broken"]["state"] == "unreadable" and "config.yaml" in states["broken"]["problem"]
    assert "epochs" in summary["differ"]       # the unreadable one is left out of the comparison
    killed = tmp_path / "killed"               # validated, then killed before its first last.pt
    killed.mkdir()
    shutil.copy(trained / "runs" / "b" / "metrics.jsonl", killed / "metrics.jsonl")
    (killed / "config.yaml").write_text(config.read_text())     # the running one's: 5 epochs
    from sgraf.training.run_dir import prepare_run_dir

    starting, starting_lock = prepare_run_dir(tmp_path / "starting", resume=False)   # a run's lock, no config yet
    assert json.loads((starting / ".sgraf-lock").read_text())["purpose"] == "training run"
    demo = tmp_path / "demo-running"            # the lock of another command's folder (a demo's) is no run
    demo.mkdir()
    (demo / ".sgraf-lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    states = {Path(run["path"]).name: run for run in listing(capsys, tmp_path)["runs"]}
    assert states["killed"]["state"] == "stopped before a checkpoint" and states["killed"]["best"] is not None
    assert states["starting"]["state"] == "running" and states["starting"]["module"] is None
    assert "demo-running" not in states
    assert "epochs" in listing(capsys, tmp_path)["differ"]      # a starting run sets nothing apart
    assert main(["runs", str(tmp_path)]) == 0
    assert "stopped before a checkpoint (no last.pt: killed before its first, or deleted; nothing to resume: " \
           "train it again with another --out)" in \
        capsys.readouterr().out
    assert [run["state"] for run in listing(capsys, starting)["runs"]] == ["running"]
    starting_lock.release()
    (starting / ".sgraf-lock").write_text("")
    (starting / ".sgraf-lock").write_text(json.dumps({"pid": 2 ** 22 + 12345, "host": socket.gethostname()}))
    assert main(["runs", str(starting)]) == 2           # a dead run's lock alone: no run folder
    assert "holds only the lock of a command that stopped before writing anything" in capsys.readouterr().err
    lock.write_text(json.dumps({"pid": 2 ** 22 + 12345, "host": socket.gethostname()}))   # a killed run's lock
    assert runs.read_run(running).state == "stopped"
    assert main(["runs", str(tmp_path)]) == 0
    assert "unreadable: " in capsys.readouterr().out
    # an empty config.yaml, and a damaged metrics.jsonl (not a line cut short at its end), are said
    (broken / "config.yaml").write_text("")
    assert runs.read_run(broken).problem == "config.yaml holds no settings"
    damaged = tmp_path / "damaged"
    shutil.copytree(trained / "runs" / "b", damaged)
    records = (damaged / "metrics.jsonl").read_bytes()
    (damaged / "metrics.jsonl").write_bytes(b"\x00\xff garbage\n" + records)
    assert runs.read_run(damaged).state == "unreadable"
    assert "metrics.jsonl: line 1 is not a JSON record" in runs.read_run(damaged).problem
    (damaged / "metrics.jsonl").write_bytes(records + b'{"step": 9')          # a torn last line: skipped
    assert runs.read_run(damaged).state == "finished"


def test_bad_folders_are_one_line_errors(trained, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for argv, message in (([tmp_path / "absent"], "absent: no such folder"),
                          ([tmp_path / "file.txt"], "file.txt is a file, expected a run folder"),
                          ([tmp_path / "empty"], "empty holds no sgraf run folder"),
                          ([trained / "runs" / "a", "--sort", "loss"], "argument --sort: invalid choice")):
        assert main(["runs", *map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    summary = listing(capsys, trained / "runs" / "a", trained / "runs" / "a" / ".")
    assert len(summary["runs"]) == 1 and summary["differ"] == []
    # from Python one folder (a str or a path) is a list of one, not its characters
    assert runs.find_runs(str(trained / "runs")) == runs.find_runs([trained / "runs"])
    assert len(runs.summarise(trained / "runs" / "a")["runs"]) == 1


def test_listing_runs_does_not_import_pytorch(trained):
    """A listing is a glance at the folders: PyTorch's second of import is not part of it."""
    import subprocess
    import sys

    code = ("import sys; from sgraf.cli import main; assert main(['runs', sys.argv[1]]) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code, str(trained / "runs")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src")))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished" in done.stdout


def _colours(png: Path) -> set[tuple[int, int, int]]:
    from PIL import Image

    with Image.open(png) as picture:
        return {colour[:3] for _, colour in picture.convert("RGB").getcolors(maxcolors=1 << 20)}


def test_plot_draws_each_run_in_its_colour_and_refuses_to_draw_over_a_run(trained, tmp_path, capsys, caplog):
    """matplotlib's first three line colours (C0, C1, C2) fill the markers of the first three runs."""
    first, second, third = (31, 119, 180), (255, 127, 14), (44, 160, 44)
    caplog.set_level("INFO", logger="sgraf.cli.runs")
    two = tmp_path / "two.png"
    assert main(["runs", str(trained / "runs" / "a"), str(trained / "runs" / "b"), "--plot", str(two)]) == 0
    assert "finished" in capsys.readouterr().out
    assert f"drew the curves of 2 runs into {two}" in caplog.text
    assert {first, second} <= _colours(two) and third not in _colours(two)
    three = tmp_path / "three.png"
    assert main(["runs", str(trained / "runs"), "--plot", str(three)]) == 0
    assert {first, second, third} <= _colours(three)
    from sgraf.cli.runs import _legend_names

    assert _legend_names([str(trained / "runs" / "a"), str(trained / "runs" / "other" / "d")]) == ["a", "other/d"]
    assert _legend_names([str(trained / "runs" / "a") + "/"]) == ["a"]

    never = tmp_path / "never"
    never.mkdir()
    shutil.copy(trained / "runs" / "b" / "config.yaml", never / "config.yaml")
    own = trained / "runs" / "a" / "curves.png"
    before = own.read_bytes()
    for argv, message in (([never, "--plot", tmp_path / "n.png"], "none of the runs has a validation yet"),
                          ([trained / "runs" / "a", "--plot", own], "is the input run file"),
                          ([trained / "runs" / "a", "--plot", tmp_path / "n.jpg"], "--plot")):
        assert main(["runs", *map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert own.read_bytes() == before and not (tmp_path / "n.png").exists()
    other = trained / "runs" / "b" / "curves.png"         # a run not listed: its files are not outputs either
    kept_other = other.read_bytes()
    assert main(["runs", str(trained / "runs" / "a"), "--plot", str(other)]) == 2
    assert f"--plot {other} is the curves.png of the run folder {other.parent}" in capsys.readouterr().err
    assert other.read_bytes() == kept_other
    # from Python: the same guards (a run's own file, no runs, a folder that is not there)
    from sgraf.errors import InputError
    from sgraf.training.plots import plot_curves, plot_runs

    metrics = trained / "runs" / "a" / "metrics.jsonl"
    kept = metrics.read_bytes()
    for runs_, path, message in (({"a": trained / "runs" / "a"}, metrics, "is the input run file"),
                                 ({}, tmp_path / "x.png", "no runs to draw"),
                                 ({"x": tmp_path / "absent"}, tmp_path / "x.png", "absent: no such run folder")):
        with pytest.raises(InputError, match=message):
            plot_runs(runs_, path)
    assert metrics.read_bytes() == kept and not (tmp_path / "x.png").exists()
    with pytest.raises(InputError, match="absent: no such run folder"):
        plot_curves(tmp_path / "absent")
    assert plot_curves(never) is None                      # a run without a validation draws nothing


def test_drawing_leaves_the_callers_matplotlib_backend_alone(trained, tmp_path):
    """A notebook's `%matplotlib inline` backend stays its own: sgraf had switched it to Agg for
    the rest of the session (every later plt.show() showed nothing)."""
    import matplotlib.pyplot as plt

    from sgraf.training.plots import plot_curves, plot_runs

    before = plt.get_backend()
    plt.switch_backend("svg")
    try:
        figures = plt.get_fignums()
        assert plot_curves(trained / "runs" / "a", tmp_path / "a.png").stat().st_size > 1000
        assert plot_runs({"a": trained / "runs" / "a"}, tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
        assert plt.get_backend() == "svg" and plt.get_fignums() == figures    # no figure left open either
    finally:
        plt.switch_backend(before)


def test_a_setting_without_effect_sets_no_run_apart(tmp_path, capsys):
    """Two SAF runs that differ only in sgr_step are the same model (their weights were bit
    identical): no column; nor beside SGR runs that all take the same sgr_step (the demo's table
    had shown sgr_step 3 and '-' by module); beside SGR runs of other steps the SAF runs' reads '-'."""
    for name, module, step in (("saf-a", "saf", 1), ("saf-b", "saf", 4), ("sgr", "sgr", 3)):
        _fake_run(tmp_path / name, tmp_path, f"module: {module}\nsgr_step: {step}\n")
    assert main(["runs", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["differ"] == ["module"]
    _fake_run(tmp_path / "sgr-2", tmp_path, "module: sgr\nsgr_step: 2\n")
    assert main(["runs", str(tmp_path / "saf-a"), str(tmp_path / "saf-b"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["differ"] == []
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0].rstrip("/").rsplit("/", 1)[-1]: line.split()[1:] for line in out.splitlines()
            if line.strip().startswith(str(tmp_path)) and "module" not in line}
    assert "(-: the setting has no effect in that run, as sgr_step without an SGR head)" in out, out
    assert [rows["saf-a"][-1], rows["saf-b"][-1], rows["sgr"][-1], rows["sgr-2"][-1]] == ["-", "-", "3", "2"], out


def _fake_run(run: Path, data: Path, settings: str) -> None:
    """A run folder of one validation, configured by `settings` (YAML lines) on the tiny preset."""
    run.mkdir()
    (run / "config.yaml").write_text(f"data: {data}\npreset: tiny\n{settings}epochs: 1\n")
    (run / "metrics.jsonl").write_text('{"epoch": 1, "step": 4, "end_of_epoch": true, "rsum": 100.0, "best": true}\n')


def test_the_place_terms_settings_read_dash_in_a_run_without_one(tmp_path, capsys):
    for name, positions, sharpness in (("box", "box", 1.0), ("place", "place", 2.0)):
        _fake_run(tmp_path / name, tmp_path, f"module: sgr\npositions: {positions}\nplace_sharpness: {sharpness}\n")
    assert main(["runs", str(tmp_path / "box"), str(tmp_path / "place"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["differ"] == ["positions"]                          # one place run: no sharpness to compare
    _fake_run(tmp_path / "place-4", tmp_path, "module: sgr\npositions: place\nplace_sharpness: 4.0\n")
    assert main(["runs", str(tmp_path / "box"), str(tmp_path / "place"), str(tmp_path / "place-4"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["differ"] == ["positions", "place_sharpness"]
    box, place, _ = summary["runs"]
    assert box["unused_settings"] == ["place_sharpness"] and place["unused_settings"] == []


def test_family_share_sets_no_run_without_family_batches_apart(tmp_path, capsys):
    """The demo's runs table had set its random-batch runs apart by family_share 1.0 against 0.5."""
    for name, batches, share in (("random", "random", 1.0), ("families", "families", 0.5)):
        _fake_run(tmp_path / name, tmp_path, f"module: sgr\nbatches: {batches}\nfamily_share: {share}\n")
    assert main(["runs", str(tmp_path / "random"), str(tmp_path / "families"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["differ"] == ["batches"]          # family_share: without effect in the random run
    assert [run["unused_settings"] for run in summary["runs"]] == [[], []]


def test_a_folder_of_only_a_stale_lock_says_the_run_never_began(tmp_path, capsys):
    """A run killed before its config.yaml leaves only its lock: `runs` and `--resume` had called
    it no run folder, without saying what to do."""
    from sgraf.folder_lock import LOCK_FILE

    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": socket.gethostname()}))
    assert main(["runs", str(dead)]) == 2
    assert "holds only the lock of a command that stopped before writing anything" in capsys.readouterr().err
    assert main(["train", "--resume", str(dead)]) == 2
    assert "(a run stopped before it began: start it again with --out)" in capsys.readouterr().err


def test_a_folder_of_only_a_live_lock_says_its_holder_is_at_work(tmp_path, capsys):
    """A demo starting (or a run loading its data) holds only its lock: it had been called stopped."""
    from sgraf.folder_lock import FolderLock

    starting = tmp_path / "starting"
    starting.mkdir()
    with FolderLock(starting, purpose="demo"):
        assert main(["runs", str(starting)]) == 2
        err = capsys.readouterr().err
        assert f"{starting} is in use by another sgraf process that has written nothing there yet (pid " \
               f"{os.getpid()}" in err, err
        assert main(["train", "--resume", str(starting)]) == 2
        assert "cannot resume: " in capsys.readouterr().err


def test_a_record_without_a_step_is_left_out_of_the_plot(trained, tmp_path, capsys):
    """A record edited by hand without its step (the listing takes it) had stopped --plot with a KeyError."""
    run = tmp_path / "edited"
    shutil.copytree(trained / "runs" / "a", run)
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"epoch": 9, "rsum": 1.0}\n')
    assert main(["runs", str(run), "--plot", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.png").stat().st_size > 0
