"""What a set of run folders holds, side by side (`sgraf runs`): for an ablation, which run
reached what dev rsum, how far each got, which can be resumed, and which settings set them apart.

Everything is read from the folders (`sgraf.training.run_dir`): `config.yaml`, `metrics.jsonl`,
`last.pt`'s presence and the lock's record; no checkpoint is loaded and no lock is taken (a
listing never gets in the way of a run starting).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shlex
import socket
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Sequence

from sgraf.config import unused_settings
from sgraf.errors import InputError
from sgraf.folder_lock import LOCK_FILE, describe_holder, pid_alive
from sgraf.io_paths import path_list
from sgraf.training import run_dir as rd
from sgraf.training.config import load_config_file, patience_ran_out

# the files that make a folder a run folder (a failed start leaves config.yaml alone)
_MARKS = (rd.CONFIG_FILE, rd.METRICS_FILE, rd.LAST_CHECKPOINT)
# config.yaml's bookkeeping, not a setting of the run
_NOT_SETTINGS = ("sgraf_version", "data_fingerprint", "data")


@dataclass(frozen=True)
class Run:
    """One run folder as `summarise` reads it.

    Attributes:
        path: the folder, as found.
        state: ``finished`` (its last epoch validated), ``stopped early`` (its `patience` ran
            out: that many epochs ended without a better dev rsum), ``stopped`` (a `last.pt` to resume from),
            ``running`` (a live process holds its lock; a run starting has no settings yet),
            ``stopped before a checkpoint`` (validations but no `last.pt`: nothing to resume),
            ``not started`` (neither) or ``unreadable`` (`problem` says why).
        settings: config.yaml's fields and preset; empty when unreadable.
        data: the data folder it trains on, with the fingerprint config.yaml records (None
            before fingerprints were recorded).
        epochs: epochs finished (validated at their end) and the config's total.
        step: the last validation's step (0 before the first).
        best: the record of the best dev rsum (`metrics.jsonl`), or None.
        last: the last validation's record, or None.
        holder: the lock's record while running (pid, host, start, command).
        problem: why an unreadable folder could not be read.
    """

    path: str
    state: str
    settings: dict[str, Any] = field(default_factory=dict)
    data: tuple[str, Any] | None = None
    epochs: tuple[int, int | None] = (0, None)
    step: int = 0
    best: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    holder: dict[str, Any] | None = None
    problem: str | None = None


def find_runs(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[pathlib.Path]:
    """The run folders named by `paths`: each a run folder itself, or a folder searched (at any
    depth, not inside a run folder) for run folders, in name order.

    Raises:
        InputError: a path that is not there, is a file, or holds no run folder.
    """
    found: list[pathlib.Path] = []
    for given in path_list("paths", paths):    # one folder is a list of one, not its characters
        path = pathlib.Path(given)
        if not path.exists():
            raise InputError(f"{path}: no such folder")
        if not path.is_dir():
            raise InputError(f"{path} is a file, expected a run folder or a folder of run folders")
        runs = [path] if is_run_folder(path) else sorted(_runs_below(path))
        if not runs:
            lone = only_a_lock(path)
            if lone is not None:
                raise InputError(lone[1])
            raise InputError(f"{path} holds no sgraf run folder (one with {', '.join(_MARKS[:-1])} or "
                             f"{_MARKS[-1]}, or the lock of a run starting)")
        found.extend(run for run in runs if run not in found)
    return found


def only_a_lock(folder: pathlib.Path) -> tuple[bool, str] | None:
    """(whether its holder is live, what to say) of a folder that holds nothing but an sgraf lock
    (None for any other): a live holder that has written nothing yet (a run loading its data, a
    demo starting), or one stopped before it wrote anything."""
    if [entry.name for entry in folder.iterdir()] != [LOCK_FILE]:
        return None
    holder = _live_holder(folder)
    if holder is not None:
        from sgraf.folder_lock import describe_holder

        return True, (f"{folder} is in use by another sgraf process that has written nothing there yet "
                      f"({describe_holder(holder)}); wait for it to write its files")
    return False, (f"{folder} holds only the lock of a command that stopped before writing anything (a run killed "
                   "as it started?): nothing to list or resume; start the run again")


def is_run_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` is a run folder: one of a run's files, or the lock of a live run that has
    not written them yet (a run starting)."""
    folder = pathlib.Path(folder)
    if any((folder / name).is_file() for name in _MARKS):
        return True
    holder = _live_holder(folder) if (folder / LOCK_FILE).is_file() else None
    return holder is not None and holder.get("purpose") == rd.RUN_LOCK_PURPOSE   # not a demo's, an index's


