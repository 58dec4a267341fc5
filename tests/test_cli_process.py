"""The `sgraf` process itself: a help that does not load PyTorch, and an exit without teardown."""

import json
import os
import pathlib
import subprocess
import sys


E2E = pathlib.Path(__file__).parent / "data" / "e2e"

# a child that ends through exit_process: its buffered output, an atexit handler, and an object
# whose finaliser only the interpreter's teardown runs
CHILD = """
import atexit, sys, threading, time
class Loud:
    def __del__(self):
        print("teardown", flush=True)
keep = Loud()
atexit.register(lambda: print("atexit ran"))
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
print("output")   # block-buffered: stdout is a pipe
from sgraf.cli import exit_process
exit_process(3)
"""


def run_child(mode, **env):
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_exit_process_flushes_runs_exit_handlers_and_skips_teardown():
    child = run_child("plain")
    assert child.returncode == 3, child.stderr
    assert child.stdout.splitlines() == ["output", "atexit ran"]


def test_exit_process_exits_the_usual_way_when_asked_or_when_work_is_running():
    off = run_child("plain", SGRAF_FAST_EXIT="off")
    assert off.returncode == 3 and off.stdout.splitlines() == ["output", "atexit ran", "teardown"]
    thread = run_child("thread")     # a thread that is no daemon: waited for, as Python does
    assert thread.returncode == 3
    assert thread.stdout.splitlines() == ["output", "thread finished", "atexit ran", "teardown"]


