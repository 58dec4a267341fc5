"""Several training runs at once: independent `fit`s in worker processes.

A small model (the demo's: embed 64, batch 32) keeps one CPU core busy and gains little from a
second thread (a step takes 0.93x the time on two threads as on one), so on a CPU with several
cores `sgraf demo` trains its models side by side, each on its share of the cores, instead of
one after the other on all of them. On a GPU they train one at a time.

`fit_all` runs a list of `TrainJob`s in `workers` processes, the longest expected first (started
with `spawn`: a forked PyTorch may hang in its thread pool). With one worker it calls `fit` in
this process, in the given order, progress bars included. Either way it returns each job's `fit` summary
with its wall and CPU time, and a signal stops every run the same way one run stops: each
running `fit` finishes its step, writes its `last.pt` and returns; `fit_all` then raises
`Stopped` naming them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from sgraf.devices import available_cores
from sgraf.signals import Stopped, ours_to_handle

logger = logging.getLogger(__name__)

# How often the parent repeats a stop to its workers while it waits for them: a worker that was
# between two jobs when the signal came ignores it, and meets the next repeat inside `fit`.
_REPEAT_S = 0.5
_PARENT_POLL_S = 1.0      # how often a worker looks whether the process that started it is still there
_ORPHAN_GRACE_S = 120.0   # how long an orphaned worker's job has to save its last.pt and stop


@dataclass(frozen=True)
class TrainJob:
    """One `fit` to run.

    Attributes:
        name: how messages name it (the demo's label).
        config: its resolved `TrainConfig`.
        data: the precomp data folder.
        run: its run folder.
        preset: the preset name recorded in its config.yaml.
        cost: its expected time relative to the others' (only the order depends on it: longest first).
        resume: continue the run in `run` from its last.pt (`fit(resume=True)`: a finished run
            trains nothing).
    """

    name: str
    config: Any
    data: Path
    run: Path
    preset: str | None = None
    cost: float = 1.0
    resume: bool = False


@dataclass(frozen=True)
class JobResult:
    """A finished job: `fit`'s summary, and the job's wall-clock and CPU seconds (its own process's)."""

    summary: dict[str, Any]
    wall_s: float
    cpu_s: float


def plan_workers(n_jobs: int, jobs: int | None = None, on_gpu: bool = False,
                 cores: int | None = None) -> tuple[int, int]:
    """(workers, threads per worker) for `n_jobs` trainings.

    Args:
        n_jobs: trainings to run.
        jobs: trainings at once asked for (None: as many as the cores allow on a CPU, one on a GPU).
        on_gpu: the trainings run on a GPU.
        cores: CPU cores to share (default `available_cores()`).
    """
    cores = available_cores() if cores is None else cores
    if jobs is None:
        jobs = 1 if on_gpu else cores
    workers = max(1, min(jobs, n_jobs))
    return workers, max(1, cores // workers)


def fit_all(jobs: Sequence[TrainJob], workers: int = 1, threads: int | None = None,
            on_done: Callable[[TrainJob, JobResult], None] | None = None) -> dict[str, JobResult]:
    """Runs every job's `fit`, `workers` at a time; returns {name: JobResult}.

    Args:
        jobs: the trainings (names unique).
        workers: processes training at once; 1 trains in this process, one job after the other
            in the order given.
        threads: PyTorch threads of each worker process (None: PyTorch's default).
        on_done: called in this process as each job finishes.

    Raises:
        Stopped: SIGTERM or SIGINT stopped the runs (each running one wrote its `last.pt`; jobs
            not started were not). The detail names the stopped runs and their folders.
        The first error of a job (`InputError`, `NonFiniteLossError`, ...), after the other
        running jobs were stopped the same way.
    """
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got {names}")
    if workers <= 1:
        return _fit_here(jobs, on_done)
    return _fit_in_workers(sorted(jobs, key=lambda job: -job.cost), workers, threads, on_done)


def _fit_here(jobs: Sequence[TrainJob], on_done: Callable[[TrainJob, JobResult], None] | None
              ) -> dict[str, JobResult]:
    results: dict[str, JobResult] = {}
    for job in jobs:
        result = _run_job(job)
        if result.summary["status"] == "interrupted":
            raise Stopped(signal.Signals[result.summary["signal"]], _stopped_detail([job]))
        results[job.name] = result
        if on_done is not None:
            on_done(job, result)
    return results


def _stopped_detail(jobs: Sequence[TrainJob]) -> str:
    if len(jobs) == 1:
        return f"while training {jobs[0].name}: its last.pt is saved in {jobs[0].run}"
    return (f"while training {', '.join(job.name for job in jobs)}: their last.pt files are saved in "
            f"{', '.join(str(job.run) for job in jobs)}")


def _fit_in_workers(jobs: Sequence[TrainJob], workers: int, threads: int | None,
                    on_done: Callable[[TrainJob, JobResult], None] | None) -> dict[str, JobResult]:
    """The jobs in `workers` spawned processes; this process waits, and passes a stop on to them."""
    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}

    def handle(signum: int, frame: Any) -> None:
        if received and received[0] == signal.SIGINT == signum:
            raise KeyboardInterrupt   # a second Ctrl-C: stop waiting (the workers are killed below)
        received.append(signum)

    if main:
        previous = {signum: signal.signal(signum, handle)
                    for signum in filter(ours_to_handle, (signal.SIGTERM, signal.SIGINT))}
    context = multiprocessing.get_context("spawn")
    stop = context.Event()   # set: a worker starts no further job (one may already be queued to it)
    started = context.SimpleQueue()   # each worker's pid, put there as it starts
    workers_here: set[int] = set()
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_worker_start,
        initargs=(threads, logging.getLogger().getEffectiveLevel(), stop, started))
    results: dict[str, JobResult] = {}
    failure: BaseException | None = None
    clean = False
    try:
        pending = {executor.submit(_run_job, job): job for job in jobs}
        logger.info("training %s: %d at a time%s", ", ".join(job.name for job in jobs), workers,
                    f", {threads} thread{'' if threads == 1 else 's'} each" if threads else "")
        while pending:
            done, _ = concurrent.futures.wait(pending, timeout=_REPEAT_S,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                if future.cancelled():
                    continue
                error = future.exception()
                if error is not None:
                    failure = failure or error
                    continue
                result = future.result()
                if result.summary["status"] == "not started":
                    continue
                results[job.name] = result
                if result.summary["status"] == "finished" and on_done is not None:
                    on_done(job, result)
            if (received or failure is not None) and pending:
                if not stop.is_set():
                    stop.set()
                    for future in pending:
                        future.cancel()      # not yet queued to a worker: never starts
                _stop_workers(_pids(started, workers_here))
        clean = True
    finally:
        executor.shutdown(wait=clean, cancel_futures=True)
        if not clean:   # a second Ctrl-C or an error here: the workers must not train on alone
            stop.set()   # one not yet announced starts no job
            _stop_workers(_pids(started, workers_here), getattr(signal, "SIGKILL", signal.SIGTERM))   # Windows
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failure is not None:
        raise failure
    stopped = [job for job in jobs if job.name in results and results[job.name].summary["status"] == "interrupted"]
    if received or stopped:
        signum = received[0] if received else signal.Signals[stopped[0].summary["signal"]]
        raise Stopped(signum, _stopped_detail(stopped) if stopped else "before any training started")
    return results


def _pids(started: Any, known: set[int]) -> set[int]:
    """The pids of this pool's workers: `known`, with those that announced themselves since."""
    while not started.empty():
        known.add(started.get())
    return known


def _stop_workers(pids: set[int], signum: int = signal.SIGTERM) -> None:
    """SIGTERM to each of the pool's workers (its own: other children of this process are left
    alone): `fit` stops after its step (SIGTERM, not SIGINT, so that a worker that also got the
    terminal's Ctrl-C does not take this for a second one). A worker already gone is skipped."""
    for pid in pids:
        if _is_child(pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _is_child(pid: int) -> bool:
    """Whether `pid` is still a live child of this process (not a reused pid of another process)."""
    return any(process.pid == pid for process in multiprocessing.active_children())


class _JobName(logging.Filter):
    """Prefixes each message of a worker with the name of the job it is running."""

    name_now = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if _JobName.name_now:
            record.msg = f"[{_JobName.name_now}] {record.msg}"
        return True


_STOP: Any = None   # in a worker: the parent's stop event


def _worker_start(threads: int | None, level: int, stop: Any, started: Any = None) -> None:
    """A worker's set-up: signals ignored between jobs (`fit` handles them during one), its threads,
    logging, the stop event; its pid announced on `started`."""
    import sys

    global _STOP
    _STOP = stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        import torch

        torch.set_num_threads(threads)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_JobName())
    if started is not None:
        started.put(os.getpid())
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), name="sgraf-parent-watch", daemon=True).start()


