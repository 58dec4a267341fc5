"""Issue 22 (reliability, round 3), the file, data and command-line half.

1. No command writes over its inputs (`sgraf.io_paths.check_outputs`, walked over every
   command), a demo folder loses only the files sgraf recorded writing.
2. No data set is silently mixed: scenes against captions, a byte-order mark in every text
   reader (walked over every command), ties in truth-aware recall, an empty vocabulary.
3. Every writer survives a full disk (walked over every command, on a small tmpfs), malformed
   scenes lines, `--set lr=inf`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sgraf.checkpoint import save_model
from sgraf.cli import build_parser, main
from sgraf.config import ModelConfig
from sgraf.data.benchmark import generate_benchmark, load_scenes
from sgraf.data.render import SceneObject, render_scene
from sgraf.data.vocab import load_vocab
from sgraf.errors import InputError
from sgraf.model.sgraf import SGRAF

SRC = Path(__file__).resolve().parents[1] / "src"
BOM = b"\xef\xbb\xbf"


def _one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    err = "\n".join(line for line in err.splitlines() if not line.startswith("INFO "))   # the log
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.float32).tobytes()).decode("ascii")


def _make_world(root: Path) -> dict:
    """A tiny generated data set, a checkpoint for it, its score matrix, a TSV with captions and a
    folder of pictures with captions (the inputs of every command)."""
    data = root / "data"
    generate_benchmark(data, features="synthetic", n_train=4, n_dev=4, n_test=8, synthetic_dim=8)
    vocab = load_vocab(data / "vocab.json")
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=8, word_dim=4, embed_size=8, sim_dim=4,
                              num_regions=36, sgr_step=1))
    save_model(model, root / "ck.pt", vocab=vocab)
    np.save(root / "sims.npy", np.random.default_rng(0).standard_normal((8, 40)).astype(np.float32))
    np.save(root / "sims_b.npy", np.random.default_rng(2).standard_normal((8, 40)).astype(np.float32))
    rng = np.random.default_rng(1)
    corners = [rng.random((2, 4)) * 100 for _ in range(3)]   # x1, y1, width, height: boxes inside 640 x 480
    (root / "a.tsv").write_text("".join(f"{1000 + i}\t640\t480\t2\t{_b64(np.hstack([c[:, :2], c[:, :2] + c[:, 2:]]))}\t"
                                        f"{_b64(rng.random((2, 3)))}\n" for i, c in enumerate(corners)))
    (root / "tsv_caps.txt").write_text("".join(f"{1000 + i}\ta caption of {i}\n" for i in range(3)))
    pictures = root / "pictures"
    pictures.mkdir()
    render_scene([SceneObject("red", "square", "large", 0, 0, 32, 32)]).save(pictures / "im.png")
    (root / "pictures.tsv").write_text("im.png\ta red square\n")
    (root / "config.yaml").write_text("lr: 0.001\nepochs: 1\n")
    (root / "run").mkdir()       # what sgraf runs reads of a run folder
    (root / "run" / "config.yaml").write_text(f"data: {data}\npreset: tiny\nsgraf_version: 0.1.0\nlr: 0.001\n"
                                              "epochs: 2\n")
    (root / "run" / "metrics.jsonl").write_text('{"epoch": 1, "step": 4, "end_of_epoch": true, "rsum": 120.5, '
                                                '"best": true}\n')
    return {"root": root, "data": data, "ck": root / "ck.pt", "sims": root / "sims.npy", "vocab": data / "vocab.json"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return _make_world(tmp_path_factory.mktemp("round3"))


@pytest.fixture
def tiny_backbone(monkeypatch):
    """`--backbone tiny-test` for `sgraf extract`, registered for this test only."""
    from torch import nn

    from sgraf.data import features

    def factory(**_):
        torch.manual_seed(0)
        return features.GridBackbone(nn.Conv2d(3, 4, kernel_size=32, stride=32), feature_dim=4, image_size=64,
                                     name="tiny")

    monkeypatch.setitem(features._BACKBONES, "tiny-test", factory)


def _leaf_commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """Every runnable command of the parser: 'evaluate', 'vocab build', ..."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                below = _leaf_commands(sub, f"{prefix}{name} ")
                found.extend(below or [f"{prefix}{name}"])
    return found


def _walks_every_command(table: dict, exempt: dict) -> None:
    commands = set(_leaf_commands(build_parser()))
    assert len(commands) >= 14
    assert set(table) | set(exempt) == commands, sorted(commands ^ (set(table) | set(exempt)))
    assert not set(table) & set(exempt)


