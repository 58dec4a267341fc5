"""`sgraf.training.pool`: several `fit`s at once in worker processes, stopped and failing as one run does."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from sgraf.errors import InputError
from sgraf.signals import Stopped
from sgraf.training import fit
from sgraf.training.config import preset
from sgraf.training.pool import JobResult, TrainJob, fit_all, plan_workers, without_progress
from train_helpers import alive, children, make_toy_precomp


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return make_toy_precomp(tmp_path_factory.mktemp("toy") / "data", n_train=24, n_dev=8)


def _job(name, data, run, **changes):
    return TrainJob(name=name, config=preset("tiny").replace(**changes), data=data, run=run, preset="tiny")


@pytest.mark.parametrize("n_jobs, jobs, on_gpu, cores, plan", [
    (5, None, False, 2, (2, 1)),     # one per core, one thread each
    (5, None, False, 16, (5, 3)),    # no more workers than jobs; the cores shared out
    (5, None, True, 16, (1, 16)),    # on a GPU: one at a time
    (5, 1, False, 16, (1, 16)),
    (3, 8, False, 2, (3, 1)),        # asked for more than the cores: still one thread each
])
def test_plan_workers(n_jobs, jobs, on_gpu, cores, plan):
    assert plan_workers(n_jobs, jobs, on_gpu=on_gpu, cores=cores) == plan


def test_two_workers_train_the_weights_one_process_trains(toy_data, tmp_path):
    jobs = [_job("sgr", toy_data, tmp_path / "sgr", epochs=1), _job("saf", toy_data, tmp_path / "saf", module="saf",
                                                                     epochs=1, seed=3)]
    done = []
    results = fit_all(jobs, workers=2, threads=1, on_done=lambda job, result: done.append(job.name))
    assert sorted(done) == ["saf", "sgr"] and set(results) == {"saf", "sgr"}
    for job in jobs:
        result = results[job.name]
        assert isinstance(result, JobResult) and result.summary["status"] == "finished" and result.wall_s > 0
        torch.set_num_threads(1)
        here = fit(job.config, toy_data, tmp_path / f"{job.name}-here", preset="tiny")
        assert here["best_rsum"] == result.summary["best_rsum"]
        theirs = torch.load(job.run / "best.pt", weights_only=False)["state_dict"]
        ours = torch.load(tmp_path / f"{job.name}-here" / "best.pt", weights_only=False)["state_dict"]
        assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_sigterm_stops_every_running_worker_and_each_saves_last_pt(toy_data, tmp_path):
    jobs = [_job(name, toy_data, tmp_path / name, epochs=200, checkpoint_every=0) for name in ("a", "b", "c")]
    handler = signal.getsignal(signal.SIGTERM)

    def stop_once_training():
        deadline = time.monotonic() + 120
        while not all((job.run / "metrics.jsonl").exists() or (job.run / "config.yaml").exists()
                      for job in jobs[:2]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_training, daemon=True).start()
    with pytest.raises(Stopped) as stopped:
        fit_all(jobs, workers=2, threads=1)
    assert stopped.value.signum == signal.SIGTERM
    assert stopped.value.detail == (f"while training a, b: their last.pt files are saved in {jobs[0].run}, "
                                    f"{jobs[1].run}")
    assert (jobs[0].run / "last.pt").is_file() and (jobs[1].run / "last.pt").is_file()
    assert not jobs[2].run.exists()                      # never started
    assert signal.getsignal(signal.SIGTERM) == handler


def test_a_failing_job_stops_the_others_and_its_error_is_raised(toy_data, tmp_path):
    import multiprocessing

    jobs = [_job("long", toy_data, tmp_path / "long", epochs=200, checkpoint_every=0),
            _job("bad", toy_data, tmp_path / "bad", img_dim=2048, epochs=1)]
    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))  # not the pool's
    bystander.start()
    try:
        with pytest.raises(InputError, match="feature size is 20 but the training config has img_dim=2048"):
            fit_all(jobs, workers=2, threads=1)
        long = tmp_path / "long"
        # "bad" fails within a second of starting; when "long" had not started by then it never
        # starts (seen under PyTorch 2.11's CUDA build, whose import makes a worker start later).
        # When it had, it was stopped cleanly after a step, not killed: its checkpoint saved, its
        # folder unlocked.
        if long.exists():
            assert (long / "last.pt").is_file() and not (long / ".sgraf-lock").exists()
        assert bystander.is_alive()                           # the stop went to the pool's workers only
    finally:
        bystander.kill()
        bystander.join()


def test_one_worker_trains_here_in_the_order_given(toy_data, tmp_path, monkeypatch):
    import sgraf.training.pool as pool

    order = []
    monkeypatch.setattr(pool, "_run_job", lambda job: order.append(job.name) or JobResult({"status": "finished"}, 0, 0))
    jobs = [_job(name, toy_data, tmp_path / name) for name in ("x", "y")]
    fit_all([jobs[0], jobs[1]], workers=1)
    assert order == ["x", "y"]
    with pytest.raises(ValueError, match="unique"):
        fit_all([jobs[0], jobs[0]], workers=1)
    assert without_progress(_job("p", toy_data, tmp_path / "p", progress=True)).config.progress is False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the processes from Linux's /proc")
def test_workers_whose_parent_was_killed_save_their_last_pt_and_exit(toy_data, tmp_path):
    """SIGKILL (or the out-of-memory killer) leaves the parent no time to stop its workers: each
    notices, stops its job as on SIGTERM (last.pt saved) and exits. They had trained on, holding
    their runs' locks, then waited for work without end (a killed `sgraf demo`)."""
    import subprocess
    import sys
    import textwrap

    runs = [tmp_path / name for name in ("a", "b")]
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from sgraf.training.config import preset
        from sgraf.training.pool import TrainJob, fit_all
        jobs = [TrainJob(name=name, config=preset("tiny").replace(epochs=500, checkpoint_every=0, progress=False),
                         data=Path({str(toy_data)!r}), run=Path({str(tmp_path)!r}) / name, preset="tiny")
                for name in ("a", "b")]
        fit_all(jobs, workers=2, threads=1)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not all((run / "config.yaml").exists() for run in runs) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        workers = [pid for pid in children(parent.pid) if "spawn" in open(f"/proc/{pid}/cmdline").read()]
        assert len([pid for pid in workers if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]) >= 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in workers if alive(pid)]
    finally:
        for pid in children(parent.pid) + [pid for pid in locals().get("workers", []) if alive(pid)]:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"
    assert all((run / "last.pt").is_file() for run in runs)


