"""Issue 14, part C: one line with exit code 2 instead of a traceback, every default in --help.

Devices this machine cannot use, numbers out of range, files that are not what they should
be (backbone weights, a damaged index under --no-verify), text that is not UTF-8, and the
small things around them (--version, the index progress bar, logging under torchrun, the
demo's log of its overrides, the README's commands).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sgraf
from sgraf.api import Matcher
from sgraf.checkpoint import save_model
from sgraf.cli import build_parser, main
from sgraf.config import ModelConfig
from sgraf.data.vocab import Vocabulary, tokenize
from sgraf.devices import resolve_device
from sgraf.errors import InputError
from sgraf.model.sgraf import SGRAF

ROOT = Path(__file__).resolve().parents[1]
WORDS = "a dog cat runs on the grass red ball".split()
N_IMG, CAPS, K, IMG_DIM = 4, 2, 3, 6


def _one_line_error(capsys, code: int, *fragments: str) -> str:
    """Assert exit code 2 and a single stderr line holding every fragment; return that line."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as a CPU-only one, whatever it has (the tests also run where CUDA exists)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> dict:
    """A tiny precomp split, one checkpoint carrying its vocabulary, and an index of the split."""
    root = tmp_path_factory.mktemp("hardening")
    rng = np.random.default_rng(0)
    data = root / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", rng.standard_normal((N_IMG, K, IMG_DIM)).astype(np.float32))
    captions = [" ".join(rng.choice(WORDS, size=3 + i % 3)) for i in range(N_IMG * CAPS)]
    (data / "test_caps.txt").write_text("\n".join(captions) + "\n")
    vocab = Vocabulary.from_words(WORDS)
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=IMG_DIM, word_dim=4, embed_size=8, sim_dim=4,
                              num_regions=K, sgr_step=1))
    checkpoint = root / "sgr.pt"
    save_model(model, checkpoint, vocab=vocab)
    index = root / "index"
    assert main(["index", "--checkpoint", str(checkpoint), "--data", str(data), "--split", "test",
                 "--out", str(index), "--quiet"]) == 0
    return {"data": data, "checkpoint": checkpoint, "index": index, "vocab": vocab, "captions": captions}


# --------------------------------------------------------------------------------- 1. devices
@pytest.mark.parametrize("name, message", [
    ("cuda", "device 'cuda': CUDA is not available"),
    ("cuda:5", "device 'cuda:5': CUDA is not available"),
    ("mps", "device 'mps': MPS (Apple GPU) is not available"),
    ("foo", "device 'foo' is not a device name; expected cpu, cuda, cuda:N or mps"),
    ("cpu:1", "device 'cpu:1': there is one CPU device"),
    ("meta", "device 'meta': sgraf runs on cpu, cuda or mps, not meta"),
])
def test_unusable_devices_are_refused_naming_the_available_ones(no_gpu, name, message):
    with pytest.raises(InputError, match=re.escape(message)) as error:
        resolve_device(name)
    assert str(error.value).endswith("available here: cpu")


def test_cpu_names_and_auto_resolve_to_the_cpu(no_gpu):
    assert resolve_device("cpu:0") == resolve_device("cpu") == resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")


def test_a_cuda_index_beyond_the_devices_names_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(InputError, match=r"no such CUDA device, this machine has 2; available here: cpu, "
                                         r"cuda:0, cuda:1"):
        resolve_device("cuda:5", what="--device")


@pytest.mark.parametrize("command", [
    ["evaluate", "--checkpoint", "x.pt", "--data", "d"],
    ["index", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--out", "i"],
    ["search", "--index", "i", "--text", "a dog"],
    ["explain", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--image-id", "0", "--text", "a",
     "--out", "e.png"],
    ["extract", "--images", "i", "--captions", "c.tsv", "--out", "o"],
])
@pytest.mark.parametrize("name", ["cuda", "cuda:5", "mps", "foo"])
def test_every_device_option_refuses_an_unusable_device_before_loading(no_gpu, capsys, command, name):
    code = main([*command, "--device", name])
    _one_line_error(capsys, code, f"sgraf {command[0]}: error: argument --device: device {name!r}",
                    "available here: cpu")


def test_train_refuses_an_unusable_device_before_creating_the_run(no_gpu, capsys, tmp_path):
    code = main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "tiny",
                 "--set", "device=cuda"])
    _one_line_error(capsys, code, "training config field 'device' 'cuda': CUDA is not available")
    assert not (tmp_path / "run").exists()


