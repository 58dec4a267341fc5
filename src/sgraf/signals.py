"""A command stopped by a signal: unwind (temporary files removed), exit 128 + the signal number.

Python's default SIGTERM kills the process where it stands, so the `finally` blocks that remove
temporary files and staging folders never run. `stop_on_sigterm()` turns SIGTERM into the
exception `Stopped`, as Python already turns SIGINT into `KeyboardInterrupt`; the command line
reports either in one line and exits with 143 or 130. Code that catches a signal itself to stop
cleanly (the training loop saves `last.pt`) raises `Stopped` once it has done so, when its caller
has more stages to run (`sgraf demo`).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from typing import Any, Iterator


class Stopped(BaseException):
    """A signal stopped the command (a BaseException, like KeyboardInterrupt: not an error to catch).

    Attributes:
        signum: the signal number.
        detail: where it stopped and what was kept, for the one-line message.
    """

    def __init__(self, signum: int, detail: str = "") -> None:
        self.signum = int(signum)
        self.detail = detail
        super().__init__(f"stopped by {self.name}" + (f" {detail}" if detail else ""))

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def ours_to_handle(signum: int) -> bool:
    """Whether sgraf may put its own handler on `signum`: not on a SIGINT ignored by whoever started
    the process (a script's `cmd &`, a training pool's worker), which stays ignored."""
    return not (signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN)


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises `Stopped` inside the block (main thread only; the previous handler is restored).

    A signal's exception raised while Python runs a finaliser (an object's `__del__`, a weakref
    callback: the garbage collector runs them between any two lines) cannot leave it: Python
    prints "Exception ignored in ..." and goes on, and the command would run to its end. Inside
    the block such a swallowed `Stopped` or `KeyboardInterrupt` is delivered again, as its
    signal sent again to the main thread, whose handler runs once the finaliser has returned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    previous_hook = sys.unraisablehook

    def deliver_again(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, (Stopped, KeyboardInterrupt)):
            signum = error.signum if isinstance(error, Stopped) else signal.SIGINT
            # sent from a new thread (started without waiting for it): the main thread's handler
            # then runs at a line outside the finaliser (or again here, and it is sent again)
            if hasattr(signal, "pthread_kill"):
                _thread.start_new_thread(signal.pthread_kill, (threading.main_thread().ident, signum))
            else:                  # Windows: the signal simulated in the main thread
                _thread.start_new_thread(_thread.interrupt_main, (signum,))
        else:
            previous_hook(unraisable)

    sys.unraisablehook = deliver_again
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block ends (a few renames that must not stop halfway).

    A signal received inside is delivered again, to the handler that was in place, on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    numbers = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in numbers}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)
