"""The run folder: `config.yaml`, `metrics.jsonl`, `last.pt`, `best.pt`, `curves.png`.

    RUN_DIR/
      config.yaml     the resolved training config, plus the data folder it trains on and
                      that folder's fingerprint (`sgraf.data.precomp.data_fingerprint`)
      metrics.jsonl   one JSON object per validation (epoch, step, rsum, recalls, loss, lr)
      last.pt         latest checkpoint, with the training state to resume from
      best.pt         checkpoint of the best validation rsum
      curves.png      training loss and validation rsum against the step
      tensorboard/    event files, when TensorBoard is installed
      .sgraf-lock     while a run owns the folder: its lock and who holds it (pid, host, start, command)
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

from sgraf import text_files
from sgraf.atomic_write import ensure_folder, write_error, write_text
from sgraf.errors import InputError
from sgraf.folder_lock import FolderLock
from sgraf.training.config import TrainConfig, load_config_file

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
CURVES_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, LAST_CHECKPOINT, BEST_CHECKPOINT, CURVES_FILE, TENSORBOARD_DIR)


# what a training run's lock record says it holds its folder for (a run starting, to `sgraf runs`)
RUN_LOCK_PURPOSE = "training run"


def prepare_run_dir(out_dir: str | os.PathLike[str], resume: bool,
                    lock: bool = True) -> tuple[pathlib.Path, FolderLock | None]:
    """Creates (or, when resuming, checks) the run folder, locks it and proves it is writable.

    The lock (`sgraf.folder_lock`, `RUN_DIR/.sgraf-lock`) is held until released: a second run
    into the same folder is refused, naming the first; a lock left by a killed run is free.

    Args:
        lock: take the folder's lock (the process that writes the files; under torchrun, rank 0).

    Returns:
        The folder and its lock (None when `lock` is False); release the lock when the run ends.

    Raises:
        FolderLockedError: another run owns the folder.
        InputError: the folder cannot be created or written, it already holds a run and
            `resume` is False, or it holds no run and `resume` is True.
    """
    run = pathlib.Path(out_dir)
    if run.exists() and not run.is_dir():
        raise InputError(f"output folder {run} is a file, expected a folder")
    if not resume:
        ensure_folder(run)   # a file among its parents named
    elif not run.is_dir():
        raise InputError(f"cannot resume {run}: no such folder")
    run_lock = FolderLock(run, purpose=RUN_LOCK_PURPOSE) if lock else None
    if run_lock is not None:
        run_lock.acquire()
    try:
        if resume:
            for name in (CONFIG_FILE, LAST_CHECKPOINT):
                if (run / name).is_dir():
                    raise InputError(f"cannot resume {run}: its {name} is a folder, where the run's file belongs")
                if not (run / name).is_file():
                    raise InputError(f"cannot resume {run}: it has no {name} (not a sgraf run folder, a run "
                                     "killed before its first checkpoint, or the file deleted)")
        elif (run / LAST_CHECKPOINT).exists():
            raise InputError(f"output folder {run} already holds a run ({LAST_CHECKPOINT}); continue it with "
                             f"--resume {run} (in Python: resume=True) or choose another --out")
        else:   # a run stopped between its first validation and its first last.pt: its records would mix
            earlier = [name for name in (METRICS_FILE, BEST_CHECKPOINT, TENSORBOARD_DIR) if (run / name).exists()]
            if earlier:
                raise InputError(f"output folder {run} holds {' and '.join(earlier)} of an earlier run, which has "
                                 f"no {LAST_CHECKPOINT} to resume from; choose another --out or move them away")
            # a run writes these over; a run's own config.yaml (a start that failed before its first
            # validation) is written over by the same command run again, anything else is another's
            foreign = [name for name in (CONFIG_FILE, CURVES_FILE) if (run / name).exists()
                       and not (name == CONFIG_FILE and _written_by_a_run(run / name))]
            if foreign:
                raise InputError(f"output folder {run} holds {' and '.join(foreign)}, which no sgraf run wrote there "
                                 "and a new run would write over; choose another --out or move "
                                 f"{'it' if len(foreign) == 1 else 'them'} away")
        try:
            with tempfile.NamedTemporaryFile(dir=run, prefix=".write-test-"):
                pass
        except OSError as exc:
            raise InputError(f"output folder {run} is not writable: {exc.strerror or exc}") from None
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise
    return run, run_lock


def _written_by_a_run(path: pathlib.Path) -> bool:
    """Whether `path` is a config.yaml `save_run_config` wrote (a mapping with its 'data' and
    'sgraf_version' entries)."""
    import yaml

    try:
        content = yaml.safe_load(text_files.read_text(path, "a run's config.yaml"))
    except (OSError, InputError, yaml.YAMLError):
        return False
    return isinstance(content, dict) and "data" in content and "sgraf_version" in content


def save_run_config(run: pathlib.Path, config: TrainConfig, data_dir: str | os.PathLike[str],
                    preset: str | None, data_fingerprint: dict[str, str] | None = None) -> None:
    """Writes config.yaml: the data folder (and its fingerprint), the preset it started from
    and every field."""
    import yaml

    from sgraf import __version__

    content: dict[str, Any] = {"data": str(pathlib.Path(data_dir).resolve()), "preset": preset,
                               "sgraf_version": __version__}
    if data_fingerprint is not None:
        content["data_fingerprint"] = dict(data_fingerprint)
    content.update(config.to_dict())
    write_text(run / CONFIG_FILE, yaml.safe_dump(content, sort_keys=False))


def load_run_config(run: pathlib.Path) -> tuple[TrainConfig, str, str | None]:
    """The config, data folder and preset recorded in a run's config.yaml."""
    values, extras = load_config_file(run / CONFIG_FILE)
    if not extras.get("data"):
        raise InputError(f"{run / CONFIG_FILE}: no 'data' entry (the data folder of the run)")
    return TrainConfig.from_dict(values, source=str(run / CONFIG_FILE)), str(extras["data"]), extras.get("preset")