# ------------------------------------------------------------------ 1. no output is an input
def _same_file_cases(w: dict, tmp: Path) -> dict[str, list[tuple[list[str], str, Path]]]:
    """{command: [(argv, fragment of the refusal, the input that must stay untouched)]}."""
    root, data, ck, sims = w["root"], w["data"], str(w["ck"]), str(w["sims"])
    link = tmp / "link.npy"
    link.symlink_to(w["sims"])
    hard = tmp / "hard.pt"
    os.link(w["ck"], hard)
    out = tmp / "converted"
    out.mkdir()
    (out / "test_caps.txt").write_text("1000\tmine\n1001\tmine\n1002\tmine\n")   # a caption table, not captions
    extracted = tmp / "extracted"
    extracted.mkdir()
    (extracted / "test_caps.txt").write_text("im.png\ta red square\n")
    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text("lr: 0.001\n")
    listed = tmp / "listed"         # a run folder sgraf runs reads, with the curves its run drew
    shutil.copytree(root / "run", listed)
    (listed / "curves.png").write_bytes(b"the run's own curves")
    source = ["--checkpoint", ck, "--data", str(data)]
    return {
        "evaluate": [(["evaluate", "--sims", sims, "--data", str(data), "--save-sims", str(link)],
                      f"--save-sims {link} is the input --sims {sims}", w["sims"]),
                     (["evaluate", *source, "--save-sims", f"{data}/./test_ims.npy"],
                      f"--save-sims {data}/./test_ims.npy is the input --data {data}/test_ims.npy",
                      data / "test_ims.npy"),
                     (["evaluate", *source, "--save-sims", ck], "--save-sims must name a .npy file", w["ck"]),
                     # another split of the data set: not read by the command, but no less the user's
                     (["evaluate", *source, "--save-sims", f"{data}/dev_ims.npy"],
                      f"--save-sims {data}/dev_ims.npy is the input --data {data}/dev_ims.npy", data / "dev_ims.npy")],
        "diagnose": [(["diagnose", *source, "--save-sims", f"{data}/../data/test_ims.npy"],
                      "is the input --data", data / "test_ims.npy"),
                     (["diagnose", *source, "--save-sims", f"{data}/train_boxes.npy"],
                      "is the input --data", data / "train_boxes.npy")],
        "vocab build": [(["vocab", "build", "--data", str(data), "--out", str(data / "train_caps.txt")],
                         f"--out {data / 'train_caps.txt'} is the input --data {data / 'train_caps.txt'}",
                         data / "train_caps.txt"),
                        (["vocab", "build", "--data", str(data), "--out", str(data / "test_caps.txt")],
                         "is the input --data", data / "test_caps.txt")],   # DATA/vocab.json: rebuilt (below)
        "convert-checkpoint": [(["convert-checkpoint", ck, str(hard)], f"DST {hard} is the input SRC {ck}", w["ck"]),
                               (["convert-checkpoint", ck, str(w["vocab"]), "--vocab", str(w["vocab"])],
                                "is the input --vocab", w["vocab"])],
        "explain": [(["explain", *source, "--split", "test", "--image-id", "0", "--text", "a circle", "--out",
                      str(data / "images" / "test" / "00000.png")], "is the input --data",
                     data / "images" / "test" / "00000.png"),
                    (["explain", *source, "--split", "test", "--image-id", "0", "--text", "a circle", "--out",
                      str(data / "images" / "train" / "00001.png")], "is the input --data",
                     data / "images" / "train" / "00001.png")],
        "index": [(["index", *source, "--split", "test", "--out", str(data)],
                   f"--out {data} is the input --data {data}", data / "test_ims.npy"),
                  (["index", *source, "--split", "test", "--out", str(root)],
                   f"--out {root} holds the input --checkpoint {ck}", w["ck"])],
        "train": [(["train", "--data", str(data), "--out", str(data)], f"--out {data} is the input --data {data}",
                   data / "train_caps.txt"),
                  (["train", "--data", str(data), "--config", str(run / "config.yaml"), "--out", str(run)],
                   f"--out {run}/config.yaml is the input --config {run / 'config.yaml'}", run / "config.yaml")],
        "runs": [(["runs", str(listed), "--plot", f"{listed}/./curves.png"],
                  f"--plot {listed}/./curves.png is the input run file {listed}/curves.png", listed / "curves.png")],
        "generate": [(["generate", "--out", str(tmp / "gen"), "--features", "synthetic", "--n-train", "2",
                       "--n-dev", "2", "--n-test", "2", "--preview", str(tmp / "gen" / "images/test/00001.png")],
                      "are the same file", None)],
        "convert-tsv": [(["convert-tsv", "--tsv", str(root / "a.tsv"), "--captions", str(out / "test_caps.txt"),
                          "--out", str(out), "--split", "test", "--overwrite", "--no-progress"],
                         f"--out {out / 'test_caps.txt'} is the input --captions {out / 'test_caps.txt'}",
                         out / "test_caps.txt")],
        "extract": [(["extract", "--images", str(root / "pictures"), "--captions", str(extracted / "test_caps.txt"),
                      "--out", str(extracted), "--split", "test", "--backbone", "tiny-test", "--overwrite"],
                     f"--out {extracted / 'test_caps.txt'} is the input --captions {extracted / 'test_caps.txt'}",
                     extracted / "test_caps.txt")],
    }