def _end_with_parent(parent: int, poll_s: float | None = None, grace_s: float | None = None) -> None:
    """A worker's end once the process that started it is gone (killed by SIGKILL or the kernel's
    out-of-memory killer, which leave it no time to stop its workers): a job running stops as on
    SIGTERM (`fit` saves its last.pt after the step), then the worker exits. An orphaned worker had
    trained on, holding its run's lock, and then waited for work without end."""
    poll_s = _PARENT_POLL_S if poll_s is None else poll_s
    grace_s = _ORPHAN_GRACE_S if grace_s is None else grace_s
    while os.getppid() == parent:
        time.sleep(poll_s)
    if _STOP is not None:
        _STOP.set()               # no further job in this worker
    deadline = time.monotonic() + grace_s
    while _JobName.name_now and time.monotonic() < deadline:
        # again each time: a job that has not yet set `fit`'s handlers ignores it (as the parent repeats its stops)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(poll_s)
    os._exit(1)


def _run_job(job: TrainJob) -> JobResult:
    from sgraf.training.loop import fit

    if _STOP is not None and _STOP.is_set():
        return JobResult(summary={"status": "not started"}, wall_s=0.0, cpu_s=0.0)
    _JobName.name_now = job.name
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        summary = fit(job.config, job.data, job.run, preset=job.preset, resume=job.resume)
    finally:
        _JobName.name_now = ""
    return JobResult(summary=summary, wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)


def without_progress(job: TrainJob) -> TrainJob:
    """The job with its progress bar off (bars of several processes at once garble a terminal)."""
    return replace(job, config=replace(job.config, progress=False))
