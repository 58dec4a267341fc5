"""The environments users run sgraf in, other than a developer's shell: no home folder, an ASCII
or Latin-1 locale, names the system refuses, a closed stderr, folder names that are not UTF-8."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sgraf.cli import main
from sgraf.cli.arguments import utf8_text
from sgraf.user_cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]
E2E = Path(__file__).parent / "data" / "e2e"
EVALUATE = ["evaluate", "--checkpoint", str(E2E / "sgr.pth.tar"), "--vocab", str(E2E / "data" / "toy_vocab.json"),
            "--data", str(E2E / "data" / "toy_precomp"), "--json"]

# a container run as a user id without a passwd entry, and no HOME: Path.home() raises, and
# importing nltk looked for a download folder under it
HOMELESS = """
import os, pwd, sys
def missing(uid):
    raise KeyError(uid)
pwd.getpwuid = missing
for name in ("HOME", "XDG_CACHE_HOME", "SGRAF_CACHE_DIR"):
    os.environ.pop(name, None)
assert os.path.expanduser("~/") == "~/"
from sgraf.cli import main
from sgraf.user_cache import cache_dir
print(cache_dir())
code = main(sys.argv[1:])
assert "HOME" not in os.environ
sys.exit(code)
"""


def test_no_home_folder_evaluates_with_its_cache_in_the_temporary_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", HOMELESS, *EVALUATE], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    first, result = done.stdout.splitlines()
    assert first == str(tmp_path / f"sgraf-cache-{os.getuid()}") and '"rsum"' in result
    assert (tmp_path / f"sgraf-cache-{os.getuid()}" / "tokens").is_dir()    # the token cache kept there


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.delenv("SGRAF_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_dir() == tmp_path / ".cache" / "sgraf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "sgraf"


def test_command_line_text_is_read_as_utf8_under_any_locale(tmp_path):
    assert utf8_text("a red caf\udcc3\udca9") == "a red café"       # an ASCII locale: bytes as surrogates
    if sys.getfilesystemencoding() == "utf-8":
        with pytest.raises(Exception, match=r"byte 0xe9 at character 10"):
            utf8_text("a red caf\udce9")                              # Latin-1 bytes in a UTF-8 locale
    # the whole way under an ASCII locale without Python's UTF-8 mode: read, scored, printed back
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LC_ALL": "C", "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-m", "sgraf", "explain", *EVALUATE[1:-1], "--split", "test",
                           "--image-id", "0", "--text", "a café", "--allow-unknown", "--out", str(tmp_path / "e.png")],
                          capture_output=True, env=env, timeout=120)
    assert done.returncode == 0 and "café".encode() in done.stdout, done.stderr
    refused = subprocess.run([sys.executable, "-m", "sgraf", "explain", *EVALUATE[1:-1], "--split", "test",
                              "--image-id", "0", "--text", "a café", "--out", str(tmp_path / "e.png")],
                             capture_output=True, env=env, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "word(s) 'café' not in".encode() in refused.stderr, refused.stderr      # not caf\xe9
    # a Latin-1 stdout: what it cannot write is escaped, after the work, never a failure
    latin = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONIOENCODING": "latin-1"}
    done = subprocess.run([sys.executable, "-m", "sgraf", "explain", *EVALUATE[1:-1], "--split", "test",
                           "--image-id", "0", "--text", "a 日本 dog", "--allow-unknown",
                           "--out", str(tmp_path / "j.png")],
                          capture_output=True, env=latin, timeout=120)
    assert done.returncode == 0 and b"\\u65e5\\u672c" in done.stdout, done.stderr


def test_names_the_system_refuses_are_one_line_errors(tmp_path, capsys):
    long = "x" * 300
    for argv in ([*EVALUATE[:2], f"{long}.pt", *EVALUATE[2:]],
                 [*EVALUATE, "--save-sims", str(tmp_path / f"{'z' * 250}.npy")],
                 ["train", "--data", str(E2E / "data" / "toy_precomp"), "--out", str(tmp_path / long)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(": File name too long"), err
    assert sorted(os.listdir(tmp_path)) == []


def test_runs_plot_draws_folder_names_that_are_not_utf8(tmp_path, request):
    folder = os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\xfcn")
    os.makedirs(folder)
    request.addfinalizer(lambda: shutil.rmtree(os.fsencode(folder)))    # pytest's clean-up reads names as text
    Path(folder, "config.yaml").write_text("epochs: 1\n")
    Path(folder, "metrics.jsonl").write_text('{"epoch": 1, "step": 4, "end_of_epoch": true, "rsum": 120.5, '
                                             '"train_loss": 2.0, "best": true}\n')
    done = subprocess.run([sys.executable, "-m", "sgraf", "runs", os.fsencode(folder), "--plot", tmp_path / "runs.png"],
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert done.returncode == 0 and b"r\xfcn" in done.stdout, done.stderr     # the table prints the name's bytes
    assert (tmp_path / "runs.png").stat().st_size > 1000
    assert np.array(__import__("PIL.Image", fromlist=["Image"]).open(tmp_path / "runs.png")).std() > 0


def test_a_closed_stdout_is_said(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "sgraf", "-q", *EVALUATE], stderr=subprocess.PIPE, text=True,
                          env=env, timeout=120, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0
    assert done.stderr.strip() == ("WARNING sgraf: stdout is closed: what sgraf evaluate prints (its results, or what "
                                   "it wrote) is lost")


def test_a_temporary_cache_folder_of_another_user_or_open_to_others_is_not_used(tmp_path, monkeypatch):
    from sgraf import user_cache

    monkeypatch.setattr(user_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(user_cache.tempfile, "tempdir", str(tmp_path))
    user_cache._own_temporary_cache.cache_clear()
    own = tmp_path / f"sgraf-cache-{os.getuid()}"
    assert user_cache._own_temporary_cache() == own and (own.stat().st_mode & 0o777) == 0o700
    own.chmod(0o777)                                     # others may write there: planted files
    user_cache._own_temporary_cache.cache_clear()
    other = user_cache._own_temporary_cache()
    assert other != own and other.parent == tmp_path and (other.stat().st_mode & 0o777) == 0o700
    assert user_cache._own_temporary_cache() == other    # one folder a process
    user_cache._own_temporary_cache.cache_clear()


def test_a_checkpoint_from_a_pipe_is_refused_not_waited_for(tmp_path, capsys):
    fifo = tmp_path / "best.pt"
    os.mkfifo(fifo)                        # an empty FIFO: opening it had waited for a writer without end
    assert main([*EVALUATE[:2], str(fifo), *EVALUATE[2:]]) == 2
    assert f"{fifo}: not a regular file (a pipe or a device?)" in capsys.readouterr().err
