"""No data lost or mixed, no temporary names in errors, signals end commands cleanly (issue 14).

Folder locks (`sgraf.folder_lock`), generations of output files (`sgraf.output_folder`),
atomic writes (`sgraf.atomic_write`) and SIGTERM/SIGINT (`sgraf.signals`), through the
commands that use them.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sgraf import folder_lock
from sgraf.atomic_write import write_text
from sgraf.cli import main
from sgraf.data.benchmark import generate_benchmark
from sgraf.data.convert import convert_tsv
from sgraf.data.features import GridBackbone, extract_folder
from sgraf.data.render import SceneObject, render_scene
from sgraf.errors import InputError
from sgraf.folder_lock import LOCK_FILE, FolderLock, FolderLockedError
from sgraf.output_folder import RECORD, STAGING_PREFIX
from sgraf.training.run_dir import prepare_run_dir

SRC = Path(__file__).resolve().parents[1] / "src"


def tiny(n_test: int = 8) -> list[str]:
    """`sgraf generate` arguments of a benchmark generated in a fraction of a second."""
    return ["--features", "synthetic", "--n-train", "4", "--n-dev", "4", "--n-test", str(n_test),
            "--synthetic-dim", "8"]


TINY = tiny()


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _hold_lock_in_another_process(folder: Path) -> subprocess.Popen:
    code = ("import sys, time; from sgraf.folder_lock import FolderLock; FolderLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


# --------------------------------------------------------------------------------- folder locks
def test_a_second_training_run_into_a_locked_run_folder_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = _hold_lock_in_another_process(run)
    try:
        # the lock is checked before the data: a missing data folder is not what is reported
        assert main(["train", "--data", str(tmp_path / "data"), "--out", str(run)]) == 2
        err = _one_line_error(capsys)
        assert f"{run} is in use by another sgraf process (pid {holder.pid} on host {socket.gethostname()}, " \
               "started 20" in err and f"command: python -c {run})" in err
        assert not (run / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_does_not_block_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data: x\n")
    (run / "last.pt").write_bytes(b"")
    holder = _hold_lock_in_another_process(run)
    with pytest.raises(FolderLockedError, match=f"pid {holder.pid}"):
        prepare_run_dir(run, resume=True)
    holder.kill()                                    # SIGKILL: the holder's record stays behind
    holder.wait()
    assert str(holder.pid) in (run / LOCK_FILE).read_text()
    claimed, lock = prepare_run_dir(run, resume=True)
    assert claimed == run and lock.held and f'"pid": {os.getpid()}' in (run / LOCK_FILE).read_text()
    lock.release()
    assert not (run / LOCK_FILE).exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX")
def test_a_forked_worker_that_outlives_its_killed_parent_holds_no_lock(tmp_path):
    """DataLoader workers, forked with the lock's descriptor, outlived a `kill -9` of their run by
    seconds: the flock stayed, and an immediate --resume was refused, naming the dead parent."""
    code = ("import os, signal, sys, time; from sgraf.folder_lock import FolderLock; "
            "lock = FolderLock(sys.argv[1]); lock.acquire()\n"
            "if os.fork() == 0:\n"
            "    os.write(1, b'child %d\\n' % (not lock.held)); time.sleep(30); os._exit(0)\n"
            "os.write(1, b'forked\\n'); time.sleep(60)")      # one write each: lines never interleave
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    try:
        said = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}
        assert said == {"forked", "child 1"}, said      # the child dropped its copy (run in the fork)
        parent.kill()                                  # the parent alone: its forked child lives on
        parent.wait()
        lock = FolderLock(tmp_path)
        lock.acquire()                                 # at once
        assert lock.held
        lock.release()
    finally:
        os.killpg(parent.pid, signal.SIGKILL)


def test_a_second_lock_in_the_same_process_is_refused_too(tmp_path):
    with FolderLock(tmp_path):
        with pytest.raises(FolderLockedError, match=f"pid {os.getpid()} on host"):
            FolderLock(tmp_path).acquire()
    with FolderLock(tmp_path) as again:      # released on exit
        assert again.held


def test_without_file_system_locks_the_record_decides(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    record = {"pid": 0, "host": socket.gethostname(), "started": "then", "command": "sgraf train"}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record["pid"] = int(dead.stdout)                 # a process of this host that has ended
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with FolderLock(tmp_path):
        pass
    record["pid"] = os.getppid()                     # alive
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(FolderLockedError, match=f"pid {os.getppid()}"):
        FolderLock(tmp_path).acquire()
    record["host"] = "elsewhere.example"             # cannot be checked from here
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(FolderLockedError, match=f"delete {tmp_path / LOCK_FILE} if that run is gone"):
        FolderLock(tmp_path).acquire()


def test_demo_refuses_a_folder_another_demo_is_writing(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / ".sgraf-demo").write_text("an earlier demo\n")
    with FolderLock(out):
        assert main(["demo", "--quick", "--out", str(out)]) == 2
    assert f"{out} is in use by another sgraf process (pid {os.getpid()}" in _one_line_error(capsys)


def test_generate_refuses_a_folder_another_command_is_writing(tmp_path, capsys):
    with FolderLock(tmp_path):
        assert main(["generate", "--out", str(tmp_path), *TINY]) == 2
    assert "is in use by another sgraf process" in _one_line_error(capsys)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------- generations
def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_generate_refuses_existing_data_and_overwrite_leaves_no_earlier_picture(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["generate", "--out", str(out), *TINY]) == 0
    before = _files(out)
    assert len(list((out / "images" / "test").glob("*.png"))) == 8
    capsys.readouterr()
    assert main(["generate", "--out", str(out), *tiny(4), "--seed", "3"]) == 2
    err = _one_line_error(capsys)
    assert f"{out} already holds other data (" in err and "pass --overwrite" in err
    assert _files(out) == before                                   # refused before writing anything
    (out / "test_caps.txt").chmod(0o600)                           # private: stays private (it had become 0644)
    (out / "dev_caps.txt").chmod(0o444)
    assert main(["generate", "--out", str(out), *tiny(4), "--seed", "3", "--overwrite"]) == 0
    if os.name == "posix":
        assert [oct((out / name).stat().st_mode & 0o777) for name in ("test_caps.txt", "dev_caps.txt")] == [
            "0o600", "0o444"]
    (out / "dev_caps.txt").chmod(0o644)
    assert sorted(p.name for p in (out / "images" / "test").iterdir()) == [f"{i:05d}.png" for i in range(4)]
    scenes = [json.loads(line) for line in (out / "test_scenes.jsonl").read_text().splitlines()]
    assert len(scenes) == 4 and np.load(out / "test_ims.npy").shape[0] == 4
    assert (out / "test_caps.txt").read_bytes() != before["test_caps.txt"]
    assert main(["generate", "--out", str(out), *TINY, "--no-images", "--overwrite"]) == 0
    assert not (out / "images").exists()                           # pictures of no generation left
    assert not [p for p in out.iterdir() if p.name.startswith((STAGING_PREFIX, LOCK_FILE))]


def test_generate_overwrite_finishes_a_generation_killed_while_it_moved_in(tmp_path, capsys, monkeypatch):
    """A kill in the middle of the swap (SIGKILL: no signal can be deferred) leaves some of each
    generation: the record names both while they swap, so --overwrite again replaces what is there
    (it had named the new one only, and the earlier pictures then counted as files sgraf never wrote)."""
    from sgraf.output_folder import folder_files

    class Killed(BaseException):
        pass

    out = tmp_path / "bench"
    for dies_in in ("out", "in"):       # the earlier generation going out (aside), the new one coming in
        shutil.rmtree(out, ignore_errors=True)
        assert main(["generate", "--out", str(out), *TINY]) == 0
        real, calls = os.replace, []

        def die_on_the_third(*args, real=real, calls=calls, dies_in=dies_in, **kwargs):
            target = str(args[0] if dies_in == "out" else args[1])     # the folder's side of the move
            if "images" in target and STAGING_PREFIX not in target:
                calls.append(target)
                if len(calls) == 3:
                    raise Killed                     # the process dies here
            return real(*args, **kwargs)

        monkeypatch.setattr(os, "replace", die_on_the_third)
        with pytest.raises(Killed):
            main(["generate", "--out", str(out), *tiny(4), "--seed", "3", "--overwrite"])
        monkeypatch.undo()
        recorded = json.loads((out / RECORD).read_text())["files"]
        assert folder_files(out) and all(name in recorded for name in folder_files(out)), dies_in
        assert main(["generate", "--out", str(out), *tiny(4), "--seed", "3", "--overwrite"]) == 0
        assert sorted(p.name for p in (out / "images" / "test").iterdir()) == [f"{i:05d}.png" for i in range(4)]
        assert sorted(json.loads((out / RECORD).read_text())["files"]) == sorted(folder_files(out))


def test_an_overwrite_that_fails_midway_puts_the_earlier_data_set_back(tmp_path, capsys, monkeypatch):
    """The earlier generation had been deleted file by file before the new one moved in: a step
    that failed midway (on Windows, a file another program holds open) lost the data set."""
    out = tmp_path / "bench"
    assert main(["generate", "--out", str(out), *TINY]) == 0
    before = {path.relative_to(out).as_posix(): path.read_bytes() for path in out.rglob("*") if path.is_file()}
    real, calls = os.replace, []

    def busy_on_the_fifth(source, target, *args, **kwargs):
        if STAGING_PREFIX not in str(target):        # a new file moving in
            calls.append(target)
            if len(calls) == 5:
                raise PermissionError(13, "The process cannot access the file", str(target))
        return real(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", busy_on_the_fifth)
    assert main(["generate", "--out", str(out), *tiny(4), "--seed", "3", "--overwrite"]) == 2
    assert "cannot access the file" in _one_line_error(capsys)
    monkeypatch.undo()
    after = {path.relative_to(out).as_posix(): path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert after == before                           # every earlier file back, nothing of the new one


def test_generate_overwrite_never_deletes_files_sgraf_did_not_write(tmp_path, capsys):
    out = tmp_path / "bench"
    generate_benchmark(out, features="synthetic", n_train=4, n_dev=4, n_test=4, synthetic_dim=8)
    (out / "notes.txt").write_text("mine")                         # not data: kept, never in the way
    (out / "test_image_ids.txt").write_text("1\t192\t192\n")   # would describe the old test images
    before = _files(out)
    assert main(["generate", "--out", str(out), *TINY, "--overwrite"]) == 2
    err = _one_line_error(capsys)
    assert f"{out / 'test_image_ids.txt'} was not written by sgraf and would stay beside the new output" in err
    assert _files(out) == before
    (out / "test_image_ids.txt").unlink()
    assert main(["generate", "--out", str(out), *TINY, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    recorded = json.loads((out / RECORD).read_text())["files"]
    assert "notes.txt" not in recorded and recorded["test_ims.npy"] == "generate"


def test_overwrite_replaces_a_benchmark_generated_before_sgraf_recorded_its_files(tmp_path):
    out = tmp_path / "bench"
    generate_benchmark(out, features="synthetic", n_train=4, n_dev=4, n_test=8, synthetic_dim=8)
    (out / RECORD).unlink()                       # as an earlier sgraf left it: benchmark.json tells the files
    generate_benchmark(out, features="synthetic", n_train=4, n_dev=4, n_test=4, synthetic_dim=8, overwrite=True)
    assert len(list((out / "images" / "test").iterdir())) == 4


def test_generate_out_naming_a_file_is_one_line_error(tmp_path, capsys):
    target = tmp_path / "data.npy"
    target.write_bytes(b"keep")
    assert main(["generate", "--out", str(target), *TINY]) == 2
    assert _one_line_error(capsys) == f"sgraf generate: error: output folder {target} is a file, expected a folder"
    assert target.read_bytes() == b"keep"


def test_an_interrupted_generation_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "bench"
    generate_benchmark(out, features="synthetic", n_train=4, n_dev=4, n_test=4, synthetic_dim=8)
    before = _files(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("sgraf.data.benchmark.build_vocab", interrupted)   # after every split is written
    with pytest.raises(KeyboardInterrupt):
        generate_benchmark(out, seed=5, features="synthetic", n_train=4, n_dev=4, n_test=8, synthetic_dim=8,
                           overwrite=True)
    assert _files(out) == before



def test_a_refused_command_leaves_no_folder_it_made(tmp_path, capsys):
    """'Nothing has been written when the error appears': not even the output folder (and the
    parents) a command made before it found its input bad; a folder that was there stays."""
    (tmp_path / "empty-data").mkdir()
    (tmp_path / "bad.tsv").write_text("1000\tnot enough fields\n")
    (tmp_path / "kept").mkdir()
    runs = [["train", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "runs" / "a"), "--preset", "tiny"],
            ["train", "--data", str(tmp_path / "empty-data"), "--out", str(tmp_path / "runs" / "b" / "c"),
             "--preset", "tiny"],
            ["train", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "kept"), "--preset", "tiny"],
            ["convert-tsv", "--tsv", str(tmp_path / "bad.tsv"), "--out", str(tmp_path / "new" / "data"), "--split",
             "train", "--no-progress"],
            ["convert-tsv", "--tsv", str(tmp_path / "bad.tsv"), "--out", str(tmp_path / "kept"), "--split", "train",
             "--no-progress"]]
    for argv in runs:
        assert main(argv) == 2, argv
        _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "empty-data", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_lock_that_cannot_be_written_leaves_no_folder_made(tmp_path, capsys, monkeypatch):
    """On a full disk the lock file of train, index and demo could not be created, and the folders
    each had made for its output stayed (generate and convert-tsv took theirs back)."""
    def no_space(self):
        raise InputError(f"cannot lock {self.folder}: No space left on device (creating {self.path.name})")

    data = tmp_path / "data"
    generate_benchmark(data, seed=0, features="synthetic", n_train=20, n_dev=10, n_test=10, save_images=False,
                       synthetic_dim=8, min_count=1)
    monkeypatch.setattr(FolderLock, "acquire", no_space)
    for argv in (["train", "--data", str(data), "--out", str(tmp_path / "a" / "b" / "run"), "--preset", "tiny"],
                 ["demo", "--quick", "--out", str(tmp_path / "d" / "e")]):
        assert main(argv) == 2, argv
        assert "No space left on device" in _one_line_error(capsys)
    from sgraf import SGRAF, ModelConfig
    from sgraf.api import Matcher
    from sgraf.data.vocab import Vocabulary
    from sgraf.search import build_index

    model = SGRAF(ModelConfig(vocab_size=6, img_dim=8, word_dim=4, embed_size=8, sim_dim=4, num_regions=4)).eval()
    model.vocab = Vocabulary.from_words(["a", "dog"])
    with pytest.raises(InputError, match="No space left on device"):
        build_index(Matcher([model]), np.zeros((2, 4, 8), np.float32), ["a dog"] * 10, tmp_path / "i" / "j")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.float32).tobytes()).decode("ascii")


def _tsv(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    boxes = np.sort(rng.random((n, 2, 2, 2)) * 400, axis=2).reshape(n, 2, 4)   # x1 <= x2, y1 <= y2 inside
    rows = [f"{1000 + i}\t640\t480\t2\t{_b64(boxes[i])}\t{_b64(rng.random((2, 3)))}" for i in range(n)]
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def test_convert_tsv_removes_the_captions_of_an_earlier_run_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "data"
    captions = tmp_path / "caps.tsv"
    captions.write_text("".join(f"{1000 + i}\tcaption of {i}\n" for i in range(3)))
    convert_tsv(_tsv(tmp_path / "a.tsv", 3, 0), out, "test", captions_path=captions, progress=False)
    second = _tsv(tmp_path / "b.tsv", 2, 1)
    argv = ["convert-tsv", "--tsv", str(second), "--out", str(out), "--split", "test", "--no-progress"]
    assert main(argv) == 2
    assert f"{out} already holds other data (test_boxes.npy and 4 more); pass --overwrite" in _one_line_error(capsys)
    assert main([*argv, "--overwrite"]) == 0
    assert not (out / "test_caps.txt").exists()                    # the earlier run's captions: stale, removed
    assert np.load(out / "test_ims.npy").shape == (2, 2, 3) and np.load(out / "test_boxes.npy").shape == (2, 2, 4)


def test_convert_tsv_writes_features_beside_the_users_own_captions(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "test_caps.txt").write_text("a\nb\n")                   # the user's: not refused, never removed
    convert_tsv(_tsv(tmp_path / "a.tsv", 2, 0), out, "test", progress=False)
    convert_tsv(_tsv(tmp_path / "b.tsv", 2, 1), out, "test", progress=False, overwrite=True)
    assert (out / "test_caps.txt").read_text() == "a\nb\n"
    (out / "test_scenes.jsonl").write_text("{}\n")                # not the user's captions: in the way
    with pytest.raises(InputError, match=r"test_scenes\.jsonl was not written by sgraf and would stay beside"):
        convert_tsv(_tsv(tmp_path / "c.tsv", 2, 2), out, "test", progress=False, overwrite=True)


def test_a_companion_sgraf_did_not_write_is_refused_even_where_nothing_is_replaced(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "test_image_ids.txt").write_text("17\t64\t64\n")          # left of features deleted by hand
    render_scene([SceneObject("red", "square", "large", 0, 0, 32, 32)]).save(tmp_path / "im.png")
    (tmp_path / "caps.tsv").write_text("im.png\ta red square\n")
    with pytest.raises(InputError, match=f"^{out / 'test_image_ids.txt'} was not written by sgraf and would stay "
                                         "beside the new output of sgraf extract"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False)
    assert sorted(os.listdir(out)) == ["test_image_ids.txt"]


def _tiny_backbone() -> GridBackbone:
    torch.manual_seed(0)
    return GridBackbone(nn.Conv2d(3, 4, kernel_size=32, stride=32), feature_dim=4, image_size=64, name="tiny")


@pytest.mark.parametrize("split", ["../evil", "sub/test", "", ".hidden"])
def test_a_split_is_a_plain_name(tmp_path, capsys, split):
    """`--split ../evil` had written data/evil_*.npy outside the record (so --overwrite no longer
    knew them) while printing data/x/../evil_ims.npy."""
    tsv = _tsv(tmp_path / "a.tsv", 2, 0)
    assert main(["convert-tsv", "--tsv", str(tsv), "--out", str(tmp_path / "x"), "--split", split]) == 2
    assert "argument --split: expected a split name such as train, dev, test or testall" in _one_line_error(capsys)
    for argv in (["evaluate", "--sims", str(tsv)], ["data", "check", "--data", str(tmp_path)]):
        assert main([*argv, "--split", split]) == 2 and "argument --split" in _one_line_error(capsys)
    with pytest.raises(InputError, match="^split: expected a split name"):
        convert_tsv(tsv, tmp_path / "x", split, progress=False)
    with pytest.raises(InputError, match="^split: expected a split name"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", tmp_path / "x", split, _tiny_backbone(), progress=False)
    assert not (tmp_path / "x").exists() and sorted(os.listdir(tmp_path)) == ["a.tsv"]


def test_overwrite_never_replaces_a_file_of_the_users_own_of_an_output_name(tmp_path):
    """--overwrite replaces sgraf's files; boxes or captions the user wrote under the names
    extract writes stay theirs (extract had replaced them with exit 0)."""
    out = tmp_path / "data"
    out.mkdir()
    np.save(out / "test_boxes.npy", np.full((1, 4, 4), 7, np.float32))
    (out / "test_caps.txt").write_text("mine\n")
    before = _files(out)
    render_scene([SceneObject("red", "square", "large", 0, 0, 32, 32)]).save(tmp_path / "im.png")
    (tmp_path / "caps.tsv").write_text("im.png\ta red square\n")
    message = (f"^{out / 'test_boxes.npy'} is not among the files sgraf recorded writing there \\(.sgraf-files.json\\), "
               r"and sgraf extract would replace it \(--overwrite replaces only those\); move it away with the 1 other "
               "such files")
    for overwrite in (True, False):   # without --overwrite too: passing it would not help
        with pytest.raises(InputError, match=message):
            extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False,
                           overwrite=overwrite)
    assert _files(out) == before
    (out / "test_boxes.npy").unlink()
    (out / "test_caps.txt").unlink()
    extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False)
    extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False, overwrite=True)


def test_extract_overwrite_removes_boxes_and_ids_an_earlier_conversion_left(tmp_path):
    out = tmp_path / "data"
    convert_tsv(_tsv(tmp_path / "a.tsv", 3, 0), out, "test", progress=False)
    render_scene([SceneObject("red", "square", "large", 0, 0, 32, 32)]).save(tmp_path / "im.png")
    (tmp_path / "caps.tsv").write_text("im.png\ta red square\n")
    with pytest.raises(InputError, match=r"already holds other data \(test_boxes\.npy and 3 more\); pass --overwrite"):
        extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False)
    extract_folder(tmp_path, tmp_path / "caps.tsv", out, "test", _tiny_backbone(), progress=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "images", "test_boxes.npy", "test_caps.txt", "test_image_names.txt", "test_image_sizes.npy", "test_ims.npy"]
    assert [p.name for p in (out / "images" / "test").iterdir()] == ["00000.png"]   # the picture kept
    assert np.load(out / "test_boxes.npy").tolist() == [[[0, 0, 96, 96], [96, 0, 192, 96], [0, 96, 96, 192],
                                                         [96, 96, 192, 192]]]   # the extractor's cells


# --------------------------------------------------------------------------------- write errors
def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _assert_no_temporary_left(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(STAGING_PREFIX)]


def test_atomic_writes_name_the_users_path_when_the_disk_is_full(tmp_path, monkeypatch):
    from sgraf.checkpoint import atomic_save
    from sgraf.data.vocab import build_vocab
    from sgraf.evaluate import save_matrix

    monkeypatch.setattr(os, "replace", _no_space)
    writers = {"model.pt": lambda p: atomic_save({"a": torch.ones(1)}, p),
               "vocab.json": lambda p: build_vocab(["a cat"], min_count=1).save(p),
               "sims.npy": lambda p: save_matrix(np.zeros((1, 1)), p),
               "notes.txt": lambda p: write_text(p, "text")}
    for name, write in writers.items():
        with pytest.raises(InputError) as caught:
            write(tmp_path / name)
        assert str(caught.value) == f"cannot write {tmp_path / name}: No space left on device", name
    _assert_no_temporary_left(tmp_path)


def test_a_path_below_a_file_is_named_not_a_temporary_file(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train_caps.txt").write_text("a cat\n" * 4)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["vocab", "build", "--data", str(tmp_path / "data"), "--out", str(blocker / "v.json")]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"sgraf vocab build: error: cannot write {blocker / 'v.json'}: ") and ".tmp" not in err
    assert main(["vocab", "build", "--data", str(tmp_path / "data"), "--out", str(tmp_path)]) == 2
    assert _one_line_error(capsys) == f"sgraf vocab build: error: cannot write {tmp_path}: Is a directory"


def test_a_failed_generation_names_the_folders_file_not_the_staging_copy(tmp_path, monkeypatch):
    out = tmp_path / "data"
    import sgraf.output_folder as output_folder

    monkeypatch.setattr(output_folder.os, "replace", _no_space)
    with pytest.raises(InputError) as caught:
        convert_tsv(_tsv(tmp_path / "a.tsv", 2, 0), out, "test", progress=False)
    assert str(caught.value).startswith(f"cannot write {out}{os.sep}") and "No space left" in str(caught.value)
    assert STAGING_PREFIX not in str(caught.value) and ".tmp" not in str(caught.value)
    monkeypatch.undo()

    def full_disk(self, *args, **kwargs):       # inside the block: the staging copy fails to write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    tsv = _tsv(tmp_path / "b.tsv", 2, 0)
    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(InputError, match=f"^cannot write {out / 'test_image_ids.txt'}: No space left on device$"):
        convert_tsv(tsv, out, "test", progress=False)
    _assert_no_temporary_left(out)


# --------------------------------------------------------------------------------- signals
def test_sigterm_during_generate_exits_143_and_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    command = [sys.executable, "-m", "sgraf", "generate", "--out", str(out), "--features", "synthetic",
               "--n-train", "3000", "--n-dev", "4", "--n-test", "4", "--synthetic-dim", "8"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not list(out.glob(STAGING_PREFIX + "*/images/train/00010.png")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "sgraf generate: stopped by SIGTERM" and "Traceback" not in err
    assert not out.exists()        # no staging, no lock, no half data set: not even the folder it made


def test_sigterm_during_a_demo_training_exits_143_without_results_and_the_same_command_resumes(
        tmp_path, monkeypatch, capsys, caplog):
    import sgraf.training.loop as loop

    real_step = loop.train_step

    def step_then_sigterm(*args, **kwargs):
        result = real_step(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)      # the training loop saves last.pt and stops
        return result

    monkeypatch.setattr(loop, "train_step", step_then_sigterm)
    out = tmp_path / "demo"
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["demo", "--quick", "--out", str(out), "--jobs", "1"]) == 143   # trains here: the patch holds
    err = _one_line_error(capsys)
    assert err == (f"sgraf demo: stopped by SIGTERM while training global-only: its last.pt is saved in "
                   f"{out / 'runs' / 'global-only'}; no results or report written (the same sgraf demo command "
                   "resumes the trainings)")
    assert (out / "runs" / "global-only" / "last.pt").is_file()
    assert not (out / "results.json").exists() and not (out / "report.md").exists()
    assert not (out / LOCK_FILE).exists() and signal.getsignal(signal.SIGTERM) == handler
    # a run folder another process holds (a killed demo's worker training on): refused before anything is removed
    from sgraf.folder_lock import FolderLock

    monkeypatch.undo()
    last = out / "runs" / "global-only" / "last.pt"
    saved = last.read_bytes()
    last.unlink()                          # as a run just started: its config.yaml, no last.pt yet
    before = sorted(path.relative_to(out) for path in out.rglob("*"))
    with FolderLock(out / "runs" / "global-only"):
        assert main(["demo", "--quick", "--out", str(out), "--jobs", "1"]) == 2
    assert f"{out / 'runs' / 'global-only'} is in use by another sgraf process" in _one_line_error(capsys)
    assert sorted(path.relative_to(out) for path in out.rglob("*")) == before      # its config.yaml had gone
    last.write_bytes(saved)
    # the same command again: the stopped run goes on from its last.pt, the others train anew
    caplog.set_level("INFO", logger="sgraf.demo")
    assert not (out / "runs" / "global-only" / "metrics.jsonl").exists()     # stopped after its first step
    assert main(["demo", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    assert "resuming global-only from" in caplog.text and "resuming SGR" not in caplog.text
    record = json.loads((out / "results.json").read_text())
    assert record["resumed"] == ["global-only"]
    assert "Continued from an earlier demo's runs in this folder" in (out / "report.md").read_text()
    summary = record["training"]["global-only"]["summary"]
    assert summary["status"] == "finished"
    assert summary["global_step"] == record["training"]["SAF"]["summary"]["global_step"]


def test_sigterm_and_sigint_in_any_command_exit_143_and_130(tmp_path, monkeypatch, capsys, python_sigint):
    (tmp_path / "train_caps.txt").write_text("a cat\n")
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        def stopped(*args, signum=signum, **kwargs):
            os.kill(os.getpid(), signum)
            time.sleep(5)                           # the handler interrupts this

        monkeypatch.setattr("sgraf.data.vocab.build_vocab", stopped)
        assert main(["vocab", "build", "--data", str(tmp_path), "--out", str(tmp_path / "v.json")]) == code
        assert _one_line_error(capsys) in ("sgraf vocab build: stopped by SIGTERM", "sgraf vocab build: interrupted")
        assert not (tmp_path / "v.json").exists()


def test_a_new_run_never_appends_to_the_records_of_an_earlier_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 10, "rsum": 50.0}\n')   # stopped before its first last.pt
    assert main(["train", "--data", str(tmp_path), "--out", str(run)]) == 2
    assert _one_line_error(capsys) == (f"sgraf train: error: output folder {run} holds metrics.jsonl of an earlier "
                                       "run, which has no last.pt to resume from; choose another --out or move "
                                       "them away")
    assert (run / "metrics.jsonl").read_text() == '{"step": 10, "rsum": 50.0}\n'


def test_a_new_run_never_writes_over_files_no_run_wrote(tmp_path, capsys):
    from sgraf.data.benchmark import generate_benchmark

    data = tmp_path / "data"
    generate_benchmark(data, n_train=20, n_dev=4, n_test=4, save_images=False)
    report = tmp_path / "report"                 # e.g. a demo's folder: its own curves.png
    report.mkdir()
    (report / "curves.png").write_bytes(b"the demo's picture")
    argv = ["train", "--data", str(data), "--preset", "tiny", "--set", "epochs=1", "progress=false"]
    assert main([*argv, "--out", str(report)]) == 2
    assert _one_line_error(capsys) == (f"sgraf train: error: output folder {report} holds curves.png, which no sgraf "
                                       "run wrote there and a new run would write over; choose another --out or "
                                       "move it away")
    assert (report / "curves.png").read_bytes() == b"the demo's picture"
    (report / "curves.png").unlink()
    (report / "config.yaml").write_text("epochs: 3\n")     # someone's config, not passed with --config
    assert main([*argv, "--out", str(report)]) == 2
    assert "holds config.yaml, which no sgraf run wrote there" in _one_line_error(capsys)
    assert (report / "config.yaml").read_text() == "epochs: 3\n"
    # a run that stopped before its first validation left its own config.yaml: the same command starts again
    run = tmp_path / "run"
    assert main([*argv, "--out", str(run)]) == 0
    for name in ("last.pt", "best.pt", "metrics.jsonl", "curves.png"):
        (run / name).unlink()
    assert main([*argv, "--out", str(run)]) == 0
    assert (run / "last.pt").is_file()


def test_outputs_never_land_among_a_runs_an_indexs_or_a_demos_files(tmp_path, capsys):
    """A researcher's slips (a vocabulary written over a run's best.pt, a data set generated into
    a run folder, a plot over a demo's picture): each refused in one line, the files untouched."""
    from sgraf.output_folder import DEMO_MARKER

    data = tmp_path / "data"
    assert main(["generate", "--out", str(data), *TINY, "--no-images"]) == 0
    data2 = tmp_path / "data2"
    assert main(["generate", "--out", str(data2), *TINY, "--no-images"]) == 0
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--preset", "tiny", "--set", "epochs=1", "progress=false", "batch_size=4"]
    assert main([*argv, "--out", str(run)]) == 0
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / DEMO_MARKER).write_text("written by sgraf demo\n")
    (demo / "retrieval_t2i.png").write_bytes(b"the demo's picture")
    (demo / RECORD).write_text('{"files": {"retrieval_t2i.png": "demo"}}')
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / RECORD).write_text('{"files": {"kept.bin": "extract"}}')
    capsys.readouterr()
    best = (run / "best.pt").read_bytes()
    for argv_, message in (
            (["vocab", "build", "--data", str(data), "--out", str(run / "best.pt")], "is a file of the run folder"),
            (["vocab", "build", "--data", str(data), "--out", str(run / "config.yaml")], "is a file of the run folder"),
            (["vocab", "build", "--data", str(data), "--out", str(demo / "retrieval_t2i.png")],
             "is a file sgraf demo wrote in"),
            (["vocab", "build", "--data", str(data), "--out", str(tmp_path / "other" / "kept.bin")],
             "is a file sgraf extract wrote in"),
            (["runs", str(run), "--plot", str(demo / "retrieval_t2i.png")], "is a file sgraf demo wrote in"),
            (["generate", "--out", str(run), *TINY], "is a training run folder; a data set written there"),
            (["generate", "--out", str(demo), *TINY], "is a demo's folder"),
            ([*argv, "--out", str(data2)], "is a precomp data set's folder; a training run written there"),
            ([*argv, "--out", str(demo)], "is a demo's folder"),
            # inside another's folder: a data set's pictures, a run's own folders (they had been taken)
            ([*argv, "--out", str(data2 / "images" / "test")], "is inside the pictures of the precomp data set in"),
            ([*argv, "--out", str(run / "tensorboard")], f"is inside the training run folder {run}"),
            (["generate", "--out", str(data2 / "images" / "test"), *TINY], "is inside the pictures of the precomp"),
            (["generate", "--out", str(data2 / "images"), *TINY], "is the pictures folder of the precomp data set in"),
            ([*argv, "--out", str(data2 / "images")], "is the pictures folder of the precomp data set in")):
        assert main(argv_) == 2, argv_
        assert message in _one_line_error(capsys), argv_
    assert (run / "best.pt").read_bytes() == best and (demo / "retrieval_t2i.png").read_bytes() == b"the demo's picture"
    assert not (run / "train_ims.npy").exists()
    # a new file beside a demo's report (diagnose.md's --save-sims example), and a folder holding only a
    # config.yaml of one's own, are no other command's
    assert main(["vocab", "build", "--data", str(data), "--out", str(demo / "my-vocab.json")]) == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.yaml").write_text("epochs: 3\n")
    assert main(["generate", "--out", str(tmp_path / "mine"), *TINY, "--no-images"]) == 0
    # the data set's own vocabulary may be rebuilt in place
    assert main(["vocab", "build", "--data", str(data), "--out", str(data / "vocab.json"), "--min-count", "1"]) == 0


