"""The run folder: `config.yaml`, `metrics.jsonl`, `last.pt`, `best.pt`, `curves.png`.

    RUN_DIR/
      config.yaml     the resolved training config, plus the data folder it trains on
      metrics.jsonl   one JSON object per validation (epoch, step, rsum, recalls, loss, lr)
      last.pt         latest checkpoint, with the training state to resume from
      best.pt         checkpoint of the best validation rsum
      curves.png      training loss and validation rsum against the step
      tensorboard/    event files, when TensorBoard is installed
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

from sgraf.errors import InputError
from sgraf.training.config import TrainConfig, load_config_file

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
CURVES_FILE = "curves.png"


def prepare_run_dir(out_dir: str | os.PathLike[str], resume: bool) -> pathlib.Path:
    """Creates (or, when resuming, checks) the run folder and proves it is writable.

    Raises:
        InputError: the folder cannot be created or written, it already holds a run and
            `resume` is False, or it holds no run and `resume` is True.
    """
    run = pathlib.Path(out_dir)
    if run.exists() and not run.is_dir():
        raise InputError(f"output folder {run} is a file, expected a folder")
    if resume:
        for name in (CONFIG_FILE, LAST_CHECKPOINT):
            if not (run / name).is_file():
                raise InputError(f"cannot resume {run}: it has no {name} (not a sgraf run folder, "
                                 "or the run never reached its first checkpoint)")
    elif (run / LAST_CHECKPOINT).exists():
        raise InputError(f"output folder {run} already holds a run ({LAST_CHECKPOINT}); continue it with "
                         f"--resume {run} or choose another --out")
    try:
        run.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise InputError(f"output folder {run} is not writable: {exc.strerror or exc}") from None
    return run


def write_text_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_run_config(run: pathlib.Path, config: TrainConfig, data_dir: str | os.PathLike[str],
                    preset: str | None) -> None:
    """Writes config.yaml: the data folder, the preset it started from and every field."""
    import yaml

    from sgraf import __version__

    content: dict[str, Any] = {"data": str(pathlib.Path(data_dir).resolve()), "preset": preset,
                               "sgraf_version": __version__}
    content.update(config.to_dict())
    write_text_atomic(run / CONFIG_FILE, yaml.safe_dump(content, sort_keys=False))


def load_run_config(run: pathlib.Path) -> tuple[TrainConfig, str, str | None]:
    """The config, data folder and preset recorded in a run's config.yaml."""
    values, extras = load_config_file(run / CONFIG_FILE)
    if not extras.get("data"):
        raise InputError(f"{run / CONFIG_FILE}: no 'data' entry (the data folder of the run)")
    return TrainConfig.from_dict(values, source=str(run / CONFIG_FILE)), str(extras["data"]), extras.get("preset")


def append_metrics(run: pathlib.Path, record: dict[str, Any]) -> None:
    with open(run / METRICS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(run: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The validation records of a run, oldest first (a torn last line is skipped)."""
    path = pathlib.Path(run) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)  # json decodes the UTF-8 bytes itself
        except (json.JSONDecodeError, UnicodeDecodeError):
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
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