def run_folder_of(path: str | os.PathLike[str]) -> pathlib.Path | None:
    """The run folder whose own file `path` is (its name one of `run_dir.RUN_FILES`, its folder a
    run folder), else None: what an output must never be (`plots.check_plot_output`,
    `cli.arguments.refuse_others_files`)."""
    target = pathlib.Path(path)
    return target.parent if target.name in rd.RUN_FILES and is_run_folder(target.parent) else None


def _runs_below(folder: pathlib.Path) -> Iterable[pathlib.Path]:
    for root, folders, _ in os.walk(folder):
        here = pathlib.Path(root)
        if here != folder and is_run_folder(here):
            folders.clear()     # a run's own folders (tensorboard/) hold no runs
            yield here
        folders[:] = sorted(name for name in folders if not name.startswith("."))


def read_run(folder: str | os.PathLike[str]) -> Run:
    """One run folder's state, settings and validations (an unreadable config.yaml gives a
    `Run` whose state is ``unreadable``, so a listing goes on past it)."""
    path = pathlib.Path(folder)
    try:
        values, extras = load_config_file(path / rd.CONFIG_FILE)
    except FileNotFoundError:
        holder = _live_holder(path)
        if holder is not None:      # a run starting: its lock is taken before config.yaml is written
            return Run(str(path), "running", holder=holder)
        return Run(str(path), "unreadable", problem=f"no {rd.CONFIG_FILE}")
    except InputError as error:
        return Run(str(path), "unreadable", problem=str(error))
    if not values:
        return Run(str(path), "unreadable", problem=f"{rd.CONFIG_FILE} holds no settings")
    settings = {"preset": extras.get("preset"), **values}
    data = (str(extras["data"]), extras.get("data_fingerprint")) if extras.get("data") else None
    try:
        records = rd.read_metrics(path, strict=True)
    except InputError as error:
        return Run(str(path), "unreadable", problem=str(error))
    total = values.get("epochs")
    done = max((int(r.get("epoch", 0)) for r in records if r.get("end_of_epoch")), default=0)
    flagged = [r for r in records if r.get("best")]
    best = flagged[-1] if flagged else max(records, key=lambda r: r.get("rsum", float("-inf")), default=None)
    holder = _live_holder(path)
    if holder is not None:
        state = "running"
    elif isinstance(total, int) and done >= total:
        state = "finished"
    elif patience_ran_out(values.get("patience"), done, None if best is None else int(best.get("epoch", done))):
        state = "stopped early"
    elif (path / rd.LAST_CHECKPOINT).is_file():
        state = "stopped"
    elif records:
        state = "stopped before a checkpoint"     # killed after a validation, before its first last.pt
    else:
        state = "not started"
    return Run(str(path), state, settings, data, (done, total if isinstance(total, int) else None),
               int(records[-1].get("step", 0)) if records else 0, best, records[-1] if records else None, holder)


