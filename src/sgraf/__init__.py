"""sgraf: image-text matching with SGRAF (Diao et al., AAAI 2021).

Public API (imported lazily, so `import sgraf` stays light):

- `load_model(path, map_location="cpu")`: a model from our checkpoint or the authors' `.pth.tar`.
- `load_vocab(path)`: a vocabulary from the authors' JSON format.
- `SGRAF`, `ModelConfig`: the network and its configuration.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "sgraf.config",
    "InputError": "sgraf.errors",
    "SGRAF": "sgraf.model.sgraf",
    "load_model": "sgraf.checkpoint",
    "save_model": "sgraf.checkpoint",
    "load_vocab": "sgraf.data.vocab",
    "Vocabulary": "sgraf.data.vocab",
    "Matcher": "sgraf.api",
    "open_index": "sgraf.search",
    "build_index": "sgraf.search",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sgraf' has no attribute {name!r}")
