"""The SGRAF network (`SGRAF`), its parts and the ranking loss."""

from sgraf.model.loss import ranking_loss
from sgraf.model.sgraf import SGRAF, init_weights

__all__ = ["SGRAF", "init_weights", "ranking_loss"]
