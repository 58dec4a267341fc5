"""Training SGRAF: configs and presets, the step, the engine, resumable run folders, several processes.

The training loop sits on top of the library (`sgraf.model`, `sgraf.data`, `sgraf.scoring`,
`sgraf.metrics`); nothing below imports it. The engine's names are imported when first used,
so that the command line can read the presets (`sgraf.training.config`) without PyTorch.
"""

from __future__ import annotations

import importlib
from typing import Any

from sgraf.training.config import PRESETS, TrainConfig, preset, resolve_config

_ENGINE = {**dict.fromkeys(("NonFiniteLossError", "StepResult", "batch_loss", "build_optimizer", "learning_rate",
                             "train_step"), "sgraf.training.step"),
           **dict.fromkeys(("fit", "train_one_epoch", "validate"), "sgraf.training.loop")}

__all__ = ["PRESETS", "TrainConfig", "preset", "resolve_config", *_ENGINE]


def __getattr__(name: str) -> Any:
    if name in _ENGINE:
        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