def test_written_files_and_index_folders_keep_the_umask_permissions(tmp_path):
    import stat

    from sgraf.atomic_write import temporary_folder

    umask = os.umask(0o027)
    try:
        write_text(tmp_path / "shared.txt", "for the group")
        folder = temporary_folder(tmp_path, ".index.")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "shared.txt").stat().st_mode) == 0o640      # not mkstemp's 0600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750                        # not mkdtemp's 0700


def test_a_resumed_run_drops_tensorboard_events_newer_than_its_checkpoint(tmp_path, monkeypatch):
    import types

    from sgraf.training.config import preset
    from sgraf.training.loop import fit
    from train_helpers import make_toy_precomp

    purge_steps = []

    class Writer:                                   # TensorBoard itself need not be installed
        def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
            purge_steps.append(purge_step)

        def add_scalar(self, *args: object) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setenv("SGRAF_TUNE", "off")          # no timing probes: this test is about files
    data = make_toy_precomp(tmp_path / "data", n_train=2, n_dev=2)
    config = preset("tiny").replace(epochs=1, batch_size=10, progress=False)   # one step per epoch
    first = fit(config, data, tmp_path / "run")
    fit(config.replace(epochs=2), data, tmp_path / "run", resume=True)
    assert purge_steps == [None, first["global_step"]]   # events after the checkpoint are dropped


