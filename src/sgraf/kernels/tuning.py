"""Choices made by measuring this machine once, not by one machine's habits.

A choice (the float32 matmul route, the eval chunk size) is a list of candidates, the first
being the default, and a function that times one. `choose` times every candidate at first
use, keeps the fastest for the process and stores it, with the timings, in a small JSON file
under a key that names the processor, PyTorch's version and CPU code path, and the thread
count. Later runs on the same machine take the stored choice without probing, so they also
compute the same floats. `peek` returns a stored choice, or the default, without probing (for
small calls that should not pay for a probe).

The file: `$SGRAF_CACHE_DIR/tuning.json`, else `$XDG_CACHE_HOME/sgraf/tuning.json`, else
`~/.cache/sgraf/tuning.json`; delete it to measure again. `SGRAF_TUNE=off` turns every probe
off (every choice its default). A choice that cannot be stored (read-only home) is still made
once per process. A stored choice made by another rule than the caller's (`keep`, `near`,
`rounds` of `choose`) is measured again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sgraf.errors import InputError
from sgraf.user_cache import cache_dir, say_unwritable, switched_on

try:
    import fcntl
except ImportError:   # not POSIX: two processes measuring at once may each keep their own choice
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# A measured candidate replaces the default only when it is more than this much faster: on a
# 2-core AMD EPYC, probe differences of 5-15 % between thread modes or chunk sizes came out
# either way in whole `sgraf evaluate` runs (and a 4 MiB chunk 3 % "within noise" of 8 MiB in the
# probe was 4 % slower over a whole split), while the routes and sizes worth switching to differ
# by far more (oneDNN against MKL: 2.2x).
KEEP_DEFAULT = 0.2
# the earliest candidate within this fraction of the fastest wins when the default is beaten
NEAR_DEFAULT = 0.03

_lock = threading.RLock()
_chosen: dict[str, Any] = {}
# the keys `peek` found nothing stored for: not read again until `forget` (the scoring loop peeks
# at its routes and chunk size once per chunk, and a read of the store is a file's open and parse)
_absent: set[str] = set()
_generation = 0


@functools.cache
def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux), e.g. 'AMD EPYC 9R45'."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


def machine_key(device: torch.device | str = "cpu") -> str:
    """What a measured choice depends on: processor (or GPU), PyTorch version and code path, threads."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}"
    return f"{_cpu_key()}|{torch.get_num_threads()} threads"


@functools.cache
def _cpu_key() -> str:
    return f"{cpu_model()}|torch {torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"


def cache_path() -> pathlib.Path:
    """Where measured choices are stored (see the module docstring)."""
    return cache_dir() / "tuning.json"


def enabled() -> bool:
    """False when SGRAF_TUNE is off/0/false/no: every choice is then its default."""
    return switched_on("SGRAF_TUNE")


def peek(name: str, candidates: Sequence[Any], device: torch.device | str = "cpu", default: Any = None) -> Any:
    """The choice made or stored for `name` on this machine, else the default (`default`, or
    `candidates[0]`), without measuring. The store is read once per name and process (until
    `forget`): a choice another process stores later is not taken up midway."""
    key = f"{machine_key(device)}|{name}"
    if not enabled():           # the default, and nothing remembered (see `choose`)
        return candidates[0] if default is None else default
    with _lock:
        if key in _chosen:
            return _chosen[key]
        if key not in _absent:
            stored = _stored(key, candidates)
            if stored is not None:
                _chosen[key] = stored
                return stored
            _absent.add(key)
    return candidates[0] if default is None else default