NOT_WRITERS = {"search": "writes no file", "serve": "writes no file", "data check": "writes no file",
               "demo": "reads no file the user names (its one path is --out, checked below)",
               "compare": "writes no file"}


def test_no_command_writes_over_its_inputs(world, tmp_path, capsys, tiny_backbone):
    cases = _same_file_cases(world, tmp_path)
    _walks_every_command(cases, NOT_WRITERS)
    for command, runs in cases.items():
        for argv, fragment, kept in runs:
            before = kept.read_bytes() if kept is not None else None
            code = main(argv)
            assert code == 2, (command, argv, capsys.readouterr())
            err = _one_line_error(capsys, code)
            assert fragment in err, (command, err)
            if kept is not None:
                assert kept.read_bytes() == before, command
    assert not (tmp_path / "gen").exists()     # the preview clash is refused before generating


def test_the_same_file_under_every_name(tmp_path, monkeypatch):
    from sgraf.io_paths import check_outputs

    monkeypatch.chdir(tmp_path)
    Path("x").write_text("1")
    Path("sub").mkdir()
    os.symlink("x", "link")
    os.link("x", "hard")
    for name in ("x", "./x", "sub/../x", str(tmp_path / "x"), "link", "hard"):
        with pytest.raises(InputError, match=f"^--out {name} is the input --in x; an output must not be an input"):
            check_outputs([("--in", "x")], [("--out", name)])
    check_outputs([("--in", "x")], [("--out", "y")])                  # another file: fine
    check_outputs([("--in", "sub")], [("--out", "sub/y")])            # a new file inside an input folder: fine
    with pytest.raises(InputError, match="^--out . holds the input --in sub/y"):
        check_outputs([("--in", "sub/y")], folders=[("--out", ".")])
    with pytest.raises(InputError, match="^--b ./y and --a y are the same file"):
        check_outputs([], [("--a", "y"), ("--b", "./y")])


def test_a_file_named_twice_in_a_repeated_option_is_refused_under_every_name(tmp_path, monkeypatch):
    from sgraf.io_paths import check_distinct

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c"):
        Path(name).write_text(name)
    os.symlink("c", "link")
    for second in ("c", "./c", "sub/../c", str(tmp_path / "c"), "link"):
        Path("sub").mkdir(exist_ok=True)
        with pytest.raises(InputError, match=rf"^--m {re.escape(second)} is given twice \(1st and 4th, the same "
                                             r"file\); they are averaged: name each once$"):
            check_distinct("--m", ["c", "a", "b", second], "they are averaged")
    check_distinct("--m", ["a", "b", "c"], "they are averaged")        # distinct files: fine
    check_distinct("--m", None, "they are averaged")                    # none given: fine
    check_distinct("--m", ["absent", "./other-absent"], "x")            # not there yet: compared by name only
    with pytest.raises(InputError, match=r"^--m ./absent is given twice \(1st and 2nd"):
        check_distinct("--m", ["absent", "./absent"], "x")


def test_every_ensemble_command_refuses_a_model_named_twice(world, capsys):
    """One checkpoint (or matrix) twice would be scored as an ensemble of one model with itself,
    and reported as an ensemble: each command that averages models refuses it in one line."""
    ck, data = str(world["ck"]), str(world["data"])
    again = os.path.join(os.path.dirname(ck), ".", os.path.basename(ck))
    runs = {
        "evaluate": ["evaluate", "--checkpoint", ck, "--checkpoint", again, "--data", data, "--split", "test"],
        "diagnose": ["diagnose", "--checkpoint", ck, "--checkpoint", again, "--data", data, "--split", "test"],
        "compare": ["compare", "--checkpoint", ck, "--checkpoint", again, "--against", str(world["sims"]),
                    "--data", data],
        "index": ["index", "--checkpoint", ck, "--checkpoint", again, "--data", data, "--split", "test",
                  "--out", str(world["root"] / "never-index")],
        "explain": ["explain", "--checkpoint", ck, "--checkpoint", again, "--data", data, "--split", "test",
                    "--image-id", "0", "--text", "a red square", "--out", str(world["root"] / "never.png")],
    }
    for command, argv in runs.items():
        err = _one_line_error(capsys, main(argv))
        assert err == (f"sgraf {command}: error: --checkpoint {again} is given twice (1st and 2nd, the same file); "
                       "an ensemble averages the scores of different models: name each once"), err
    sims = str(world["sims"])
    err = _one_line_error(capsys, main(["evaluate", "--sims", sims, sims, "--data", data, "--split", "test"]))
    assert err == (f"sgraf evaluate: error: --sims {sims} is given twice (1st and 2nd, the same file); the "
                   "matrices are averaged: name each once")
    assert not (world["root"] / "never-index").exists() and not (world["root"] / "never.png").exists()