def test_a_replaced_file_keeps_its_permissions_and_a_read_only_one_is_refused(tmp_path, capsys):
    """Writes go to a temporary file moved over the old one: a file made 0600 came back 0644, and
    one made read-only was replaced silently (root or not: the folder was writable)."""
    from sgraf.atomic_write import write_text

    private = tmp_path / "private.txt"
    write_text(private, "first")
    private.chmod(0o600)
    write_text(private, "second")
    assert private.read_text() == "second" and (private.stat().st_mode & 0o777) == 0o600
    kept = tmp_path / "kept.npy"
    np.save(kept, np.zeros((2, 3), np.float32))
    kept.chmod(0o444)
    before = kept.read_bytes()
    with pytest.raises(InputError, match=rf"^cannot write {kept}: the file is read-only \(make it writable"):
        write_text(kept, "x")
    np.save(tmp_path / "a.npy", np.ones((2, 10), np.float32))
    assert main(["evaluate", "--sims", str(tmp_path / "a.npy"), "--save-sims", str(kept)]) == 2
    assert "the file is read-only" in _one_line_error(capsys)
    assert kept.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "a.npy", "kept.npy", "private.txt"]


def test_numpys_short_write_is_said_as_a_full_disk():
    from sgraf.atomic_write import write_error

    message = str(write_error("sims.npy", OSError("12500 requested and 8160 written")))
    assert message == "cannot write sims.npy: No space left on device (12500 requested and 8160 written)"


def test_on_windows_a_locks_holder_is_looked_up_never_signalled(monkeypatch):
    """`os.kill(pid, 0)` ends the process on Windows: `sgraf runs` would have killed a training
    (or whatever took its pid)."""
    def kill(*_args):
        raise AssertionError("os.kill called")

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(folder_lock.os, "name", "nt")
    assert folder_lock.pid_alive(os.getpid()) is True        # here: no kernel32, so it counts as alive
    monkeypatch.setattr(folder_lock, "_windows_pid_alive", lambda pid: pid == 7)
    assert folder_lock.pid_alive(7) and not folder_lock.pid_alive(8)
