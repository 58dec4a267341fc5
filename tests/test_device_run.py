"""benchmarks/device_run.sh, the GPU run that waits for a device, checked without one.

A session with a device has 15 minutes of it, so a step that fails on a renamed option or a
command that no longer parses costs a whole run. The steps' commands are read from the script
as bash would split them; every benchmark's options and every `sgraf` command line are parsed by
their own parsers (nothing is run), the inline Python compiles, and each step name that the
documentation's `STEPS=` lists is one the script has.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_run.sh"


def expanded(text: str) -> str:
    """`${NAME:-default}` as bash gives it where NAME is unset: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def steps() -> dict[str, list[str]]:
    """Each `step NAME LIMIT COMMAND...` of the script: NAME -> COMMAND's words (a quoted
    argument over several lines is one word, as bash reads it)."""
    found: dict[str, list[str]] = {}
    lines = SCRIPT.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = re.sub(r"^(\w+=\S+ )+", "", lines[index].strip())     # TAIL=20 step ...
        index += 1
        if not line.startswith("step "):
            continue
        while True:
            try:
                words = shlex.split(expanded(line))
                break
            except ValueError:                                       # a quote still open
                line += "\n" + lines[index]
                index += 1
        _, name, limit, *command = words
        assert limit.isdigit(), f"step {name}: limit {limit!r}"
        found[name] = command
    return found


def python_commands(command: list[str]) -> list[list[str]]:
    """The Python command lines a step runs: itself, or each line of a `bash -c` script,
    without `env NAME=VALUE` and `set -e;` in front."""
    if command[:2] == ["bash", "-c"]:
        lines = [shlex.split(re.sub(r"^\s*set -e;", "", line)) for line in command[2].splitlines()]
    else:
        lines = [command]
    out = []
    for words in lines:
        if words and words[0] == "env":
            words = words[1:]
        while words and re.fullmatch(r"\w+=.*", words[0]):
            words = words[1:]
        if words:
            assert words[0] in ("python3", "python"), f"not a Python command: {words}"
            out.append(words[1:])
    return out


class Parsed(Exception):
    """Raised by the patched `parse_args` with what it parsed, before the command does anything."""


def parse(main, argv: list[str], monkeypatch, capsys, step: str = "") -> argparse.Namespace:
    """What `main` parses from `argv` (as its `sys.argv` and as its argument), run no further;
    a refusal fails the test naming `step` and the command line."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", ["prog", *argv])
        try:
            main(argv) if main.__code__.co_argcount else main()
        except Parsed as parsed:
            return parsed.args[0]
        except SystemExit as refused:
            pytest.fail(f"{step}: {' '.join(argv)}: refused ({refused.code}): {capsys.readouterr().err.strip()}")
    pytest.fail(f"{step}: {' '.join(argv)}: main() returned without parsing its options")


def test_the_script_is_valid_bash_and_has_its_steps():
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    names = steps()
    assert {"test_gpu", "gpu_profile", "torchrun", "bench_train", "train_compiled", "eval_f30k", "eval_coco",
            "host_copy", "train_matrix"} <= set(names)
    default = re.search(r'^DEFAULT_STEPS="([^"]*)"', SCRIPT.read_text(), re.M).group(1).split()
    assert set(default) <= set(names) | {"probe"}, set(default) - set(names)
    # the steps run in the script's order: the default list says that order
    assert [name for name in names if name in default] == [name for name in default if name != "probe"]


def test_every_steps_list_in_the_documentation_names_the_scripts_steps():
    names = set(steps()) | {"probe"}
    lists = []
    for path in [ROOT / "README.md", SCRIPT, *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in re.finditer(r'STEPS=(?:"([^"]*)"|(\w+))', path.read_text()):
            lists.append((path.name, (match.group(1) or match.group(2)).split()))
    assert any(path == "performance-gpu.md" and len(listed) > 3 for path, listed in lists), lists
    for path, listed in lists:
        assert set(listed) <= names, f"{path}: STEPS names {set(listed) - names}, not steps of device_run.sh"


def test_every_steps_command_parses(monkeypatch, capsys):
    """Each benchmark's options by its own parser, each `sgraf` command line by sgraf's, each
    `python -c` compiled, each pytest path present."""
    from sgraf.cli import build_parser
    from sgraf.training.config import resolve_config

    seen = {"benchmark": 0, "sgraf": 0, "inline": 0, "pytest": 0}
    for name, command in steps().items():
        for words in python_commands(command):
            if words[:2] == ["-m", "torch.distributed.run"]:
                words = words[words.index("-m", 2):]                 # torchrun's own options
            if words[:2] == ["-m", "pytest"]:
                paths = [word for word in words[2:] if not word.startswith("-") and word.endswith(".py")]
                assert paths and all((ROOT / path).is_file() for path in paths), f"{name}: {words}"
                seen["pytest"] += 1
            elif words[:2] == ["-m", "sgraf"]:
                try:
                    args = build_parser().parse_args(words[2:])
                except SystemExit as refused:
                    pytest.fail(f"{name}: {' '.join(words)}: refused ({refused.code}): "
                                f"{capsys.readouterr().err.strip()}")
                assert callable(args.func), f"{name}: {words}"
                if args.command == "train":                          # --set's keys and values
                    resolve_config(args.preset, args.config, args.overrides or [])
                seen["sgraf"] += 1
            elif words[0] == "-c":
                compile(words[1], f"<{name}>", "exec")
                seen["inline"] += 1
            else:
                path = ROOT / words[0]
                assert path.parent == ROOT / "benchmarks" and path.is_file(), f"{name}: {words[0]}"
                monkeypatch.syspath_prepend(str(path.parent))
                module = importlib.import_module(path.stem)
                parse(module.main, words[1:], monkeypatch, capsys, f"{name}: {words[0]}")
                seen["benchmark"] += 1
    assert seen["benchmark"] >= 8 and seen["sgraf"] >= 3 and seen["inline"] >= 1 and seen["pytest"] == 2, seen


def test_a_renamed_option_is_caught(monkeypatch, capsys):
    """The check can fail: an option the benchmark does not have is refused, with the command named."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    probe_train_matrix = importlib.import_module("probe_train_matrix")
    assert parse(probe_train_matrix.main, ["--rounds", "2"], monkeypatch, capsys).rounds == 2
    with pytest.raises(pytest.fail.Exception, match="--rounds 2 --no-such-option: refused"):
        parse(probe_train_matrix.main, ["--rounds", "2", "--no-such-option"], monkeypatch, capsys)