def test_a_symlinked_output_is_written_through_to_its_target(world, tmp_path, capsys):
    target = tmp_path / "real.npy"
    target.write_bytes(b"old")
    link = tmp_path / "sims.npy"
    link.symlink_to(target)
    assert main(["evaluate", "--sims", str(world["sims"]), "--save-sims", str(link), "--json"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and np.array_equal(np.load(target), np.load(world["sims"]))
    index_target = tmp_path / "index-real"
    index_target.mkdir()
    (tmp_path / "index").symlink_to(index_target)
    assert main(["index", "--checkpoint", str(world["ck"]), "--data", str(world["data"]), "--split", "test",
                 "--out", str(tmp_path / "index"), "--quiet"]) == 0
    assert (tmp_path / "index").is_symlink() and (index_target / "manifest.json").is_file()


def test_a_demo_rerun_deletes_only_what_a_demo_recorded_writing(tmp_path, monkeypatch, capsys):
    import sgraf.demo as demo
    from sgraf.output_folder import read_record, record_files

    monkeypatch.setattr(demo, "_run", lambda out, *args: {})       # the folder's preparation only
    out = tmp_path / "demo"
    demo.run_demo(out, quick=True)
    for name in ("runs/sgr/best.pt", "runs/sgr/config.yaml", "index/manifest.json", "report.md"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("demo's")
    record_files(out, ["runs/sgr/best.pt", "runs/sgr/config.yaml", "index/manifest.json"], "demo")
    (out / "runs" / "notes.txt").write_text("mine")
    (out / "runs" / "sgr" / "my-eval.npy").write_text("mine")
    demo.run_demo(out, quick=True)
    assert (out / "runs" / "sgr" / "best.pt").exists()    # kept until the demo knows which runs it resumes
    demo._resume_or_remove(out, {0: []})                   # none here (no last.pt): the demo's run files go
    assert (out / "runs" / "notes.txt").read_text() == "mine"
    assert (out / "runs" / "sgr" / "my-eval.npy").read_text() == "mine"
    assert not (out / "runs" / "sgr" / "best.pt").exists() and not (out / "index").exists()
    assert not (out / "report.md").exists() and "report.md" in read_record(out)
    (out / "index").mkdir()
    (out / "index" / "mine.txt").write_text("mine")                 # the index is replaced whole: refused
    err = _one_line_error(capsys, main(["demo", "--quick", "--out", str(out)]))
    assert err == (f"sgraf demo: error: {out / 'index' / 'mine.txt'} was not written by sgraf demo and would "
                           "be deleted with the earlier demo's index (sgraf deletes only files it wrote); move it away")
    assert (out / "index" / "mine.txt").read_text() == "mine" and (out / "runs" / "notes.txt").exists()


def test_a_demo_folder_from_before_the_record_loses_only_the_demos_files(tmp_path, monkeypatch):
    import sgraf.demo as demo

    monkeypatch.setattr(demo, "_run", lambda out, *args: {})
    out = tmp_path / "demo"
    out.mkdir()
    (out / demo.MARKER).write_text("an earlier demo")
    for name in ("runs/sgr/last.pt", "runs/sgr/tensorboard/events.1", "index/manifest.json", "index/captions.txt",
                 "results.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("demo's")
    (out / "index" / "manifest.json").write_text(json.dumps({"files": {"captions.txt": {}}}))
    (out / "runs" / "sgr" / "analysis.ipynb").write_text("mine")
    demo.run_demo(out, quick=True)
    demo._resume_or_remove(out, {0: []})
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()
                  and not p.name.startswith(".")) == ["runs/sgr/analysis.ipynb"]


# ------------------------------------------------------------------ 2. a byte-order mark, every text reader
TEXT_FILES = ("data/*_caps.txt", "data/*_scenes.jsonl", "data/vocab.json", "a.tsv", "tsv_caps.txt", "pictures.tsv",
              "config.yaml", "run/config.yaml", "run/metrics.jsonl")


def _with_bom(world: dict, root: Path) -> dict:
    """A copy of the world whose every text file starts with a UTF-8 byte-order mark."""
    shutil.copytree(world["root"], root)
    marked = 0
    for pattern in TEXT_FILES:
        for path in root.glob(pattern):
            path.write_bytes(BOM + path.read_bytes())
            marked += 1
    assert marked >= 10
    return {"root": root, "data": root / "data", "ck": root / "ck.pt", "vocab": root / "data" / "vocab.json"}


def _bom_runs(w: dict, out: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{command: (argv reading the text files of `w`, files it writes under `out` to compare)}."""
    d, ck, vocab = str(w["data"]), str(w["ck"]), str(w["vocab"])
    scoring = ["--checkpoint", ck, "--data", d, "--vocab", vocab, "--json", "--quiet"]
    return {
        "evaluate": (["evaluate", *scoring], []),
        "diagnose": (["diagnose", *scoring], []),
        "compare": (["compare", "--sims", str(w["root"] / "sims.npy"), "--against", str(w["root"] / "sims_b.npy"),
                     "--data", d, "--split", "test", "--resamples", "50", "--diagnose"], []),
        "index": (["index", "--checkpoint", ck, "--data", d, "--split", "test", "--vocab", vocab, "--quiet",
                   "--out", str(out / "index")], ["index/captions.txt"]),
        "search": (["search", "--index", str(out / "index"), "--vocab", vocab, "--text",
                    "a large red square", "--json", "--allow-unknown"], []),
        "explain": (["explain", "--checkpoint", ck, "--data", d, "--split", "test", "--image-id", "1", "--text",
                     "a large red square", "--allow-unknown", "--vocab", vocab, "--out", str(out / "e.png")], []),
        "data check": (["data", "check", "--data", d, "--split", "test", "--vocab", vocab], []),
        "vocab build": (["vocab", "build", "--data", d, "--out", str(out / "v.json"), "--min-count", "1"], ["v.json"]),
        "convert-tsv": (["convert-tsv", "--tsv", str(w["root"] / "a.tsv"), "--captions",
                         str(w["root"] / "tsv_caps.txt"), "--out", str(out / "c"), "--split", "test",
                         "--no-progress"], ["c/test_caps.txt", "c/test_image_ids.txt", "c/test_ims.npy"]),
        "extract": (["extract", "--images", str(w["root"] / "pictures"), "--captions",
                     str(w["root"] / "pictures.tsv"), "--out", str(out / "x"), "--split", "test", "--backbone",
                     "tiny-test"], ["x/test_caps.txt", "x/test_image_names.txt"]),
        "convert-checkpoint": (["convert-checkpoint", ck, str(out / "ck.pt"), "--vocab", vocab], []),
        "train": (["train", "--config", str(w["root"] / "config.yaml"), "--list-keys"], []),
        "runs": (["runs", str(w["root"] / "run"), "--json"], []),
    }


NO_TEXT_READ = {"generate": "reads no text file", "demo": "reads no text file the user gives",
                "serve": "opens the index and --vocab as search does (the same readers), then serves"}


def test_every_text_reader_strips_a_byte_order_mark(world, tmp_path, capsys, tiny_backbone):
    marked = _with_bom(world, tmp_path / "marked")
    clean_out, marked_out = tmp_path / "clean-out" / "o", tmp_path / "marked-out" / "o"
    clean_runs, marked_runs = _bom_runs(world, clean_out), _bom_runs(marked, marked_out)
    _walks_every_command(clean_runs, NO_TEXT_READ)
    for command in clean_runs:
        printed = []
        for root, out, runs in ((world["root"], clean_out, clean_runs), (marked["root"], marked_out, marked_runs)):
            assert main(runs[command][0]) == 0, (command, capsys.readouterr().err)
            printed.append(capsys.readouterr().out.replace(str(out), "OUT").replace(str(root), "ROOT"))
        assert printed[0] == printed[1], command
        for name in clean_runs[command][1]:
            assert (clean_out / name).read_bytes() == (marked_out / name).read_bytes(), (command, name)
    assert "\ufeff" not in json.dumps(load_vocab(marked_out / "v.json").word2idx)
    assert torch.load(marked_out / "ck.pt")["vocab"] == torch.load(clean_out / "ck.pt")["vocab"]


# ------------------------------------------------------------------ 2b. --json, every command that reports
JSON_EXEMPT = {"demo": "writes a report folder (report.json)", "serve": "answers JSON over HTTP",
               "search": "prints a list of hits (its help says so)"}


def test_every_command_prints_one_json_object_with_json(world, tmp_path, capsys, tiny_backbone):
    """Each command's --json: one line of strict JSON on stdout, an object, nothing else there, and
    the same facts as its text (the split's counts, the files written)."""
    runs = _bom_runs(world, tmp_path / "o")
    runs = {command: ([*argv, "--json"] if "--json" not in argv else argv, written)
            for command, (argv, written) in runs.items() if command not in JSON_EXEMPT}
    runs["train"] = (["train", "--data", str(world["data"]), "--out", str(tmp_path / "o" / "run"), "--preset", "tiny",
                      "--set", "epochs=1", "batch_size=4", "--json"], ["run/best.pt"])
    runs["generate"] = (["generate", "--out", str(tmp_path / "o" / "g"), "--features", "synthetic", "--n-train", "2",
                         "--n-dev", "2", "--n-test", "2", "--no-images", "--json"], ["g/vocab.json"])
    _walks_every_command(runs, JSON_EXEMPT)
    printed = {}
    for command, (argv, written) in runs.items():
        assert main(argv) == 0, (command, capsys.readouterr().err)
        out = capsys.readouterr().out
        assert out.count("\n") == 1, (command, out)
        printed[command] = json.loads(out, parse_constant=lambda word: pytest.fail(f"{command}: {word} in JSON"))
        assert isinstance(printed[command], dict), command
        for name in written:
            assert (tmp_path / "o" / name).exists(), (command, name)
    assert printed["data check"]["images"] == 8 and printed["data check"]["captions"] == 40
    assert 0 <= printed["data check"]["vocabulary"]["unknown_share"] <= 1
    assert printed["index"]["images"] == 8 and printed["index"]["captions"] == 40
    assert printed["vocab build"]["entries"] == len(load_vocab(tmp_path / "o" / "v.json"))
    assert printed["train"]["status"] == "finished" and printed["train"]["run_dir"] == str(tmp_path / "o" / "run")
    assert printed["generate"]["images"] == {"train": 2, "dev": 2, "test": 2}
    assert printed["extract"]["images"] == 1 and printed["convert-tsv"]["images"] == 3
    assert printed["convert-checkpoint"]["module"] == "sgr"
    explained = printed["explain"]
    assert explained["tokens"][0] == "<start>" and len(explained["attention"]) == len(explained["tokens"])
    assert set(explained["scores"]) == {"sgr"} and explained["out"] == str(tmp_path / "o" / "e.png")
    assert printed["runs"] and printed["evaluate"]["rsum"] >= 0


# ------------------------------------------------------------------ 3. a full disk, every writer
class FullDisk:
    """A small tmpfs mounted for one test, filled up to `free` bytes (it needs root)."""

    def __init__(self, mountpoint: Path) -> None:
        self.path = mountpoint
        mountpoint.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}); the full-disk "
                        "walk needs root, test_hardening_files simulates ENOSPC in the writers instead")

    def fill(self, free: int = 0) -> None:
        """Leaves `free` bytes (rounded to pages) and nothing else but the filler."""
        self.clear()
        handle = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(handle, b"\0" * 4096)
        finally:
            os.close(handle)
        if free:
            os.truncate(self.path / "filler", os.path.getsize(self.path / "filler") - free)

    def clear(self) -> None:
        for entry in self.path.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

    def left(self) -> list[str]:
        """What the commands left: files (the filler aside) and hidden (staging, temporary) entries."""
        return sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*")
                      if p.name != "filler" and (p.is_file() or p.name.startswith(".")))

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.path)], check=False)