def test_a_torchrun_local_rank_without_its_gpu_is_named(monkeypatch):
    from sgraf import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match="LOCAL_RANK 3 has no CUDA device: this machine has 1"):
        distributed.init_from_env(device="cuda")


def test_the_library_checks_devices_too(no_gpu, gallery):
    from sgraf import distributed

    with pytest.raises(InputError, match="CUDA is not available"):
        distributed.init_from_env(device="cuda")
    with pytest.raises(InputError, match="'cuda:1': CUDA is not available"):
        Matcher.load([gallery["checkpoint"]], device="cuda:1")


# --------------------------------------------------------------------------------- 2. numbers
def _dummy(command: str, tmp_path: Path) -> list[str]:
    """The required arguments of `command`, with values that fail fast if the number is let through."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return {
        "index": ["index", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--out", "i"],
        "extract": ["extract", "--images", "i", "--captions", "c.tsv", "--out", "o"],
        "evaluate": ["evaluate", "--checkpoint", "x.pt", "--data", "d"],
        "search": ["search", "--index", "i", "--text", "a dog"],
        "explain": ["explain", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--text", "a",
                    "--out", "e.png"],
        "generate": ["generate", "--out", str(blocker / "g"), "--features", "synthetic"],
        "demo": ["demo", "--out", str(blocker)],
        "data": ["data", "check", "--data", "d", "--split", "test"],
        "vocab": ["vocab", "build", "--data", "d", "--out", "v.json"],
    }[command]


@pytest.mark.parametrize("command, flag, value, expected", [
    ("index", "--batch-size", "0", "expected a positive integer, got 0"),
    ("index", "--batch-size", "-4", "expected a positive integer, got -4"),
    ("extract", "--batch-size", "0", "expected a positive integer, got 0"),
    ("extract", "--image-size", "-32", "expected an integer in 16..4096, got -32"),
    ("evaluate", "--batch-size", "0", "expected a positive integer, got 0"),
    ("evaluate", "--folds", "0", "expected a positive integer, got 0"),
    ("search", "--top-k", "0", "expected a positive integer, got 0"),
    ("search", "--shortlist", "-1", "expected an integer >= 0, got -1"),
    ("explain", "--image-id", "-1", "expected an integer >= 0, got -1"),
    ("generate", "--n-train", "0", "expected a positive integer, got 0"),
    ("generate", "--n-dev", "-1", "expected a positive integer, got -1"),
    ("generate", "--n-test", "0", "expected a positive integer, got 0"),
    ("generate", "--synthetic-dim", "0", "expected an integer in 1..8192, got 0"),
    ("generate", "--seed", "-1", "expected a seed in 0..4294967295, got -1"),
    ("generate", "--seed", str(2**32), "expected a seed in 0..4294967295, got 4294967296"),
    ("demo", "--seed", "-1", "expected a seed in 0..4294967295, got -1"),
    ("data", "--max-captions", "0", "expected a positive integer, got 0"),
    ("vocab", "--min-count", "0", "expected a positive integer, got 0"),
    ("index", "--batch-size", "ten", "expected a positive integer, got 'ten'"),
    ("search", "--top-k", "1_0", "expected a positive integer, got '1_0'"),      # int() had read 10
    ("explain", "--image-id", "1.0", "expected an integer >= 0, got '1.0'"),
])
def test_numbers_out_of_range_are_refused_naming_the_flag(capsys, tmp_path, command, flag, value, expected):
    code = main([*_dummy(command, tmp_path), f"{flag}={value}"])
    _one_line_error(capsys, code, f"argument {flag}: {expected}")


def test_search_image_id_negative_is_refused_naming_the_flag(capsys):
    code = main(["search", "--index", "i", "--image-id", "-1"])
    _one_line_error(capsys, code, "argument --image-id: expected an integer >= 0, got -1")


@pytest.mark.parametrize("value, expected", [("-1", "got -1"), (str(2**32), f"got {2**32}")])
def test_train_seed_out_of_range_is_refused_naming_the_key(capsys, value, expected):
    code = main(["train", "--preset", "tiny", "--list-keys", "--set", f"seed={value}"])
    _one_line_error(capsys, code, "training config field 'seed' must be an integer in 0..4294967295", expected)


def test_library_batch_sizes_must_be_positive(gallery, tmp_path):
    from sgraf.data.features import extract_to_npy
    from sgraf.scoring import encode_images
    from sgraf.search import build_index

    matcher = Matcher.load([gallery["checkpoint"]])
    features = np.load(gallery["data"] / "test_ims.npy")
    with pytest.raises(InputError, match="batch_size must be a positive integer, got 0"):
        build_index(matcher, features, gallery["captions"], tmp_path / "index", batch_size=0)
    assert not (tmp_path / "index").exists()
    with pytest.raises(InputError, match="batch_size must be a positive integer, got -2"):
        Matcher(matcher.models, batch_size=-2)
    with pytest.raises(InputError, match="batch_size must be a positive integer, got 0"):
        encode_images(matcher.models[0], features, batch_size=0)
    with pytest.raises(InputError, match=r"batch_size must be a positive integer, got 0"):
        extract_to_npy([], 1, backbone=None, out_path=tmp_path / "x.npy", batch_size=0)


# --------------------------------------------------------------------------------- 3. files
def _weights_files(tmp_path: Path, gallery: dict) -> dict[str, tuple[Path, str]]:
    text = tmp_path / "notes.txt"
    text.write_text("these are not weights\n")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], listed)
    return {
        "text": (text, "not a readable PyTorch weights file"),
        "noise": (noise, "not a readable PyTorch weights file"),
        "empty": (empty, "empty file"),
        "sgraf checkpoint": (gallery["checkpoint"], "an sgraf model checkpoint"),
        "list": (listed, "holds list"),
    }


@pytest.mark.parametrize("kind", ["text", "noise", "empty", "sgraf checkpoint", "list"])
def test_weights_files_that_are_not_weights_are_named(tmp_path, gallery, kind):
    from sgraf.data.features import load_state_dict_file

    path, message = _weights_files(tmp_path, gallery)[kind]
    with pytest.raises(InputError) as error:
        load_state_dict_file(path, "EfficientNet-Lite0 weights")
    text = str(error.value)
    assert text.startswith(f"{path}: ") and message in text and "expected EfficientNet-Lite0 weights" in text
    assert "\n" not in text


def test_extract_weights_of_another_network_are_one_line_errors(tmp_path, gallery, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    base = ["extract", "--images", str(tmp_path), "--captions", str(tmp_path / "c.tsv"), "--out",
            str(tmp_path / "out")]
    for path, message in _weights_files(tmp_path, gallery).values():
        _one_line_error(capsys, main([*base, "--weights", str(path)]), f"{path}: {message}")
    other = tmp_path / "other.pt"
    torch.save({"_conv_stem.weight": torch.zeros(3, 3, 1, 1)}, other)   # the right name, another shape
    _one_line_error(capsys, main([*base, "--weights", str(other)]), f"{other}: not EfficientNet-Lite0 weights",
                    "size mismatch for _conv_stem.weight")
    _one_line_error(capsys, main([*base, "--weights", str(tmp_path / "missing.pt")]), "missing.pt")


@pytest.mark.parametrize("content, problem", [
    (b"", "empty file"),
    (b"checkpoint: none\n", "neither a torch.save archive nor a pickle"),
])
def test_files_that_are_not_checkpoints_or_arrays_say_what_they_are_not(gallery, tmp_path, capsys, content,
                                                                        problem):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    _one_line_error(capsys, main(["evaluate", "--checkpoint", str(bad), "--data", str(gallery["data"])]),
                    f"{bad}: not a readable PyTorch checkpoint ({problem})")
    npy_problem = "the file is empty" if not content else "it does not start with the NumPy header"
    _one_line_error(capsys, main(["evaluate", "--sims", str(bad)]), f"{bad}: not a readable .npy array: {npy_problem}")


@pytest.mark.parametrize("change, message", [
    ({"config": {}}, "model config lacks the field(s) vocab_size"),
    ({"config": {"module": "xyz"}}, "model config field 'module' must be one of"),
    ({"vocab": "abc"}, "checkpoint field 'vocab' is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ({"vocab": 3}, "checkpoint field 'vocab' must be the JSON text of a vocabulary or null, got int"),
    ({"vocab": "abc", "version": 1}, "checkpoint field 'vocab' must be the vocabulary's content (a dict) or null, "
                                     "got str"),
])
def test_sgraf_checkpoints_with_bad_fields_are_named(gallery, tmp_path, capsys, change, message):
    checkpoint = torch.load(gallery["checkpoint"], weights_only=True)
    if change.get("config"):
        change = {"config": {**checkpoint["config"], **change["config"]}}
    bad = tmp_path / "bad.pt"
    torch.save({**checkpoint, **change}, bad)
    code = main(["index", "--checkpoint", str(bad), "--data", str(gallery["data"]), "--split", "test", "--out",
                 str(tmp_path / "index")])
    _one_line_error(capsys, code, f"{bad}: {message}")


def test_explain_names_a_broken_picture_or_boxes_file(gallery, tmp_path):
    from sgraf.explain import region_layout

    (tmp_path / "images" / "test").mkdir(parents=True)
    (tmp_path / "images" / "test" / "00000.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match=r"00000\.png: not a readable image"):
        region_layout(tmp_path, "test", 0, K)
    (tmp_path / "images" / "test" / "00000.png").unlink()
    (tmp_path / "test_boxes.npy").write_text("0 0 1 1\n")
    with pytest.raises(InputError, match=r"test_boxes\.npy: not a readable \.npy array: it does not start with the NumPy header"):
        region_layout(tmp_path, "test", 0, K)


def test_generate_preview_must_be_a_png(capsys, tmp_path):
    code = main(["generate", "--out", str(tmp_path / "g"), "--features", "synthetic", "--n-train", "1", "--n-dev",
                 "1", "--n-test", "1", "--no-images", "--preview", str(tmp_path)])
    _one_line_error(capsys, code, "argument --preview: expected a .png file name")
    assert not (tmp_path / "g").exists()


def _damaged_copy(gallery: dict, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "index"
    shutil.copytree(gallery["index"], copy)
    return copy


def _overwrite_data(path: Path, values: np.ndarray) -> None:
    """Replace the last bytes of a .npy file (its data) by `values`, keeping its size and header."""
    raw = bytearray(path.read_bytes())
    payload = values.tobytes()
    raw[len(raw) - len(payload):] = payload
    path.write_bytes(bytes(raw))


def _damage(copy: Path, what: str) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    if what == "truncated captions":
        (copy / "captions.txt").write_bytes((copy / "captions.txt").read_bytes()[:-5])
    elif what == "captions not UTF-8":
        size = (copy / "captions.txt").stat().st_size
        (copy / "captions.txt").write_bytes(b"a dog\n\xff\xfe" + b"x" * (size - 8))
    elif what == "missing captions":
        (copy / "captions.txt").unlink()
    elif what == "lengths":
        _overwrite_data(copy / "caption_lengths.npy", np.full(3, 10**9, dtype=np.int64))
    elif what == "keys":
        _overwrite_data(copy / "image_keys.npy", np.full(2, np.nan, dtype=np.float32))
    elif what == "manifest entry":
        del manifest["files"]["image_keys.npy"]["bytes"]
    elif what == "manifest count":
        manifest["n_images"] = "four"
    if what.startswith("manifest"):
        (copy / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("what, message", [
    ("truncated captions", "bytes where the manifest records"),
    ("captions not UTF-8", "captions.txt:2: corrupted index file, bytes that are not valid UTF-8 (byte 0xff)"),
    ("missing captions", "captions.txt: index file is missing"),
    ("lengths", "caption_lengths.npy: corrupted index file, lengths 5..1000000000 where 1..7"),
    ("keys", "image_keys.npy: corrupted index file, float32 keys with NaN or infinite values"),
    ("manifest entry", "manifest.json: corrupted index manifest, the entry for image_keys.npy lacks bytes"),
    ("manifest count", "manifest.json: corrupted index manifest, field 'n_images' is 'four', expected a "
                       "positive integer"),
])
def test_damaged_index_under_no_verify_says_what_is_damaged(gallery, tmp_path, capsys, what, message):
    copy = _damaged_copy(gallery, tmp_path)
    _damage(copy, what)
    code = main(["search", "--index", str(copy), "--text", "a dog", "--no-verify"])
    _one_line_error(capsys, code, str(copy), message)


def test_damaged_embeddings_are_named_when_a_query_reads_them(gallery, tmp_path, capsys):
    copy = _damaged_copy(gallery, tmp_path)
    _overwrite_data(copy / "image_regions.0.npy", np.full(4, np.inf, dtype=np.float32))  # the last image
    code = main(["search", "--index", str(copy), "--image-id", str(N_IMG - 1), "--no-verify"])
    _one_line_error(capsys, code, f"{copy / 'image_regions.0.npy'}: corrupted index file, NaN or infinite")
    assert main(["search", "--index", str(copy), "--image-id", "0", "--no-verify"]) == 0  # other rows are fine


# --------------------------------------------------------------------------------- 4. text
@pytest.mark.parametrize("command", [
    ["search", "--index", "i"],
    ["explain", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--image-id", "0", "--out", "e.png"],
])
def test_query_text_that_is_not_utf8_is_refused_naming_the_argument(capsys, command):
    text = b"a \xff dog".decode("utf-8", "surrogateescape")   # what Python makes of such bytes in argv
    code = main([*command, "--text", text])
    _one_line_error(capsys, code, "argument --text: bytes that are not valid UTF-8 (byte 0xff at character 3)")


def test_text_that_is_not_utf8_is_refused_by_the_library(gallery):
    text = b"\xffdog".decode("utf-8", "surrogateescape")
    with pytest.raises(InputError, match="is not valid UTF-8"):
        tokenize(text)
    with pytest.raises(InputError, match="is not valid UTF-8"):
        Matcher.load([gallery["checkpoint"]]).encode_texts([text])


def test_caption_and_vocabulary_files_that_are_not_utf8_are_named_with_their_line(gallery, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(gallery["data"], data)
    (data / "test_caps.txt").write_bytes(b"a dog\na red \xe9ball\n" * N_IMG)
    code = main(["data", "check", "--data", str(data), "--split", "test"])
    _one_line_error(capsys, code, f"{data / 'test_caps.txt'}:2: bytes are not valid UTF-8 (byte 0xe9 at column 7)")
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(b'{"word2idx": {"caf\xe9": 4}}')
    code = main(["index", "--checkpoint", str(gallery["checkpoint"]), "--data", str(gallery["data"]), "--split",
                 "test", "--out", str(tmp_path / "index"), "--vocab", str(vocab)])
    _one_line_error(capsys, code, f"{vocab}:1: bytes are not valid UTF-8 (byte 0xe9)")
    table = tmp_path / "captions.tsv"
    table.write_bytes(b"1\ta dog\n2\ta \xffcat\n")
    code = main(["convert-tsv", "--tsv", str(vocab), "--out", str(tmp_path / "out"), "--split", "test",
                 "--captions", str(table)])
    _one_line_error(capsys, code, f"{table}:2: bytes are not valid UTF-8")


def test_training_config_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_bytes(b"epochs: 2\nmodule: s\xe9r\n")
    code = main(["train", "--config", str(config), "--list-keys"])
    _one_line_error(capsys, code, f"{config}:2: bytes are not valid UTF-8 (byte 0xe9)")


def test_scenes_and_metrics_that_are_not_utf8(tmp_path):
    from sgraf.data.benchmark import load_scenes
    from sgraf.training.run_dir import read_metrics

    (tmp_path / "test_scenes.jsonl").write_bytes(b'{"family": 0}\n{"family": "\xff"}\n')
    with pytest.raises(InputError, match=r"test_scenes.jsonl:2: bytes are not valid UTF-8"):
        load_scenes(tmp_path, "test")
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n7\n{"step": \xff\n')  # a torn, damaged tail
    assert read_metrics(tmp_path) == [{"step": 1}]


# --------------------------------------------------------------------------------- 5. also
def test_version_comes_from_the_package_metadata(capsys, monkeypatch):
    from importlib import metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"sgraf {metadata.version('sgraf')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"sgraf {sgraf.__version__}\n"


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "sgraf"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subparsers(sub, f"{prefix} {name}")


def test_help_shows_every_default_once():
    checked = 0
    for name, parser in [("sgraf", build_parser()), *_subparsers(build_parser())]:
        for action in parser._actions:
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            text = " ".join(formatter.format_help().split())
            assert text.count("default") <= 1, (name, text)
            if action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0:
                continue
            default = action.default
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
            assert f"(default: {shown})" in text, (name, text)
            checked += 1
    assert checked >= 25


def test_index_shows_progress_unless_quiet(gallery, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)    # bars are drawn on a terminal only
    args = ["index", "--checkpoint", str(gallery["checkpoint"]), "--data", str(gallery["data"]), "--split",
            "test", "--batch-size", "2"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "encoding images" in err and "encoding captions" in err
    assert main([*args, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert "encoding" not in capsys.readouterr().err


def test_every_command_takes_quiet_and_defaults_its_device_to_auto(no_gpu):
    from sgraf.cli import _leaf_parsers
    from sgraf.cli.arguments import device

    assert device("auto") == device(" AUTO ") == "cpu"     # resolved while parsing (extract had moved to "auto")

    leaves = _leaf_parsers(build_parser())
    assert len(leaves) >= 16 and {"sgraf data check", "sgraf vocab build", "sgraf train"} <= {p.prog for p in leaves}
    for command in leaves:
        assert "--quiet" in command._option_string_actions, command.prog
        device = command._option_string_actions.get("--device")
        assert device is None or device.default == "auto", command.prog


def test_quiet_silences_info_lines_and_bars_everywhere(gallery, tmp_path, capsys, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    base = [sys.executable, "-m", "sgraf"]
    args = ["evaluate", "--checkpoint", str(gallery["checkpoint"]), "--data", str(gallery["data"]), "--split", "test",
            "--device", "cpu"]
    loud = subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=120)
    assert loud.returncode == 0 and "INFO sgraf.evaluate: evaluating" in loud.stderr, loud.stderr
    for quiet in ([*base, "-q", *args], [*base, *args, "--quiet"]):
        run = subprocess.run(quiet, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stderr == "" and "rsum" in run.stdout, run.stderr
    # the bars: silenced by --quiet for that call only (tests call main again in one process)
    base = ["index", "--checkpoint", str(gallery["checkpoint"]), "--data", str(gallery["data"]), "--split", "test",
            "--batch-size", "2"]
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert "encoding" not in capsys.readouterr().err        # stderr is no terminal here: no bars
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["-q", *base, "--out", str(tmp_path / "e")]) == 0
    assert "encoding" not in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "f")]) == 0
    assert "encoding images" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stderr", None)                # closed (2>&-): no bar, and the work is done
    assert main([*base, "--out", str(tmp_path / "g")]) == 0
    monkeypatch.undo()
    _one_line_error(capsys, main(["-v", *base, "--out", str(tmp_path / "h"), "--quiet"]),
                    "sgraf index: error: --verbose and --quiet ask for opposite things")


def test_rank_1_logs_no_info_and_paths_that_are_not_utf8_print_as_given(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train_caps.txt").write_text("a red ball\n" * 4)
    out = os.fsencode(tmp_path) + b"/vocab-\xff.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "PYTHONIOENCODING": "utf-8"}   # strict UTF-8 stdout, as in a UTF-8 locale
    run = subprocess.run([sys.executable, "-m", "sgraf", "vocab", "build", "--data", str(data), "--out", out,
                          "--splits", "train"], env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert b"INFO" not in run.stderr                       # under torchrun, INFO comes from rank 0 only
    assert run.stdout.startswith(b"wrote " + out + b":")   # the bytes of the path, as given
    from sgraf.cli import log_level

    assert log_level(verbose=False, rank=0) == 20 and log_level(verbose=False, rank=1) == 30
    assert log_level(verbose=False, rank=0, quiet=True) == 30


def test_demo_logs_each_override_once(tmp_path, monkeypatch, caplog):
    import sgraf.demo

    class Stop(Exception):
        pass

    def fit(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(sgraf.demo, "_data", lambda *args: {})
    monkeypatch.setattr("sgraf.training.pool.fit_all", fit)
    caplog.set_level("INFO", logger="sgraf.demo")
    for quick in (True, False):
        with pytest.raises(Stop):
            sgraf.demo.run_demo(tmp_path / "demo", quick=quick, seed=3)
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training")][-1]
        keys = [pair.split("=")[0] for pair in line.split("(", 1)[1].rstrip(")").split(", ")]
        assert len(keys) == len(set(keys)) and "seed" in keys, line
    assert "word_dim=32" in line and "seed=3" in line  # the full run's values, the last logged


# --------------------------------------------------------------------------------- 6. README and docs
def _shell_commands(path: Path) -> list[list[str]]:
    """Every `sgraf ...` command of a Markdown file's shell blocks, continuation lines joined."""
    text = path.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if "sgraf" in words and (words[0] == "sgraf" or words[words.index("sgraf") - 1] == "-m"):
                    commands.append(words[words.index("sgraf") + 1:])
    return commands