def _live_holder(folder: pathlib.Path) -> dict[str, Any] | None:
    """The lock's record where it names a live process on this host, or another host (whose
    processes cannot be seen from here); None for no lock or a lock left by a killed run. The
    record is read, not locked."""
    try:
        record = json.loads((folder / LOCK_FILE).read_text(encoding="utf-8", errors="replace") or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if record.get("host") != socket.gethostname():
        return record
    return record if isinstance(record.get("pid"), int) and pid_alive(record["pid"]) else None


def differences(runs: Sequence[Run]) -> list[str]:
    """The settings whose values are not the same in every readable run where they have an
    effect (in config order), with ``data`` first where the runs train on different data
    (folders or files)."""
    readable = [run for run in runs if run.settings]     # not unreadable, not a run still starting
    keys: list[str] = []
    for run in readable:
        keys.extend(key for key in run.settings if key not in keys and key not in _NOT_SETTINGS)
    # a setting without effect in a run (`sgr_step` of a SAF run) sets it apart from none: SGR runs
    # that all take sgr_step=3 beside SAF runs show no sgr_step column (the module's says it all)
    effective = [(_effective_settings(run), unused_settings(run.settings)) for run in readable]
    differ = [key for key in keys if len({json.dumps(settings.get(key), sort_keys=True)
                                          for settings, unused in effective if key not in unused}) > 1]
    other_data = any(not _same_data(a, b) for i, a in enumerate(readable) for b in readable[i + 1:])
    return (["data"] if other_data else []) + differ


def _effective_settings(run: Run) -> dict[str, Any]:
    """`run.settings` as they took effect where its validations record it: `val_max_captions` is
    the captions validated (a cap above the dev split's size validates the whole split, so 5000
    and none on a 1,000-caption dev split are the same share; they had been called different)."""
    validated = run.last.get("n_captions") if run.last is not None else None
    if "val_max_captions" not in run.settings or not isinstance(validated, int):
        return run.settings
    return {**run.settings, "val_max_captions": validated}


def _files_id(run: Run, files: Collection[str] | None = None) -> str | None:
    """A short name of the data's files (their recorded fingerprint; of those among `files`
    where given), to tell apart two runs on one folder whose files changed between them; None
    where no fingerprint was recorded."""
    if run.data is None or not isinstance(run.data[1], dict):
        return None
    fingerprint = {name: value for name, value in run.data[1].items() if files is None or name in files}
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:8]


def _same_data(a: Run, b: Run) -> bool:
    """Whether two runs train on the same data: the same hashes of the files both recorded (a
    model with positions also reads the boxes, sizes and scenes files, which another run of the
    same folder does not record), else the same folder."""
    if a.data is None or b.data is None:
        return a.data == b.data
    (folder_a, files_a), (folder_b, files_b) = a.data, b.data
    if isinstance(files_a, dict) and isinstance(files_b, dict) and set(files_a) & set(files_b):
        return all(files_a[name] == files_b[name] for name in set(files_a) & set(files_b))
    return folder_a == folder_b


def _common_files(runs: Sequence[Run]) -> set[str] | None:
    """The data files every run with a fingerprint recorded; None where none has one."""
    recorded = [set(run.data[1]) for run in runs if run.data is not None and isinstance(run.data[1], dict)]
    return set.intersection(*recorded) if recorded else None


def summarise(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], sort: str = "name") -> dict[str, Any]:
    """`find_runs` read by `read_run`: ``{"runs": [...], "differ": [...]}``, each run a plain
    dict (`as_dict`) and `differ` the settings that set them apart (`differences`).

    Args:
        sort: ``name`` (the folders' order) or ``rsum`` (best dev rsum first; none last).
    """
    if sort not in ("name", "rsum"):
        raise InputError(f"sort must be 'name' or 'rsum', got {sort!r}")
    runs = [read_run(path) for path in find_runs(paths)]
    if sort == "rsum":
        runs.sort(key=lambda run: -run.best["rsum"] if run.best and "rsum" in run.best else float("inf"))
    differ = differences(runs)
    files = _common_files(runs)
    return {"runs": [as_dict(run, differ, files) for run in runs], "differ": differ}