@pytest.fixture
def full_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_hardening_files simulates ENOSPC in the writers instead")
    disk = FullDisk(tmp_path / "full")
    yield disk
    disk.unmount()


def _writers(w: dict, full: Path) -> dict[str, list[str]]:
    d, ck = str(w["data"]), str(w["ck"])
    return {
        "demo": ["demo", "--quick", "--out", str(full / "demo")],
        "train": ["train", "--data", d, "--out", str(full / "run"), "--preset", "tiny", "--set", "epochs=1",
                  "progress=false"],
        "evaluate": ["evaluate", "--checkpoint", ck, "--data", d, "--save-sims", str(full / "s.npy"), "--quiet"],
        "diagnose": ["diagnose", "--checkpoint", ck, "--data", d, "--save-sims", str(full / "s.npy"), "--quiet"],
        "index": ["index", "--checkpoint", ck, "--data", d, "--split", "test", "--out", str(full / "index"),
                  "--quiet"],
        "explain": ["explain", "--checkpoint", ck, "--data", d, "--split", "test", "--image-id", "0", "--text",
                    "a large red square", "--allow-unknown", "--out", str(full / "e.png")],
        "generate": ["generate", "--out", str(full / "gen"), "--features", "synthetic", "--n-train", "2",
                     "--n-dev", "2", "--n-test", "2", "--synthetic-dim", "8"],
        "vocab build": ["vocab", "build", "--data", d, "--out", str(full / "v.json")],
        "extract": ["extract", "--images", str(w["root"] / "pictures"), "--captions", str(w["root"] / "pictures.tsv"),
                    "--out", str(full / "x"), "--split", "test", "--backbone", "tiny-test"],
        "convert-tsv": ["convert-tsv", "--tsv", str(w["root"] / "a.tsv"), "--out", str(full / "c"), "--split",
                        "test", "--no-progress"],
        "convert-checkpoint": ["convert-checkpoint", ck, str(full / "c.pt")],
        "runs": ["runs", str(w["root"] / "run"), "--plot", str(full / "curves.png")],
    }