def _readme_commands() -> list[list[str]]:
    return _shell_commands(ROOT / "README.md")


def _site_pages() -> list[Path]:
    """The documentation site's Markdown pages in the order of mkdocs.yml's nav (a reader's
    order: a page may use what an earlier page's commands write), then any page not in it."""
    import yaml

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        return []

    nav = walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = [ROOT / "docs" / page for page in nav]
    return pages + sorted(set((ROOT / "docs").rglob("*.md")) - set(pages))


def _check_command_sequence(commands: list[list[str]], where: str) -> None:
    """Each command parses with the real parser, and what it reads an earlier command wrote
    (downloaded precomp sets under data/ excepted)."""
    parser = build_parser()
    produced: set[str] = set()
    for words in commands:
        args = parser.parse_args(words)   # an unknown flag or a bad value exits here
        consumed = [*(getattr(args, "checkpoint", None) or []), *(getattr(args, "sims", None) or [])]
        if args.command == "search":
            consumed.append(args.index)
        data = getattr(args, "data", None)
        if data and not data.startswith("data/"):   # data/: the downloaded precomp sets
            consumed.append(data)
        for path in consumed:
            if path.endswith((".pt", ".npy")) or path in (data, getattr(args, "index", None), "..."):
                assert path in produced, f"{where}: sgraf {' '.join(words)}: {path} is written by no earlier command"
        if args.command == "generate":
            produced.add(args.out)
        elif args.command == "train" and args.out:
            produced.update({f"{args.out}/best.pt", f"{args.out}/last.pt"})
        elif args.command == "demo":
            produced.update(f"{args.out}/runs/{name}/best.pt" for name in ("sgr", "saf", "global-only"))
            produced.add(f"{args.out}/data")
        elif args.command in ("evaluate", "diagnose") and args.save_sims:
            produced.add(args.save_sims)
        elif args.command == "convert-checkpoint":
            produced.add(args.dst)
        elif args.command == "index":
            produced.add(args.out)


def test_readme_commands_parse_and_use_what_earlier_commands_write():
    commands = _readme_commands()
    assert len(commands) >= 6
    assert ["serve", "--index", "sgraf-demo/index"] in commands     # the demo's last line
    _check_command_sequence(commands, "README.md")


def test_site_commands_parse_and_use_what_earlier_pages_write():
    """Every `sgraf ...` command shown on the documentation site, read in the nav's order."""
    pages = _site_pages()
    assert all(page.is_file() for page in pages), [str(p) for p in pages if not p.is_file()]
    commands = [words for page in pages for words in _shell_commands(page)]
    assert len(commands) >= 20
    _check_command_sequence(commands, "docs/")


def test_ctrl_c_while_the_arguments_are_read_is_one_line(capsys, monkeypatch):
    """`--device` imports torch while the arguments are parsed (a second): Ctrl-C then had printed
    a KeyboardInterrupt traceback of 40 to 80 lines."""
    from sgraf import devices

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(devices, "resolve_device", interrupted)
    assert main(["search", "--index", "x", "--text", "a dog", "--device", "cpu"]) == 130
    assert capsys.readouterr().err == "sgraf: interrupted\n"
