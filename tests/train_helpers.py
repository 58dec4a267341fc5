"""A tiny learnable precomp data set for the training tests (seconds to train on a CPU).

Each image has a colour, an object and a place; three of its regions hold their prototype
vectors (in random slots), the others noise. Its five captions name the three words in
different templates, so matching words to regions is learnable.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

COLOURS = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink"]
OBJECTS = ["dog", "cat", "car", "boat", "bird", "horse", "man", "child"]
PLACES = ["park", "beach", "road", "field", "house", "lake"]
TEMPLATES = ["a {c} {o} in the {p}", "the {c} {o} near a {p}", "one {c} {o} at the {p}",
             "a {o} that is {c} in a {p}", "this {c} {o} by the {p}"]


# `python -c KILLED_IN_VALIDATION N sgraf-args...` (or the text as a script under torchrun): `sgraf` whose
# main process (rank 0, or the only one) dies outright (SIGKILL) in the middle of its N-th validation,
# once the validation's matrix is scored: it cannot save anything then
KILLED_IN_VALIDATION = """
import os, signal, sys
import sgraf.metrics
counting, calls = sgraf.metrics.evaluate_sims, []
def evaluate_sims(*args, **kwargs):
    calls.append(1)
    if len(calls) == int(sys.argv[1]) and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return counting(*args, **kwargs)
sgraf.metrics.evaluate_sims = evaluate_sims
from sgraf.cli import main
sys.exit(main(sys.argv[2:]))
"""


def make_toy_precomp(root: str | pathlib.Path, n_train: int = 80, n_dev: int = 20, regions: int = 6,
                     dim: int = 20, seed: int = 0) -> pathlib.Path:
    """Writes `{train,dev}_ims.npy` and `{train,dev}_caps.txt` (5 captions per image) to `root`."""
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(len(COLOURS) + len(OBJECTS) + len(PLACES), dim)).astype(np.float32)
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        images = rng.normal(scale=0.5, size=(n, regions, dim)).astype(np.float32)
        lines = []
        for i in range(n):
            c, o, p = rng.integers(len(COLOURS)), rng.integers(len(OBJECTS)), rng.integers(len(PLACES))
            images[i, 0] += prototypes[c]
            images[i, 1] += prototypes[len(COLOURS) + o]
            images[i, 2] += prototypes[len(COLOURS) + len(OBJECTS) + p]
            images[i] = images[i][rng.permutation(regions)]
            lines += [t.format(c=COLOURS[c], o=OBJECTS[o], p=PLACES[p]) for t in TEMPLATES]
        np.save(root / f"{split}_ims.npy", images)
        (root / f"{split}_caps.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (Linux), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (Linux's /proc)."""
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and (_proc_stat(int(entry)) or [None, None])[1] == str(pid)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie), by Linux's /proc."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] != "Z"