def test_every_writer_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(world, full_disk, capsys,
                                                                            tiny_backbone, monkeypatch):
    monkeypatch.setenv("SGRAF_TUNE", "off")
    writers = _writers(world, full_disk.path)
    _walks_every_command(writers, {"search": "writes no file", "serve": "writes no file",
                                   "data check": "writes no file", "compare": "writes no file"})
    for command, argv in writers.items():
        full_disk.fill()
        err = _one_line_error(capsys, main(argv))
        assert "No space left on device" in err and str(full_disk.path) in err, (command, err)
        assert full_disk.left() == [], (command, full_disk.left())


def test_an_index_onto_a_nearly_full_disk_is_one_line_not_sigbus(world, full_disk):
    """The small files fit, the memory-mapped embeddings do not: before their blocks were reserved
    the first write through the map killed the process with SIGBUS, leaving its staging folder."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "SGRAF_TUNE": "off"}
    for free in (12288,):
        full_disk.fill(free)
        run = subprocess.run([sys.executable, "-m", "sgraf", "index", "--checkpoint", str(world["ck"]), "--data",
                              str(world["data"]), "--split", "test", "--out", str(full_disk.path / "index"),
                              "--quiet"], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 2, (free, run.returncode, run.stderr)
        assert run.stderr.strip().splitlines()[-1] == (f"sgraf index: error: cannot write {full_disk.path / 'index'}: "
                                                       "No space left on device")
        assert full_disk.left() == []


def test_train_onto_a_nearly_full_disk_is_one_line(world, full_disk, capsys, monkeypatch):
    """torch's zip writer turns the full disk into a RuntimeError of its own while closing the
    archive; the checkpoint writer reports the OSError under it, naming last.pt."""
    monkeypatch.setenv("SGRAF_TUNE", "off")
    run = full_disk.path / "run"
    for free in (8192,):
        full_disk.fill(free)
        err = _one_line_error(capsys, main(["train", "--data", str(world["data"]), "--out", str(run), "--preset",
                                            "tiny", "--set", "epochs=1", "progress=false"]))
        assert err in (f"sgraf train: error: cannot write {run / name}: No space left on device"
                       for name in ("last.pt", "best.pt")), (free, err)
        assert full_disk.left() == ["run/config.yaml"]   # whole; the same command runs again into the folder


def test_a_checkpoint_cut_short_by_a_full_disk_is_named(full_disk):
    from sgraf.checkpoint import atomic_save

    path = full_disk.path / "model.pt"
    for free in range(4096, 131072, 12288):      # the disk fills up at every point of the archive
        full_disk.fill(free)
        with pytest.raises(InputError) as caught:
            atomic_save({"weights": torch.zeros(40_000)}, path)
        assert str(caught.value) == f"cannot write {path}: No space left on device", free
        assert full_disk.left() == []


# ------------------------------------------------------------------ cases of sections 2 and 3
def test_diagnose_refuses_scenes_of_another_generation(world, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    generate_benchmark(tmp_path / "other", seed=1, features="synthetic", n_train=4, n_dev=4, n_test=8,
                       synthetic_dim=8, save_images=False)
    shutil.copy(tmp_path / "other" / "test_scenes.jsonl", data / "test_scenes.jsonl")   # same size, other data
    first_caption = json.loads((data / "test_scenes.jsonl").read_text().splitlines()[0])["captions"][0]
    err = _one_line_error(capsys, main(["diagnose", "--checkpoint", str(world["ck"]), "--data", str(data),
                                        "--quiet"]))
    own = (data / "test_caps.txt").read_text().splitlines()[0]
    assert err == (f"sgraf diagnose: error: {data / 'test_scenes.jsonl'} does not describe {data / 'test_caps.txt'}: "
                   f"line 1 of the captions is {own!r}, the scenes' caption 1 is {first_caption!r}; both files must "
                   "come from the same sgraf generate run")


def test_truth_aware_recall_counts_ties_against_the_model(world):
    from sgraf.diagnose import diagnose_sims, format_report, truth_recall

    scenes = load_scenes(world["data"], "test")
    constant = truth_recall(np.zeros((8, 40), dtype=np.float32), scenes)
    assert constant["i2t"] == {"r1": 0.0, "r5": 0.0, "r10": 0.0, "ties": 100.0}   # was 100 / 100 / 100
    # 8 pictures: ten of them are all the gallery (with ties in its favour R@1 was 100 too)
    assert constant["t2i"]["r1"] == 0.0 and constant["t2i"]["r10"] == 100.0 and constant["t2i"]["ties"] == 100.0
    perfect = np.full((8, 40), -1.0, dtype=np.float32)
    perfect[np.repeat(np.arange(8), 5), np.arange(40)] = 1.0          # each caption on its own picture
    assert truth_recall(perfect, scenes)["t2i"] == {"r1": 100.0, "r5": 100.0, "r10": 100.0, "ties": 0.0}
    report = format_report(diagnose_sims(np.zeros((8, 40), dtype=np.float32), scenes))
    assert ("truth-aware recall counts ties against the model; queries whose best correct answer ties a wrong one: "
            "i2t 100.0 %, t2i 100.0 %") in report


def test_vocab_build_refuses_a_min_count_that_leaves_no_word(world, tmp_path, capsys):
    out = tmp_path / "v.json"
    err = _one_line_error(capsys, main(["vocab", "build", "--data", str(world["data"]), "--out", str(out),
                                        "--min-count", "100000"]))
    assert re.fullmatch(r"sgraf vocab build: error: min count 100000 leaves no word in the vocabulary: the most "
                        r"frequent of the \d+ distinct words is seen (\d+) times; expected a min count of at most \1", err), err
    assert not out.exists()


@pytest.mark.parametrize("change, field, expected", [
    (lambda row: None, None, "expected a JSON object (one scene), got null"),
    (lambda row: 7, None, "expected a JSON object (one scene), got 7"),
    (lambda row: {**row, "false_for": None}, "false_for", "is null; expected a list of 5 lists"),
    (lambda row: {**row, "false_for": "1"}, "false_for", 'is "1"; expected a list of 5 lists'),
    (lambda row: {**row, "false_for": [[1.5]] * 5}, "false_for", "is [[1.5], [1.5], [1.5], [1.5], [1.5]]; expected"),
    (lambda row: {**row, "false_for": [[8]] * 5}, "false_for", "in 0..7 (an index past the file's 8 scenes: is the "
                                                                "file cut short?)"),
    (lambda row: {**row, "false_for": [[-1]] * 5}, "false_for", "scene indices in 0..7"),
    (lambda row: {k: v for k, v in row.items() if k != "family"}, "family", "is missing; expected an integer >= 0"),
    (lambda row: {k: v for k, v in row.items() if k != "variant"}, "variant", "is missing; expected one of base, "),
    (lambda row: {**row, "index": True}, "index", "is true; expected 2 (the scene's line number - 1)"),
])
def test_malformed_scenes_lines_are_named_by_file_line_and_field(world, tmp_path, capsys, change, field, expected):
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    path = data / "test_scenes.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = json.dumps(change(json.loads(lines[2])))
    path.write_text("\n".join(lines) + "\n")
    err = _one_line_error(capsys, main(["diagnose", "--sims", str(world["sims"]), "--data", str(data)]))
    where = f"sgraf diagnose: error: {path}:3: " + (f"field {field!r} " if field else "")
    assert err.startswith(where) and expected in err, err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_training_numbers_are_refused_up_front(tmp_path, capsys, value):
    err = _one_line_error(capsys, main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--set", f"lr={value}"]))
    assert err == f"sgraf demo: error: --set: training config field 'lr' must be a finite number, got {float(value)!r}"
    assert not (tmp_path / "demo").exists()


def test_the_reliability_page_commands_parse_and_its_messages_are_one_line():
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    parser = build_parser()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]
    assert len(commands) >= 10
    for line in commands:
        words = shlex.split(line)
        assert words[0] == "sgraf", line
        parser.parse_args(words[1:])            # an unknown flag or a bad value exits here
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():        # messages, never commands
            assert not line.startswith("sgraf ") or re.match(r"sgraf [\w-]+( [\w-]+)?: error: ", line), line
