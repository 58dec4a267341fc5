"""The threads that run the server's model calls; text searches waiting together run as one batch.

The event loop never scores: a route puts a job on a bounded queue and awaits its future. A
worker thread (one by default) takes the job at the head of the queue and, with it, the text
searches waiting behind it (up to `max_batch`, those with the same shortlist): they are encoded
in one pass and share one first-stage pass over the gallery's keys
(`SearchService.search_texts`), each computed as it would be alone. Other jobs (image searches,
explanations) run one at a time.

Each client (its address, `client`) waits in a line of its own, and the lines take turns
(`_FairQueue`): a client that queued many requests delays another's next one by one of its own,
not by all of them.

What a request may cost is bounded here and in `SearchService`:
- A full queue refuses new jobs at once (`Busy`, which the HTTP layer answers with 503 and
  `Retry-After`) instead of letting waiting requests pile up.
- One client holds at most `max_per_client` places; more of its jobs are refused at once
  (`ClientBusy`, answered 429 with `Retry-After`), so that one client cannot fill the queue and turn
  every other client away.
- Jobs are light (searches) or heavy (explanations, which draw a picture). When both wait, the
  threads alternate between them, so a search waits behind at most one explanation per thread
  however many are queued. Heavy jobs hold at most `max_heavy` places (half the queue), so
  clients looping explanations cannot take every place and turn each search away (66 such
  clients had answered 64 of 66 searches 503 for as long as they ran).
- A job whose future is cancelled (its client went away) leaves the queue at once and is never
  run (`dropped` counts them).
- `close()` (shutdown) refuses new jobs and every job still queued (`ShuttingDown`); the jobs
  in hand finish, or are answered `ShuttingDown` by `abandon()` when the grace period ends.

The models' weight-only constants are prepared once for the worker's life (`frozen_weights`):
weights never change while serving.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

__all__ = ["Busy", "ClientBusy", "ShuttingDown", "Worker"]


class Busy(RuntimeError):
    """The queue is full: the request is refused now rather than queued without limit.

    Attributes:
        retry_after: seconds after which a retry is likely to be taken (for `Retry-After`).
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(Busy):
    """The server is stopping: the request was not run (and will not be)."""


class ClientBusy(Busy):
    """The client that asked has `max_per_client` requests waiting already (HTTP 429)."""


@dataclass(eq=False)
class _TextJob:
    text: str
    top_k: int
    shortlist: int | None
    client: Any = None
    future: Future = field(default_factory=Future)
    heavy = False


@dataclass(eq=False)
class _CallJob:
    call: Callable[[], Any]
    heavy: bool = False
    client: Any = None
    future: Future = field(default_factory=Future)


class _FairQueue:
    """Waiting jobs, a line per client (`job.client`), the lines taking turns: each client's jobs
    in arrival order, and after a client's job is taken its line goes behind the others (a new
    client's line starts behind them too). With one client (or all None) it is a FIFO queue."""

    def __init__(self) -> None:
        self._lines: collections.OrderedDict[Any, collections.deque] = collections.OrderedDict()
        self._count = 0

    def __len__(self) -> int:     # also its truth: empty or not
        return self._count

    def __iter__(self) -> Iterator[Any]:
        """The jobs in the order they would be taken: the first of each line, then the second, ..."""
        lines = [list(line) for line in self._lines.values()]
        for depth in range(max(map(len, lines), default=0)):
            for line in lines:
                if depth < len(line):
                    yield line[depth]

    def waiting(self, client: Any) -> int:
        """The jobs of `client` in this queue."""
        line = self._lines.get(client)
        return 0 if line is None else len(line)

    def append(self, job: Any) -> None:
        line = self._lines.get(job.client)
        if line is None:
            line = self._lines[job.client] = collections.deque()
        line.append(job)
        self._count += 1

    def popleft(self) -> Any:
        """The first job of the line whose turn it is (IndexError when empty)."""
        if not self._lines:
            raise IndexError("pop from an empty queue")
        return self.take(next(iter(self._lines.values()))[0])

    def take(self, job: Any) -> Any:
        """Remove `job` to run it: its client's line goes behind the others."""
        self.remove(job)
        if job.client in self._lines:
            self._lines.move_to_end(job.client)
        return job

    def remove(self, job: Any) -> None:
        """Remove `job` where it waits (ValueError if it does not)."""
        line = self._lines.get(job.client)
        if line is None:
            raise ValueError("the job is not waiting")
        line.remove(job)
        self._count -= 1
        if not line:
            del self._lines[job.client]

    def clear(self) -> list[Any]:
        """Remove every job; returns them in the order they would have been taken."""
        jobs = list(self)
        self._lines.clear()
        self._count = 0
        return jobs