def choose(name: str, candidates: Sequence[Any], measure: Callable[[Any], float],
           device: torch.device | str = "cpu", default: Any = None, keep: float = KEEP_DEFAULT,
           near: float = NEAR_DEFAULT, rounds: int = 1) -> Any:
    """The default (`default`, or `candidates[0]`) unless another candidate is clearly faster.

    `measure(candidate)` gives seconds (smaller is better). The default stays unless the fastest
    candidate beats it by more than `keep` (a fraction: a short probe's smaller differences did
    not survive into whole runs); then the earliest candidate in `candidates` within `near` of
    the fastest wins (list them in order of preference, e.g. the most frugal first). With
    `rounds` > 1 the candidates are measured in turns, every other round in reverse order, and
    each keeps its best time, so that a change of the machine's load while probing (other
    processes starting beside this one) reaches all of them. Measured once per machine (see the
    module docstring); the default when tuning is off. A choice stored under another `keep`,
    `near` or `rounds` is measured again. Candidates must be JSON values (strings, numbers).
    """
    key = f"{machine_key(device)}|{name}"
    rule = _rule(keep, near, rounds)
    if not enabled():
        # not remembered: a process that turns tuning on again (a test's monkeypatch, a caller's
        # while-block) computes with the stored choices, as every other process on the machine
        return candidates[0] if default is None else default
    with _lock:
        if key in _chosen:
            return _chosen[key]
        stored = _stored(key, candidates, rule)
        if stored is not None:
            _chosen[key] = stored
            return stored
    # measured without the lock: a measurement may itself need another choice, from other threads
    start = time.perf_counter()
    seconds = {candidate: float(measure(candidate)) for candidate in candidates}
    for turn in range(1, rounds):
        for candidate in (reversed(candidates) if turn % 2 else candidates):
            seconds[candidate] = min(seconds[candidate], float(measure(candidate)))
    fastest = min(seconds.values())
    fallback = candidates[0] if default is None else default
    if fallback in seconds and seconds[fallback] <= fastest * (1 + keep):
        best = fallback
    else:
        best = next(c for c in candidates if seconds[c] <= fastest * (1 + near))
    with _lock:
        if key in _chosen:          # another thread measured the same choice meanwhile: keep the first
            return _chosen[key]
        logger.info("measured %s on %s in %.2f s: %s -> %r", name, machine_key(device), time.perf_counter() - start,
                    ", ".join(f"{c!r} {s * 1e3:.2f} ms" for c, s in seconds.items()), best)
        # another process (a worker beside this one) may have stored its choice meanwhile: the first
        # stored wins, so that every process on this machine computes the same floats
        entry = {"choice": best, "seconds": {json.dumps(c): s for c, s in seconds.items()},
                 "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if rule != DEFAULT_RULE:
            entry["rule"] = rule
        _chosen[key] = _store_first(key, candidates, entry)
    return _chosen[key]


def _rule(keep: float, near: float, rounds: int) -> str:
    """How a choice was made, stored with it (choices made by the default rule store none)."""
    return f"keep {keep:g}, near {near:g}, {rounds} rounds"


DEFAULT_RULE = _rule(KEEP_DEFAULT, NEAR_DEFAULT, 1)


def forced_route(variable: str, routes: Sequence[str]) -> str:
    """The route the environment variable `variable` forces (lower-cased), '' when it is unset,
    empty or `auto` (the measured choice, as unset).

    Raises:
        InputError: the variable names none of `routes`.
    """
    return checked_route(variable, os.environ.get(variable, ""), routes)


def checked_route(variable: str, value: str, routes: Sequence[str]) -> str:
    """`value` of the environment variable `variable` as `forced_route` reads it: lower-cased, ''
    for empty or `auto`.

    Raises:
        InputError: it names none of `routes`.
    """
    forced = value.strip().lower()
    if forced == "auto":
        return ""
    if forced and forced not in routes:
        raise InputError(f"{variable} must be auto (the measured choice) or one of {', '.join(routes)}, "
                         f"got {forced!r}")
    return forced


def best_time(run: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """The smallest wall time of `repeats` calls of `run` after `warmup` calls (seconds)."""
    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def forget() -> None:
    """Drop this process's choices (the stored file stays): the next use reads or measures again."""
    global _generation
    with _lock:
        _chosen.clear()
        _absent.clear()
        _generation += 1


def generation() -> int:
    """Changes whenever `forget` drops the choices: a cache of choices keyed by it stays valid."""
    return _generation


def _stored(key: str, candidates: Sequence[Any], rule: str | None = None) -> Any:
    """The stored choice for `key` if it is one of `candidates` and, with `rule`, was made by it."""
    entry = _read().get(key)
    if not isinstance(entry, dict) or entry.get("choice") not in list(candidates):
        return None
    if rule is not None and entry.get("rule", DEFAULT_RULE) != rule:
        return None
    return entry["choice"]


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_first(key: str, candidates: Sequence[Any], entry: dict[str, Any]) -> Any:
    """Stores `entry` unless a valid choice for `key` (made by its rule) is stored already;
    returns the stored choice.

    The check and the write hold an exclusive lock on `tuning.json.lock` beside the file, so two
    processes that measured at once agree on the first one's choice."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a+b")   # noqa: SIM115 (held across the write)
    except OSError as error:   # a read-only home: the choice still holds for this process
        logger.debug("could not store the measured choice in %s: %s", path, error)
        say_unwritable(path.parent, error)
        return entry["choice"]
    with lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        stored = _stored(key, candidates, entry.get("rule", DEFAULT_RULE))
        if stored is not None:
            return stored
        _store(key, entry)
        return entry["choice"]


def _store(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        data[key] = entry
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tuning.", suffix=".tmp", delete=False,
                                         encoding="utf-8") as tmp:
            temporary = tmp.name
            json.dump(data, tmp, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:     # a read-only home: the choice still holds for this process
        logger.debug("could not store the measured choice in %s: %s", path, error)
        say_unwritable(path.parent, error)
        if temporary is not None:
            pathlib.Path(temporary).unlink(missing_ok=True)
