"""What a run needs to continue exactly where it stopped, and the signals that stop it.

`last.pt` is a normal sgraf checkpoint (`sgraf.load_model` reads it); its `extra["train_state"]`
holds the rest of the run: optimiser (Adam moments), gradient scaler, epoch, step within the
epoch, global step, best rsum, the running training loss and every random number generator.
All of it is tensors and plain values, so `torch.load(weights_only=True)` reads it.

The order of the training captions is a pure function of (seed, epoch) (`EpochBatchSampler`),
so the sampler's state is just the position within the epoch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sgraf.signals import ours_to_handle

logger = logging.getLogger(__name__)

STATE_KEY = "train_state"
STATE_VERSION = 1


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint and restored on resume.

    Attributes:
        epoch: the epoch in progress (0-based); equals the number of finished epochs.
        epoch_step: optimisation steps already taken in this epoch.
        global_step: optimisation steps taken since the start of the run.
        best_rsum: best validation rsum so far (-inf before the first validation).
        best_step: global step of that validation (-1 before the first one).
        best_epoch: the epoch (1-based) that validation fell in (0 before the first one).
        loss_sum: sum of the per-step training losses since the last validation.
        loss_steps: number of steps in `loss_sum`.
        last_val_step: global step of the last validation recorded in metrics.jsonl (-1: none).
        finished: the run completed all its epochs.
        pending_validation: a validation not yet recorded when `last.pt` was written (before it
            started, or when a stop signal cut it short: `ValidationCut`), run first on resume:
            "epoch" (the end of epoch `epoch`), "step" (`val_every`'s, at `global_step`), or ""
            (none).
    """

    epoch: int = 0
    epoch_step: int = 0
    global_step: int = 0
    best_rsum: float = float("-inf")
    best_step: int = -1
    best_epoch: int = 0
    loss_sum: float = 0.0
    loss_steps: int = 0
    last_val_step: int = -1
    finished: bool = False
    pending_validation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "epoch_step": self.epoch_step, "global_step": self.global_step,
                "best_rsum": self.best_rsum, "best_step": self.best_step, "best_epoch": self.best_epoch,
                "loss_sum": self.loss_sum,
                "loss_steps": self.loss_steps, "last_val_step": self.last_val_step,
                "finished": self.finished, "pending_validation": self.pending_validation}

    def describe_best(self) -> str:
        """The best validation so far in words, for logs ("no validation yet" before the first)."""
        if self.best_step < 0:
            return "no validation yet"
        return f"best rsum {self.best_rsum:.2f} at step {self.best_step}"

    def epochs_without_better(self) -> int:
        """Epochs ended since the one that gave the best dev rsum (0 before any validation)."""
        return self.epoch - self.best_epoch if self.best_step >= 0 else 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Progress":
        if "best_epoch" not in values:   # a last.pt from before best_epoch: patience counts from here
            values = {**values, "best_epoch": values["epoch"]}
        values = {"pending_validation": "", **values}      # a last.pt from before validations were cut short
        return cls(**{k: values[k] for k in cls().to_dict()})


def capture_rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from (dropout uses torch's global one)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": [list(v) if isinstance(v, tuple) else v for v in random.getstate()],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back `capture_rng_state`'s generators. The CUDA ones go to the devices this process sees
    (a run saved where 8 GPUs were visible, resumed where 1 is: that one's; restoring all 8 had
    failed the resume with an IndexError); on a machine without CUDA they are left out."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        for index, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def build_train_state(progress: Progress, optimizer: torch.optim.Optimizer,
                      scaler: Any | None) -> dict[str, Any]:
    """The training state stored in `last.pt`'s `extra` (tensors and plain values only)."""
    return {
        "version": STATE_VERSION,
        "progress": progress.to_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": capture_rng_state(),
        "lr": [group["lr"] for group in optimizer.param_groups],
    }


def restore_train_state(state: dict[str, Any], optimizer: torch.optim.Optimizer,
                        scaler: Any | None) -> Progress:
    """Loads optimiser, scaler and RNG states; returns the saved progress."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"training state version {state.get('version')!r} is not supported "
                         f"(expected {STATE_VERSION})")
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    restore_rng_state(state["rng"])
    return Progress.from_dict(state["progress"])


class ValidationCut(BaseException):
    """A stop signal received inside `StopSignals.cut_short`: the validation's arithmetic stops
    where it is, before it has written anything. A BaseException, as KeyboardInterrupt is, so
    that no `except Exception` on its way (a fallback to another kernel route) takes it for a
    failure and goes on."""


class StopSignals:
    """Turns SIGTERM and SIGINT into a flag the loop checks between steps.

    The loop finishes the step in progress, writes `last.pt` and returns; a second SIGINT
    raises `KeyboardInterrupt` at once. A validation is cut short instead (`cut_short`), where
    `cuttable`: minutes on a paper-size dev split on a CPU, more than a scheduler's grace period
    after SIGTERM. Not under torchrun, whose processes would stop at different scoring blocks
    while the others wait in a gather for them (a kill that comes before the validation ends loses
    it alone: the loop writes `last.pt` before each validation). Handlers are installed only from the main
    thread and the previous ones are restored on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, cuttable: bool = True) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self.phase = "step"         # what a signal waits for (`during`): the message says it
        self.cuttable = cuttable
        self._cutting = False       # inside `cut_short`: a signal raises ValidationCut

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Within, a signal's message says it waits for `phase` ("validation": minutes on a paper-size
        dev split, which "after this step" had not told)."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    @contextlib.contextmanager
    def cut_short(self) -> Iterator[None]:
        """Within (a validation's arithmetic, which writes nothing), a stop signal raises
        `ValidationCut` where the main thread is, and one received before raises it at once;
        where not `cuttable`, nothing changes (the loop checks the flag after)."""
        if not self.cuttable:
            yield
            return
        if self.received is not None:
            raise ValidationCut()
        self._cutting = True
        try:
            yield
        finally:
            self._cutting = False

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for signum in filter(ours_to_handle, self.SIGNALS):   # an ignored SIGINT had been obeyed from step 1
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != getattr(self, "_pid", os.getpid()):
            return      # a forked DataLoader worker: its run stops it (each had said "received SIGINT" again)
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = self.received is None
        self.received = signum
        if first and self._cutting:
            self._cutting = False            # raised once: the loop's `finally` blocks run undisturbed
            logger.warning("received %s: the %s stops here and runs again first on --resume; saving a checkpoint",
                           signal.Signals(signum).name, self.phase)
            raise ValidationCut()
        if first:
            logger.warning("received %s: stopping after this %s and saving a checkpoint%s",
                           signal.Signals(signum).name, self.phase,
                           " (under torchrun a validation runs to its end: it decides best.pt; last.pt "
                           "was written before it)"
                           if self.phase == "validation" else "")
