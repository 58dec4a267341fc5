"""sgraf: image-text matching with SGRAF (Diao et al., AAAI 2021).

Public API (imported lazily, so `import sgraf` stays light):

- `load_model(path, map_location="cpu", vocab=None)`: an `SGRAF` model from our checkpoint or the
  authors' `.pth.tar`; `save_model(model, path)` writes ours.
- `load_vocab(path)`, `Vocabulary`: a vocabulary (the authors' JSON format).
- `SGRAF`, `ModelConfig`: the network and its configuration.
- `Matcher`: one model or an ensemble that encodes, scores and checks its input.
- `build_index(matcher, features, captions, out)`, `open_index(path)`: a searchable gallery.
- `InputError`: what every bad input raises (a `ValueError`), with a one-line message.

Training (`sgraf.training`), evaluation (`sgraf.evaluate`), diagnosis (`sgraf.diagnose`) and the
service (`sgraf.serve`) are modules of their own.
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


# modules of their own, imported when first named (`sgraf.training` after `import sgraf`)
_MODULES = ("training", "evaluate", "diagnose", "serve", "search", "api", "metrics", "significance", "explain",
            "data", "model", "checkpoint", "scoring", "kernels")


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"sgraf.{name}")
    raise AttributeError(f"module 'sgraf' has no attribute {name!r}")


def __dir__() -> list[str]:     # the modules imported when first named too (a notebook's sgraf.<TAB>)
    return sorted({*globals(), *__all__, *_MODULES})