def test_help_and_an_evaluate_command_line_do_not_import_pytorch():
    code = ("import sys, contextlib, io\nfrom sgraf.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(['--help']) == 0\n"
            "    assert main(['train', '--help']) == 0\n"
            "from sgraf.cli import build_parser\n"
            "for device in ('auto', 'cuda', 'cpu'):   # checked by the command, after its prefetch starts\n"
            "    build_parser().parse_args(['evaluate', '--checkpoint', 'x', '--data', 'd', '--device', device])\n"
            "print(sorted(m for m in ('torch', 'numpy', 'nltk') if m in sys.modules))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert child.stdout.strip() == "[]"


def test_the_command_through_its_entry_points():
    """`python -m sgraf` (what torchrun starts) and the console script's `entry()`."""
    base = [sys.executable, "-m", "sgraf", "evaluate", "--checkpoint", str(E2E / "sgr.pth.tar"), "--vocab",
            str(E2E / "data" / "toy_vocab.json"), "--quiet"]
    done = subprocess.run([*base, "--data", str(E2E / "data" / "toy_precomp"), "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n_captions"] == 30
    refused = subprocess.run([*base, "--data", str(E2E / "missing")], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [f"sgraf evaluate: error: --data {E2E / 'missing'}: no such folder"]
    script = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'sgraf'; from sgraf.cli import entry; "
                             "entry()", "--version"], capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and script.stdout.startswith("sgraf ")


# a signal whose handler runs inside a finaliser (the garbage collector runs them between any two
# lines: a regex group's __del__ caught a SIGTERM at a run's start, which then trained to its end)
FINALISED = """
import signal, sys, time
from sgraf.signals import Stopped, stop_on_sigterm
signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal starts it (a background job ignores it)
class Finalised:
    def __del__(self):
        signal.raise_signal(getattr(signal, sys.argv[1]))    # the handler raises here, in the finaliser
        time.sleep(0.01)
try:
    with stop_on_sigterm():
        Finalised()
        for _ in range(50):
            time.sleep(0.01)
        print("went on past the signal")
except (Stopped, KeyboardInterrupt) as stop:
    print("stopped:", type(stop).__name__, stop)
"""


def test_a_signal_caught_in_a_finaliser_still_stops_the_command():
    for name, expected in (("SIGTERM", "stopped: Stopped stopped by SIGTERM"),
                           ("SIGINT", "stopped: KeyboardInterrupt")):
        done = subprocess.run([sys.executable, "-c", FINALISED, name], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == expected and done.stderr == "", (done.stdout, done.stderr)


def test_a_torchrun_environment_without_its_other_processes_is_bounded_and_interruptible(tmp_path):
    """RANK / WORLD_SIZE left set with no other process to join: the wait is said, bounded
    (SGRAF_JOIN_TIMEOUT), and SIGTERM ends it (PyTorch's rendezvous had waited without end,
    deferring SIGINT and SIGTERM)."""
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "SGRAF_JOIN_TIMEOUT": "2"}
    base = [sys.executable, "-m", "sgraf", "evaluate", "--checkpoint", str(E2E / "sgr.pth.tar"), "--vocab",
            str(E2E / "data" / "toy_vocab.json"), "--data", str(E2E / "data" / "toy_precomp")]   # INFO: not --quiet
    done = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "joining the 2 processes of the torchrun job" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"sgraf evaluate: error: the torchrun job's process group at 127.0.0.1:{port} did not form within 2 s")
    child = subprocess.Popen(base, stderr=subprocess.PIPE, text=True, env={**env, "SGRAF_JOIN_TIMEOUT": "600"})
    for line in child.stderr:
        if "joining the 2 processes" in line:
            break
    time.sleep(0.5)
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 143
    assert time.monotonic() - started < 10


def test_a_refusal_echoes_a_huge_value_cut_to_its_start_and_length(capsys):
    from sgraf.cli import main

    assert main(["train", "--data", "d", "--out", "o", "--set", "module=" + "x" * 100_000]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err) < 600 and err.endswith("... (100,002 characters)"), err[:300]


def test_an_unknown_option_is_refused_in_the_commands_name(capsys):
    from sgraf.cli import main

    assert main(["evaluate", "--checkpoint", "x.pt", "--data", "d", "--level", "0.9"]) == 2
    assert capsys.readouterr().err.strip() == ("sgraf evaluate: error: unrecognized arguments: --level 0.9 "
                                               "(see sgraf evaluate --help)")
    assert main(["vocab", "build", "--data", "d", "--out", "v.json", "--bogus"]) == 2
    assert capsys.readouterr().err.startswith("sgraf vocab build: error: unrecognized arguments: --bogus")
    assert main(["--bogus", "evaluate", "--checkpoint", "x.pt", "--data", "d"]) == 2
    assert capsys.readouterr().err.startswith("sgraf: error: unrecognized arguments: --bogus (see sgraf --help)")


def test_an_option_of_one_value_given_twice_is_refused_and_options_that_collect_may_repeat(capsys, tmp_path):
    """argparse keeps the last of `--split test --split dev` silently (it evaluated dev); `--sims`,
    `--against` and `--splits` kept only their last list (an ensemble of one)."""
    import numpy as np

    from sgraf.cli import main

    for argv, option, values in (
            (["evaluate", "--checkpoint", "x.pt", "--data", "d", "--split", "test", "--split", "dev"], "--split",
             "test, then dev"),
            (["evaluate", "--checkpoint", "x.pt", "--data=d", "--spl", "dev", "--data", "e"], "--data", "d, then e"),
            (["data", "check", "--data", "d", "--split", "test", "--split=dev"], "--split", "test, then dev")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        prog = "sgraf data check" if argv[0] == "data" else "sgraf evaluate"
        assert err == f"{prog}: error: argument {option}: given twice ({values}): give it once (see {prog} --help)\n"
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.save(tmp_path / f"{name}.npy", rng.random((4, 20), dtype=np.float32))
    both = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    assert main(["evaluate", "--sims", *both, "--json"]) == 0
    together = json.loads(capsys.readouterr().out)
    assert main(["evaluate", "--sims", both[0], "--sims", both[1], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == together          # the average of both, not b alone
    from sgraf.data.benchmark import generate_benchmark

    generate_benchmark(tmp_path / "data", n_train=8, n_dev=4, n_test=4, save_images=False)
    assert main(["vocab", "build", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "v.json"),
                 "--splits", "train", "--splits", "dev"]) == 0
    assert "captions (train, dev)" in capsys.readouterr().out
    assert main(["vocab", "build", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "v.json")]) == 0
    assert "captions (train, dev)" in capsys.readouterr().out       # the default


def test_counts_that_would_exhaust_memory_are_refused_and_running_out_of_memory_is_one_line(capsys, monkeypatch):
    """--resamples 99999999999 had died allocating 4.37 TiB with numpy's traceback, serve --workers
    100000 on a thread it could not start, extract --image-size 100000 killed by the kernel."""
    from sgraf.cli import main

    for argv, option, bounds in ((["compare", "--sims", "a.npy", "--against", "b.npy", "--resamples", "99999999999"],
                                  "--resamples", "1..1000000"),
                                 (["evaluate", "--sims", "a.npy", "--bootstrap", "2000000"], "--bootstrap",
                                  "1..1000000"),
                                 (["serve", "--index", "x", "--workers", "100000"], "--workers", "1..64"),
                                 (["extract", "--images", "i", "--out", "o", "--image-size", "100000"], "--image-size",
                                  "16..4096"),
                                 (["generate", "--out", "g", "--synthetic-dim", "99999999"], "--synthetic-dim",
                                  "1..8192")):
        assert main(argv) == 2
        assert f"error: argument {option}: expected an integer in {bounds}, got" in capsys.readouterr().err

    def exhausted(args):
        raise MemoryError("Unable to allocate 4.37 TiB for an array with shape (99999999999, 6) and data type float64")

    import argparse

    from sgraf import cli

    real_build = cli.build_parser

    def build_with_exhausted_runs():        # `sgraf runs` as if its work ran out of memory
        parser = real_build()
        commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        commands.choices["runs"].set_defaults(func=exhausted)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_with_exhausted_runs)
    assert main(["runs", "."]) == 1
    assert capsys.readouterr().err == ("sgraf runs: error: out of memory: Unable to allocate 4.37 TiB for an array "
                                       "with shape (99999999999, 6) and data type float64\n")