class Worker:
    """The server's compute threads.

    Args:
        service: a `SearchService` (its `search_texts` answers batches of text searches).
        max_queue: jobs waiting at most; more are refused with `Busy`. Heavy jobs (explanations)
            wait in at most `max_heavy` = half of them (at least one), leaving the rest to searches
            (with `max_queue=1` the one place is either's).
        max_batch: text searches scored together at most (1: one at a time).
        threads: compute threads taking jobs from the queue (several: jobs run side by side,
            e.g. one per core with one torch thread each).
        max_per_client: jobs one client (a job's `client`, not None) may have waiting at most; more
            are refused with `ClientBusy`. None: `max_queue` (no limit of its own).
    """

    def __init__(self, service: Any, max_queue: int = 64, max_batch: int = 16, threads: int = 1,
                 max_per_client: int | None = None) -> None:
        if max_per_client is None:
            max_per_client = max_queue
        if max_queue < 1 or max_batch < 1 or threads < 1 or max_per_client < 1:
            raise ValueError(f"max_queue, max_batch, threads and max_per_client must be positive, got {max_queue}, "
                             f"{max_batch}, {threads} and {max_per_client}")
        self.service = service
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_heavy = max(1, max_queue // 2)
        self.max_per_client = min(max_per_client, max_queue)
        self.n_threads = threads
        self._light = _FairQueue()     # searches, a line per client
        self._heavy = _FairQueue()     # explanations, a line per client
        self._heavy_next = False          # alternate: after a light round, a heavy job if one waits
        self._changed = threading.Condition()
        self._closed = False
        self._running: set[Any] = set()      # jobs the threads are computing now
        self._threads: list[threading.Thread] = []
        self._threads_started: list[threading.Thread] = []
        self.batches = 0          # batches of text searches run, and the searches in them
        self.batched_texts = 0
        self.dropped = 0          # jobs cancelled (their client went away) before they ran
        self.refused = 0          # jobs refused because the server was shutting down (queued or new)
        self.busy = 0             # jobs refused because `max_queue` jobs were waiting
        self.client_busy = 0      # jobs refused because their client had `max_per_client` waiting

    # ----------------------------------------------------------------------------- life
    def start(self) -> "Worker":
        with self._changed:
            if self._closed:
                raise RuntimeError("the worker was stopped; make a new one")
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"sgraf-serve-worker-{i}", daemon=True)
                                 for i in range(self.n_threads)]
                for thread in self._threads:
                    thread.start()
                self._threads_started = list(self._threads)
        return self

    def close(self, reason: str = "the server is shutting down") -> int:
        """Refuse new jobs and every job still waiting (their futures get `ShuttingDown`); the
        jobs being run finish. Returns how many waiting jobs were refused."""
        with self._changed:
            self._closed = True
            waiting = [*self._light.clear(), *self._heavy.clear()]
            self._changed.notify_all()
        refused = 0
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(ShuttingDown(f"{reason}: this request was not run; retry on the "
                                                      "restarted server"))
                refused += 1
        with self._changed:
            self.refused += refused
        if refused:
            logger.warning("shutting down: %d waiting request(s) refused", refused)
        return refused

    def abandon(self, reason: str = "the server is shutting down") -> int:
        """Answer the jobs still being computed with `ShuttingDown` now (at the end of a shutdown's
        grace period); their threads finish the work, and the result is dropped. Returns how many."""
        with self._changed:
            running = list(self._running)
        abandoned = 0
        for job in running:
            try:
                job.future.set_exception(ShuttingDown(f"{reason}: this request did not finish in time"))
                abandoned += 1
            except InvalidStateError:     # it finished meanwhile
                pass
        return abandoned

    def stop(self, timeout: float = 10.0) -> None:
        """`close()`, then wait (at most `timeout` seconds) for the jobs in hand to end."""
        self.close()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []

    def __enter__(self) -> "Worker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- submitting
    def _put(self, job: Any) -> Future:
        with self._changed:
            if self._closed:
                self.refused += 1
                raise ShuttingDown("the server is shutting down: this request was not run; retry on the "
                                   "restarted server")
            if not self._threads:
                raise RuntimeError("the worker is not running")
            if len(self._light) + len(self._heavy) >= self.max_queue:
                self.busy += 1
                waiting = f"{self.max_queue} requests are" if self.max_queue != 1 else "1 request is"
                raise Busy(f"the server is busy: {waiting} waiting; retry shortly")
            if job.heavy and len(self._heavy) >= self.max_heavy:
                self.busy += 1
                waiting = f"{self.max_heavy} explanations are" if self.max_heavy != 1 else "1 explanation is"
                raise Busy(f"the server is busy: {waiting} waiting; retry shortly")
            if (job.client is not None
                    and self._light.waiting(job.client) + self._heavy.waiting(job.client) >= self.max_per_client):
                self.client_busy += 1
                waiting = f"{self.max_per_client} requests" if self.max_per_client != 1 else "1 request"
                raise ClientBusy(f"too many requests: this client has {waiting} waiting (the limit per client); "
                                 "retry once they are answered")
            (self._heavy if job.heavy else self._light).append(job)
            self._changed.notify()
        job.future.add_done_callback(lambda future: future.cancelled() and self._forget(job))
        return job.future

    def _forget(self, job: Any) -> None:
        """A cancelled job leaves the queue now (its place is free for another request)."""
        with self._changed:
            for jobs in (self._light, self._heavy):
                try:
                    jobs.remove(job)
                except ValueError:
                    continue
                self.dropped += 1
                return

    def search_text(self, text: str, top_k: int, shortlist: int | None, client: Any = None) -> Future:
        """Queue a checked text search for `client` (its address; None: unknown, not limited per
        client); the future's result is its list of result dicts."""
        return self._put(_TextJob(text, top_k, shortlist, client))

    def call(self, function: Callable[..., Any], *args: Any, heavy: bool = False, client: Any = None,
             **kwargs: Any) -> Future:
        """Queue any other model call for `client` (an image search; `heavy=True` for an
        explanation); the future gets its result."""
        return self._put(_CallJob(lambda: function(*args, **kwargs), heavy, client))

    @property
    def computing(self) -> bool:
        """Whether a thread is still inside a job (after `stop`, one that outlived its timeout)."""
        with self._changed:
            return bool(self._running) and any(thread.is_alive() for thread in self._threads_started)

    @property
    def waiting(self) -> int:
        """Jobs queued and not yet taken by a thread (cancelled ones are not counted)."""
        with self._changed:
            return len(self._light) + len(self._heavy)

    # ----------------------------------------------------------------------------- the thread
    def _next(self) -> list[Any] | None:
        """The next job(s) to run (a batch of text searches, or one other job); None: stop."""
        with self._changed:
            while not self._light and not self._heavy:
                if self._closed:
                    return None
                self._changed.wait()
            if self._heavy and (self._heavy_next or not self._light):
                self._heavy_next = False
                job = self._heavy.popleft()
                self._running.add(job)
                return [job]
            self._heavy_next = True
            first = self._light.popleft()
            if not isinstance(first, _TextJob):
                self._running.add(first)
                return [first]
            batch = [first]
            for job in list(self._light):     # the text searches waiting behind it in turn, same shortlist
                if len(batch) >= self.max_batch:
                    break
                if isinstance(job, _TextJob) and job.shortlist == first.shortlist:
                    batch.append(self._light.take(job))
            self._running.update(batch)
            return batch

    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            for model in self.service.matcher.models:
                if hasattr(model, "frozen_weights"):
                    stack.enter_context(model.frozen_weights())
            while True:
                jobs = self._next()
                if jobs is None:
                    return
                try:
                    if isinstance(jobs[0], _CallJob):
                        _settle(jobs[0].future, jobs[0].call)
                    else:
                        self._run_batch(jobs)
                finally:
                    with self._changed:
                        self._running.difference_update(jobs)

    def _run_batch(self, batch: list[_TextJob]) -> None:
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        top_k = max(job.top_k for job in live)
        try:
            results = self.service.search_texts([job.text for job in live], top_k, live[0].shortlist)
        except BaseException as exc:  # noqa: BLE001  (every waiting request gets the error)
            for job in live:
                _answer(job.future, exception=exc)
            if not isinstance(exc, Exception):
                raise
            return
        with self._changed:
            self.batches += 1
            self.batched_texts += len(live)
        for job, hits in zip(live, results):
            _answer(job.future, hits[:job.top_k])


def _settle(future: Future, call: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001  (the request that asked gets it)
        _answer(future, exception=exc)
    else:
        _answer(future, result)


def _answer(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Settle a running job's future, unless shutdown already answered it (`Worker.abandon`)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
