"""Training SGRAF: configs and presets, the engine, resumable run folders, several processes.

The training loop sits on top of the library (`sgraf.model`, `sgraf.data`, `sgraf.scoring`,
`sgraf.metrics`); nothing below imports it.
"""

from sgraf.training.config import PRESETS, TrainConfig, preset, resolve_config
from sgraf.training.loop import (NonFiniteLossError, StepResult, batch_loss, build_optimizer, fit,
                                 learning_rate, train_one_epoch, train_step, validate)

__all__ = ["PRESETS", "TrainConfig", "preset", "resolve_config", "NonFiniteLossError", "StepResult",
           "batch_loss", "build_optimizer", "fit", "learning_rate", "train_one_epoch", "train_step",
           "validate"]
