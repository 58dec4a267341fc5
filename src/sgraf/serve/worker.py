"""The threads that run the server's model calls; text searches waiting together run as one batch.

The event loop never scores: a route puts a job on a bounded queue and awaits its future. A
worker thread (one by default) takes the job at the head of the queue and, with it, the text searches waiting
behind it (up to `max_batch`, those with the same shortlist, so a result never depends on
what it was batched with): they are encoded in one pass and share one first-stage pass over
the gallery's keys (`SearchService.search_texts`). Other jobs (image searches, explanations)
run one at a time in arrival order. A full queue refuses new jobs at once (`Busy`, which the
HTTP layer answers with 503 and `Retry-After`) instead of letting waiting requests pile up.

The models' weight-only constants are prepared once for the worker's life (`frozen_weights`):
weights never change while serving.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["Busy", "Worker"]


class Busy(RuntimeError):
    """The queue is full: the request is refused now rather than queued without limit.

    Attributes:
        retry_after: seconds after which a retry is likely to be taken (for `Retry-After`).
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _TextJob:
    text: str
    top_k: int
    shortlist: int
    future: Future = field(default_factory=Future)


@dataclass
class _CallJob:
    call: Callable[[], Any]
    future: Future = field(default_factory=Future)


class Worker:
    """The server's compute threads.

    Args:
        service: a `SearchService` (its `search_texts` answers batches of text searches).
        max_queue: jobs waiting at most; more are refused with `Busy`.
        max_batch: text searches scored together at most (1: one at a time).
        threads: compute threads taking jobs from the queue (several: jobs run side by side,
            e.g. one per core with one torch thread each).
    """

    def __init__(self, service: Any, max_queue: int = 64, max_batch: int = 16, threads: int = 1) -> None:
        if max_queue < 1 or max_batch < 1 or threads < 1:
            raise ValueError(f"max_queue, max_batch and threads must be positive, got {max_queue}, {max_batch} "
                             f"and {threads}")
        self.service = service
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.n_threads = threads
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._threads: list[threading.Thread] = []
        self._count = threading.Lock()
        self.batches = 0          # batches of text searches run, and the searches in them
        self.batched_texts = 0

    # ----------------------------------------------------------------------------- life
    def start(self) -> "Worker":
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=f"sgraf-serve-worker-{i}", daemon=True)
                             for i in range(self.n_threads)]
            for thread in self._threads:
                thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the jobs already queued, then end the threads."""
        for _ in self._threads:
            self._jobs.put(None)    # blocks while the queue is full: the queued jobs go first
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- submitting
    def _put(self, job: Any) -> Future:
        if not self._threads:
            raise RuntimeError("the worker is not running")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Busy(f"the server is busy: {self.max_queue} requests are waiting; retry shortly") from None
        return job.future

    def search_text(self, text: str, top_k: int, shortlist: int) -> Future:
        """Queue a checked text search; the future's result is its list of result dicts."""
        return self._put(_TextJob(text, top_k, shortlist))

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue any other model call (image search, explanation); the future gets its result."""
        return self._put(_CallJob(lambda: function(*args, **kwargs)))

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    # ----------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            for model in self.service.matcher.models:
                if hasattr(model, "frozen_weights"):
                    stack.enter_context(model.frozen_weights())
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                if isinstance(job, _CallJob):
                    _settle(job.future, job.call)
                    continue
                batch = [job]
                held: list[Any] = []     # jobs taken out while gathering, run after the batch in order
                while len(batch) < self.max_batch:
                    try:
                        other = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(other, _TextJob) and other.shortlist == job.shortlist:
                        batch.append(other)
                    else:
                        held.append(other)
                        if other is None or len(held) >= self.max_batch:
                            break
                self._run_batch(batch)
                for other in held:
                    if other is None:        # this thread's stop signal
                        return
                    if isinstance(other, _CallJob):
                        _settle(other.future, other.call)
                    else:
                        self._run_batch([other])

    def _run_batch(self, batch: list[_TextJob]) -> None:
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        top_k = max(job.top_k for job in live)
        try:
            results = self.service.search_texts([job.text for job in live], top_k, live[0].shortlist)
        except BaseException as exc:  # noqa: BLE001  (every waiting request gets the error)
            for job in live:
                job.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        with self._count:
            self.batches += 1
            self.batched_texts += len(live)
        for job, hits in zip(live, results):
            job.future.set_result(hits[:job.top_k])


def _settle(future: Future, call: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(call())
    except Exception as exc:  # noqa: BLE001  (the request that asked gets it)
        future.set_exception(exc)