def test_a_sigint_ignored_by_whoever_started_the_process_stays_ignored_while_it_trains():
    """A script's background job starts with SIGINT ignored: the training loop had taken it over at
    its first step (ignored before, obeyed after); SIGTERM is still the loop's."""
    from sgraf.training.state import StopSignals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as signals:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == signals._handle
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with StopSignals() as signals:
            assert signal.getsignal(signal.SIGINT) == signals._handle     # a terminal's Ctrl-C: the loop's
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_forked_worker_leaves_a_signal_to_its_run(monkeypatch, caplog):
    """DataLoader workers inherit the run's handler: a Ctrl-C to the process group had said
    'received SIGINT' once per worker too."""
    import os

    from sgraf.training.state import StopSignals

    with StopSignals() as signals:
        pid = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda: pid + 1)          # as in a forked worker
        with caplog.at_level("WARNING"):
            signals._handle(signal.SIGTERM, None)
        assert signals.received is None and "received" not in caplog.text
        monkeypatch.setattr(os, "getpid", lambda: pid)
        with caplog.at_level("WARNING"):
            signals._handle(signal.SIGTERM, None)
        assert signals.received == signal.SIGTERM and caplog.text.count("received SIGTERM") == 1


def test_a_signal_cuts_a_validations_arithmetic_short_but_under_torchrun_waits_for_it(caplog):
    from sgraf.training.state import StopSignals, ValidationCut

    with StopSignals() as signals, caplog.at_level("WARNING"):
        with signals.during("validation"), pytest.raises(ValidationCut):
            with signals.cut_short():
                signals._handle(signal.SIGTERM, None)
        assert signals.phase == "step" and signals.received == signal.SIGTERM
        with pytest.raises(ValidationCut), signals.cut_short():     # one received before: at once
            raise AssertionError("not reached")
        signals._handle(signal.SIGTERM, None)                        # outside: a flag, as between steps
    assert caplog.text.count("received SIGTERM: the validation stops here and runs again first on --resume; "
                             "saving a checkpoint") == 1
    caplog.clear()
    with StopSignals(cuttable=False) as signals, caplog.at_level("WARNING"):   # torchrun's processes
        with signals.during("validation"), signals.cut_short():
            signals._handle(signal.SIGTERM, None)
        assert signals.received == signal.SIGTERM
    assert "received SIGTERM: stopping after this validation and saving a checkpoint (under torchrun a " \
           "validation runs to its end: it decides best.pt; last.pt was written before it)" in caplog.text
