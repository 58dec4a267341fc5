"""Where a command's wall time goes: seconds per stage, each stage ended when its device work is.

`sgraf evaluate --timings` reports them (issue 20: on a GPU most of a Flickr30K-size evaluation
was found to be host work, and only a breakdown tells which). A stage's time runs from its start
until the device has finished the work the stage queued (`torch.cuda.synchronize` on CUDA), so
asynchronous kernels are charged to the stage that launched them, not to the next one that
waits for them. The stages of a command run one after the other anyway, so the synchronisation
costs nothing measurable; a stage entered twice (one per model of an ensemble) adds up.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, to 1/100 s), None where unknown.

    At a command's entry this is the interpreter's start and the imports before it."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            stat = handle.read()
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        # field 22, starttime in clock ticks after boot; the command name (field 2) may hold spaces
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Stopwatch:
    """Wall seconds of named stages, in the order first entered, from the stopwatch's creation.

    Args:
        device: whose queued work ends a stage (a CUDA device is synchronised; others need not be).
        startup: seconds that passed before the stopwatch was made (`process_age()` at a
            command's entry), reported as the first stage.
    """

    def __init__(self, device: Any = None, startup: float | None = None) -> None:
        self.device = None if device is None else str(device)
        self.startup = startup
        self.seconds: dict[str, float] = {}
        self._created = time.perf_counter()
        self._running: str | None = None

    def use(self, device: Any) -> None:
        """Synchronise `device` (a `torch.device` or its name) at the end of later stages: a
        command knows it only once it has resolved its --device."""
        self.device = str(device)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name` (added to its earlier time when entered again).
        Stages do not nest: each second belongs to one stage (or to 'other')."""
        if self._running is not None:
            raise RuntimeError(f"stage {name!r} started inside stage {self._running!r}")
        self._running, start = name, time.perf_counter()
        try:
            yield
        finally:
            self._wait_for_device()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self._running = None

    def _wait_for_device(self) -> None:
        # torch is not imported for this: a stopwatch times the imports too, and a process that
        # has not imported torch (or not started CUDA) has no device work to wait for
        torch = sys.modules.get("torch")
        if torch is not None and self.device is not None and self.device.startswith("cuda") \
                and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)

    def report(self) -> dict[str, float]:
        """Seconds (to the ms): 'startup' when known, every stage, 'other' (the time since the
        stopwatch's creation outside any stage) and 'total' (their sum: the wall time so far)."""
        elapsed = time.perf_counter() - self._created
        stages = ({} if self.startup is None else {"startup": self.startup}) | self.seconds
        stages["other"] = max(0.0, elapsed - sum(self.seconds.values()))
        stages["total"] = (self.startup or 0.0) + elapsed
        return {name: round(seconds, 3) for name, seconds in stages.items()}


def stage(stopwatch: Stopwatch | None, name: str) -> Any:
    """`stopwatch.stage(name)`, or a block that times nothing when there is no stopwatch."""
    return nullcontext() if stopwatch is None else stopwatch.stage(name)


def format_timings(timings: dict[str, float]) -> str:
    """One line: 'startup 2.41 s, checkpoint 0.62 s, ..., total 9.80 s'."""
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in timings.items())