def as_dict(run: Run, differ: Sequence[str] = (), files: Collection[str] | None = None) -> dict[str, Any]:
    """A run as JSON-ready values: path, state, epochs done / total, step, the best validation
    (rsum, epoch, step) and the last one's rsum, the settings named in `differ`, the resume
    command where it has one, the lock's holder while running, the problem if unreadable.
    `data_files` names the fingerprint of its data files (of those among `files`: the ones
    every run shown recorded)."""
    out: dict[str, Any] = {"path": run.path, "state": run.state}
    if run.state == "unreadable":
        return {**out, "problem": run.problem}
    out.update({"module": run.settings.get("module"), "preset": run.settings.get("preset"),
                "epochs_done": run.epochs[0], "epochs": run.epochs[1], "step": run.step,
                "best": None if run.best is None else {key: run.best.get(key) for key in ("rsum", "epoch", "step")},
                "last_rsum": None if run.last is None else run.last.get("rsum"),
                "settings": {key: (run.data[0] if run.data else None) if key == "data" else run.settings.get(key)
                             for key in differ},
                "unused_settings": sorted(set(differ) & set(unused_settings(run.settings))),
                "data_files": _files_id(run, files)})
    if run.state == "stopped":
        out["resume"] = f"sgraf train --resume {shlex.quote(str(run.path))}"
    if run.holder is not None:
        out["holder"] = describe_holder(run.holder)
    return out


def format_runs(summary: dict[str, Any]) -> str:
    """`summarise`'s result as a table: one line per run, then what sets the runs apart."""
    header = ("run", "module", "epochs", "best dev rsum", "at epoch", "last rsum", "state")
    rows = []
    for run in summary["runs"]:
        if run["state"] == "unreadable":
            rows.append((run["path"], "", "", "", "", "", f"unreadable: {run['problem']}"))
            continue
        best = run["best"]
        state = {"stopped": f"stopped ({run.get('resume')})",
                 "running": f"running ({run.get('holder')})",
                 "stopped before a checkpoint": "stopped before a checkpoint (no last.pt: killed before its "
                                                "first, or deleted; nothing to resume: train it again with "
                                                "another --out)"}.get(run["state"], run["state"])
        rows.append((run["path"], "" if run["module"] is None else str(run["module"]),
                     f"{run['epochs_done']}/{run['epochs'] if run['epochs'] is not None else '?'}",
                     "" if best is None else f"{best['rsum']:.2f}", "" if best is None else str(best["epoch"]),
                     "" if run["last_rsum"] is None else f"{run['last_rsum']:.2f}", state))
    lines = _table([header, *rows], left=2)
    differ = summary["differ"]
    readable = [run for run in summary["runs"] if run["state"] != "unreadable" and run["module"] is not None]
    ids: dict[Any, set[Any]] = {}       # one folder whose files changed between runs: name the files too
    for run in readable:
        ids.setdefault(run["settings"].get("data"), set()).add(run["data_files"])

    def cell(run: dict[str, Any], key: str) -> str:
        if key in run.get("unused_settings", ()):
            return "-"          # no effect in this run
        value = run["settings"][key]
        return f"{value} (files {run['data_files']})" if key == "data" and len(ids[value]) > 1 else _text(value)

    if len(readable) > 1:
        lines.append("")
        if not differ:
            lines.append("settings that differ: none (the same config and data)")
        else:
            lines.append("settings that differ:")
            lines.extend(_table([("run", *differ)] + [(run["path"], *(cell(run, key) for key in differ))
                                                      for run in readable], left=len(differ) + 1))
            if any(run.get("unused_settings") for run in readable):
                lines.append("(-: the setting has no effect in that run, as sgr_step without an SGR head)")
        if "data" in differ:
            lines.append("(the runs train on different data: their dev rsums are on different dev splits and do "
                         "not compare)")
        elif "val_max_captions" in differ:
            lines.append("(the runs validate on different shares of the dev split, val_max_captions: their dev "
                         "rsums do not compare; sgraf evaluate --split dev scores each on the whole split)")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Aligned columns: the first `left` and the last left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) if i < left or i == len(row) - 1 else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