def other_data(run: pathlib.Path, data_dir: str | os.PathLike[str],
               fingerprint: dict[str, str]) -> str | None:
    """Why `data_dir` is not the data the run in `run` trained on, or None when it is.

    The same data is the folder recorded in config.yaml (paths compared resolved) with the
    recorded fingerprint, or a folder elsewhere with that fingerprint (the data moved). Runs
    recorded before fingerprints existed compare the paths only.
    """
    from sgraf.data.precomp import comparable_fingerprint, fingerprint_differences   # PyTorch: not for `sgraf runs`

    _, extras = load_config_file(run / CONFIG_FILE)
    recorded, recorded_fingerprint = extras.get("data"), extras.get("data_fingerprint")
    given = pathlib.Path(data_dir).resolve()
    same_folder = recorded is not None and pathlib.Path(str(recorded)).resolve() == given
    if not isinstance(recorded_fingerprint, dict):
        return None if same_folder else f"{given} is another folder than {recorded}"
    fingerprint = comparable_fingerprint(fingerprint, recorded_fingerprint)
    if fingerprint == recorded_fingerprint:
        return None
    differ = fingerprint_differences(fingerprint, recorded_fingerprint)
    if same_folder:
        return f"the files of {given} changed since the run recorded them ({', '.join(differ)} differ)"
    return f"{given} is another folder than {recorded}, with other files ({', '.join(differ)} differ)"


def append_metrics(run: pathlib.Path, record: dict[str, Any]) -> None:
    try:
        with open(run / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise write_error(run / METRICS_FILE, error) from None


def read_metrics(run: str | os.PathLike[str], strict: bool = False) -> list[dict[str, Any]]:
    """The validation records of a run, oldest first (a torn last line is skipped).

    With `strict`, a line before the last that is not a JSON record is an InputError naming it
    (the file was damaged, not cut short by a crash); otherwise it is skipped too."""
    path = pathlib.Path(run) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    lines = text_files.read_bytes(path).splitlines()
    last = max((number for number, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)  # json decodes the UTF-8 bytes itself
        except (json.JSONDecodeError, UnicodeDecodeError):
            if strict and number != last:
                raise InputError(f"{path}: line {number + 1} is not a JSON record (the file is damaged)") from None
            continue  # a line cut short by a crash
        if isinstance(record, dict):
            records.append(record)
    return records


def truncate_metrics(run: pathlib.Path, last_step: int) -> None:
    """Drops records newer than the checkpoint being resumed (they will be written again)."""
    path = run / METRICS_FILE
    if not path.exists():
        return
    kept = [r for r in read_metrics(run) if r.get("step", 0) <= last_step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
