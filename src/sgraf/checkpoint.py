"""Checkpoints: our format (tensors and plain values, atomic writes) and the authors' `.pth.tar`.

Our format is `torch.save` of::

    {"format": "sgraf", "version": 2, "config": ModelConfig.to_dict(),
     "state_dict": {name: tensor}, "vocab": JSON text of Vocabulary.to_dict() | None, "extra": {...}}

and loads with `torch.load(weights_only=True)`. The vocabulary is stored as the text of the
authors' JSON vocabulary file: the unpickler `weights_only` uses is written in Python, and a
vocabulary read as a dict (Flickr30K's 8,481 words, each with its id both ways) took 0.22 s of a
0.3 s load on a 2-core AMD EPYC Zen 3; as one string it takes a few milliseconds. Version 1 (the
vocabulary as a dict) is still read; `load_checkpoint` returns the dict content for both.

The authors' files hold a list of three state dicts (image encoder, text encoder, similarity
encoder) and a pickled `argparse.Namespace` of options; exactly that class is allow-listed for
unpickling, anything else is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from sgraf.atomic_write import atomic_path
from sgraf.config import ModelConfig
from sgraf.errors import InputError
from sgraf.weights_file import load_weights_only

if TYPE_CHECKING:
    from sgraf.model.sgraf import SGRAF

logger = logging.getLogger(__name__)

FORMAT = "sgraf"
VERSION = 2     # 2: the vocabulary stored as JSON text (1: as a dict)
OFFICIAL_PREFIXES = ("img_enc", "txt_enc", "sim_enc")


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` to a temporary file beside `path`, then `os.replace` it into place.

    Raises:
        InputError: the file cannot be written (the message names `path`).
    """
    with atomic_path(path) as temporary, open(temporary, "wb") as handle:
        try:
            torch.save(obj, handle)
        except RuntimeError as error:
            # torch's zip writer meets a full disk (OSError) and then fails to close the archive with
            # a RuntimeError of its own: the OSError is what happened (atomic_path names the path)
            reason = error.__context__ or error.__cause__
            if isinstance(reason, OSError):
                raise reason from None
            raise


def _vocab_dict(vocab: Any) -> dict | None:
    if vocab is None or isinstance(vocab, dict):
        return vocab
    if hasattr(vocab, "to_dict"):
        return vocab.to_dict()
    raise InputError(f"vocab must be a Vocabulary, its to_dict() content or None, got {type(vocab).__name__}")


def _vocab_text(content: dict | None) -> str | None:
    """The stored form of a vocabulary's dict content: its JSON text (see the module)."""
    return None if content is None else json.dumps(content, ensure_ascii=False, separators=(",", ":"))


def _vocab_content(stored: Any, version: int, path: Path) -> dict | None:
    """The dict content of a stored vocabulary field: JSON text from version 2 on, a dict before."""
    if stored is None or isinstance(stored, dict):
        return stored
    if version >= 2 and isinstance(stored, str):
        try:
            stored = json.loads(stored)
        except ValueError as error:
            raise InputError(f"{path}: checkpoint field 'vocab' is not valid JSON ({error})") from None
        if isinstance(stored, dict):
            return stored
    expected = "the JSON text of a vocabulary" if version >= 2 else "the vocabulary's content (a dict)"
    raise InputError(f"{path}: checkpoint field 'vocab' must be {expected} or null, got {type(stored).__name__}")


def on_disk(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What `torch.save` writes for a checkpoint dict of this version as `load_checkpoint`
    returns it: the same, the vocabulary as JSON text."""
    return {**checkpoint, "vocab": _vocab_text(_vocab_dict(checkpoint.get("vocab")))}


def non_finite_tensor(state_dict: dict[str, Any]) -> str | None:
    """The name of the first floating tensor of `state_dict` holding NaN/inf, with what it holds
    (e.g. "'sim_enc.fc.weight' (3 NaN/inf of 4096 values)"), or None when all are finite.

    A sum of finite values is finite unless it overflows, and a NaN or an infinity makes the sum
    NaN or infinite: so when every tensor's float32 sum is finite, every value is, and only
    otherwise are the values looked at one by one (0.004 s instead of 0.035 s for the paper's
    72 MB of weights)."""
    floating = [(name, tensor) for name, tensor in state_dict.items()
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()]
    if not floating:
        return None
    if len({tensor.device for _, tensor in floating}) == 1:
        sums = torch.stack([tensor.sum(dtype=torch.float32) for _, tensor in floating])
        if bool(torch.isfinite(sums).all()):
            return None
    for name, tensor in floating:
        if not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            return f"{name!r} ({count} NaN/inf of {tensor.numel()} values)"
    return None


def save_model(model: torch.nn.Module, path: str | os.PathLike, vocab: Any = None,
               extra: dict[str, Any] | None = None) -> None:
    """Write `model` (an `SGRAF`) in our format, atomically.

    Args:
        vocab: a `Vocabulary` or its `to_dict()` content; defaults to `model.vocab`.
        extra: plain values to keep beside the weights (epoch, metrics, ...).

    Raises:
        ValueError: a weight holds NaN/inf (the file would be refused on loading); nothing is
            written.
    """
    if not isinstance(getattr(model, "config", None), ModelConfig) or not isinstance(model, torch.nn.Module):
        raise InputError(f"refusing to write {path}: expected an SGRAF model (one with a ModelConfig), got "
                         f"{type(model).__name__}")
    broken = non_finite_tensor(model.state_dict())
    if broken is not None:
        raise ValueError(f"refusing to write {path}: tensor {broken} of the model; a checkpoint must hold "
                         "finite weights")
    checkpoint = {
        "format": FORMAT,
        "version": VERSION,
        "config": model.config.to_dict(),
        "state_dict": {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()},
        "vocab": _vocab_dict(vocab if vocab is not None else getattr(model, "vocab", None)),
        "extra": dict(extra or {}),
    }
    atomic_save(on_disk(checkpoint), path)
    logger.debug("saved model checkpoint to %s", path)   # a run saves last.pt often: its log says where


def _torch_load(path: Path, map_location: Any) -> Any:
    """`torch.load(weights_only=True)` with exactly `argparse.Namespace` allow-listed."""
    return load_weights_only(path, map_location, allowed=[argparse.Namespace])


def config_from_official(opt: argparse.Namespace, state_dicts: list[dict[str, torch.Tensor]],
                         source: str | os.PathLike = "official checkpoint") -> ModelConfig:
    """ModelConfig of an official checkpoint from its options (regions from the BatchNorm size);
    an option missing or of the wrong kind is an InputError that names `source` (the file)."""
    options = vars(opt)
    module = str(options.get("module_name", "")).lower()
    if module not in ("sgr", "saf"):
        raise InputError(f"{source}: official checkpoint option module_name must be 'SGR' or 'SAF', got "
                         f"{options.get('module_name')!r}")
    regions = state_dicts[2].get("v_global_w.embedding_local.1.weight")

    def number(key: str, default: Any = None) -> int:
        value = options.get(key, default)
        if value is None:
            raise InputError(f"{source}: official checkpoint options lack the field {key!r}")
        whole = isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and math.isfinite(value)
                                                          and float(value).is_integer())
        if isinstance(value, (bool, np.bool_)) or not whole:
            raise InputError(f"{source}: official checkpoint option {key} must be a whole number, got {value!r}")
        return int(value)

    def flag(key: str) -> bool:
        if key not in options:
            raise InputError(f"{source}: official checkpoint options lack the field {key!r}")
        if not isinstance(options[key], (bool, np.bool_, numbers.Integral)):
            raise InputError(f"{source}: official checkpoint option {key} must be true or false, "
                             f"got {options[key]!r}")
        return bool(options[key])

    try:
        return ModelConfig(
            vocab_size=number("vocab_size"), img_dim=number("img_dim"), word_dim=number("word_dim"),
            embed_size=number("embed_size"), sim_dim=number("sim_dim"), num_layers=number("num_layers"),
            num_regions=int(regions.shape[0]) if regions is not None else 36,
            bi_gru=flag("bi_gru"), img_norm=not flag("no_imgnorm"), txt_norm=not flag("no_txtnorm"),
            module=module, sgr_step=number("sgr_step", 3))
    except InputError as error:
        if str(error).startswith(f"{source}:"):
            raise
        raise InputError(f"{source}: {error}") from None


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Read either checkpoint format and return it as our format's dict."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "no such checkpoint file", str(path))
    if path.is_dir():
        best = " (a run folder: its best checkpoint is best.pt in it)" if (path / "best.pt").is_file() else ""
        raise IsADirectoryError(21, f"a folder, where a checkpoint file is needed{best}", str(path))
    raw = _torch_load(path, map_location)
    if isinstance(raw, dict) and raw.get("format") == FORMAT:
        if not isinstance(raw.get("version"), int) or raw["version"] > VERSION:
            raise InputError(f"{path}: checkpoint version {raw.get('version')!r} is not supported "
                             f"(this sgraf reads up to {VERSION})")
        for key, kind in (("config", dict), ("state_dict", dict)):
            if not isinstance(raw.get(key), kind):
                raise InputError(f"{path}: checkpoint field {key!r} must be a {kind.__name__}")
        raw.setdefault("extra", {})
        raw["vocab"] = _vocab_content(raw.get("vocab"), raw["version"], path)
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("opt"), argparse.Namespace) and "model" in raw:
        parts = raw["model"]
        if not isinstance(parts, (list, tuple)) or len(parts) != 3 or not all(isinstance(p, dict) for p in parts):
            raise InputError(f"{path}: official checkpoint field 'model' must be a list of three state dicts "
                             "(image encoder, text encoder, similarity encoder)")
        config = config_from_official(raw["opt"], list(parts), source=path)
        state_dict = {f"{prefix}.{name}": tensor for prefix, part in zip(OFFICIAL_PREFIXES, parts)
                      for name, tensor in part.items()}
        extra = {"official": {"epoch": raw.get("epoch"), "best_rsum": _plain(raw.get("best_rsum")),
                              "Eiters": raw.get("Eiters"), "opt": {k: _plain(v) for k, v in vars(raw["opt"]).items()}}}
        return {"format": FORMAT, "version": VERSION, "config": config.to_dict(), "state_dict": state_dict,
                "vocab": None, "extra": extra}
    raise InputError(f"{path}: neither an sgraf checkpoint (format='sgraf') nor an official SGRAF checkpoint "
                     "(keys 'model' and 'opt')")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def load_state_checked(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """`load_state_dict` that names the key and the shapes of anything that does not fit, and
    refuses weights holding NaN/inf (naming the tensor)."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if missing or unexpected:
        raise InputError(f"{source}: tensors do not fit the configuration: missing {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                         f"{' ...' if len(unexpected) > 6 else ''}")
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"{source}: entry {key!r} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise InputError(f"{source}: tensor {key!r} has shape {tuple(tensor.shape)} but the configuration "
                             f"expects {tuple(expected[key].shape)}")
    broken = non_finite_tensor(state_dict)
    if broken is not None:
        raise InputError(f"{source}: tensor {broken}; expected finite weights (the checkpoint is broken, "
                         "e.g. saved after training diverged)")
    model.load_state_dict(state_dict, strict=True)


class _NoInitialDraws(TorchFunctionMode):
    """Inside it (on this thread only: PyTorch keeps such modes per thread), `torch.nn.init`'s
    functions and `Tensor.uniform_`/`normal_` leave their tensor as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in (torch.Tensor.uniform_,
                                                                           torch.Tensor.normal_):
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


def checked_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], source: str) -> SGRAF:
    """`SGRAF(config)` holding `state_dict`, with `load_state_checked`'s checks.

    The model is built without drawing its initial weights, which the checkpoint overwrites
    (every parameter and buffer: the load is strict). At the paper's size the draws took 0.2 s of
    `load_model`'s 0.3 s (2-core AMD EPYC Zen 3). A model with a buffer the state dict does not
    hold (none today) is built the usual way. The global random generator is not advanced."""
    from sgraf.model.sgraf import SGRAF

    with _NoInitialDraws():
        model = SGRAF(config)
    if any(module._non_persistent_buffers_set for module in model.modules()):
        model = SGRAF(config)
    load_state_checked(model, state_dict, source=source)
    return model


def resolve_vocab(vocab: Any, source: str = "vocabulary") -> Any:
    """A Vocabulary from a Vocabulary, its dict content or a JSON path (dict kept if the class is absent)."""
    if vocab is None or hasattr(vocab, "word2idx"):
        return vocab
    try:
        from sgraf.data import vocab as vocab_module
    except ImportError:  # vocabulary module not available: keep the plain content
        vocab_module = None
    if isinstance(vocab, (str, os.PathLike)):
        if vocab_module is None:
            raise InputError("loading a vocabulary file needs sgraf.data.vocab")
        return vocab_module.load_vocab(vocab)
    if isinstance(vocab, dict):
        return vocab_module.Vocabulary.from_dict(vocab, source=source) if vocab_module is not None else vocab
    raise InputError(f"vocab must be a Vocabulary, a dict or a JSON path, got {type(vocab).__name__}")


def _vocab_size(vocab: Any) -> int:
    if isinstance(vocab, dict):
        return len(vocab.get("word2idx", {}))
    return len(vocab)


def _model_config(checkpoint: dict[str, Any], path: str | os.PathLike) -> ModelConfig:
    """The checkpoint's `ModelConfig`; a bad field is reported with the checkpoint's path."""
    try:
        return ModelConfig.from_dict(checkpoint["config"])
    except InputError as error:
        raise InputError(f"{path}: {error}") from None


def load_model(path: str | os.PathLike, map_location: Any = "cpu", vocab: Any = None) -> SGRAF:
    """The model of a checkpoint in either format, in eval mode.

    Args:
        path: our checkpoint or the authors' `.pth.tar`.
        map_location: a device ('cpu', 'cuda', 'cuda:N', 'mps', or 'auto': CUDA where there is
            one), checked as `Matcher` checks it; else (a mapping, a function) passed to `torch.load`.
        vocab: a Vocabulary (or its dict, or a JSON path) to attach; defaults to the one stored
            in the checkpoint (the authors' files have none). One that differs from the stored
            one is refused (`vocabulary_conflict`): its word ids are not the ones the model learned.
    """
    if isinstance(map_location, (str, torch.device)):   # 'cuda' without CUDA had called a good file unreadable
        from sgraf.devices import resolve_device

        map_location = resolve_device(map_location, "map_location")
    checkpoint = load_checkpoint(path, map_location)
    config = _model_config(checkpoint, path)
    model = checked_model(config, checkpoint["state_dict"], str(path))
    model.vocab = resolve_vocab(vocab, source="the vocabulary given") if vocab is not None else \
        resolve_vocab(checkpoint.get("vocab"), source=str(path))
    if model.vocab is not None and _vocab_size(model.vocab) != config.vocab_size:
        raise InputError(f"{path}: the vocabulary has {_vocab_size(model.vocab)} words but the model's "
                         f"embedding has vocab_size={config.vocab_size}")
    extra = checkpoint.get("extra")
    train_config = extra.get("train_config") if isinstance(extra, dict) else None
    model.train_config = train_config if isinstance(train_config, dict) else None   # a run's best.pt records it
    if vocab is not None:
        name = getattr(model.vocab, "source", None) or vocab
        _refuse_other_word_ids(path, checkpoint.get("vocab"), model.vocab, name)
    return model.eval()


def _refuse_other_word_ids(path: str | os.PathLike, stored: Any, given: Any, name: Any) -> None:
    """`vocabulary_conflict` when the vocabulary `given` for the checkpoint at `path` has other
    word ids than the one it stores (`stored`, its dict; none stored: nothing to hold it to)."""
    if isinstance(stored, dict) and _vocab_dict(given).get("word2idx") != stored.get("word2idx"):
        raise vocabulary_conflict(path, name)


def vocabulary_conflict(path: str | os.PathLike, given: Any) -> InputError:
    """The refusal of a vocabulary given for a checkpoint that stores another one: the word ids
    would not be the ones the model learned, and every score would be wrong without an error."""
    name = given if isinstance(given, (str, os.PathLike)) else "the vocabulary given"
    return InputError(f"{path} carries its own vocabulary, which differs from {name} (other word ids: the scores "
                      "would be wrong); leave out --vocab: the checkpoint's own is the one its model learned")


def convert_official(src: str | os.PathLike, dst: str | os.PathLike, vocab: Any = None) -> dict[str, Any]:
    """Turn an official `.pth.tar` (or our own file) into our format at `dst`; returns the dict written.

    Raises:
        InputError: `dst` is `src` or the vocabulary file (under any name), or either is unreadable.
    """
    from sgraf.io_paths import check_outputs

    vocab_file = vocab if isinstance(vocab, (str, os.PathLike)) else None
    check_outputs([("SRC", src), ("--vocab", vocab_file)], [("DST", dst)])
    checkpoint = load_checkpoint(src)
    config = _model_config(checkpoint, src)
    checked_model(config, checkpoint["state_dict"], str(src))
    resolved = resolve_vocab(vocab, source="the vocabulary given") if vocab is not None else checkpoint.get("vocab")
    if vocab is not None:
        _refuse_other_word_ids(src, checkpoint.get("vocab"), resolved, vocab)
    if resolved is not None and _vocab_size(resolved) != config.vocab_size:
        raise InputError(f"the vocabulary has {_vocab_size(resolved)} words but {src} has "
                         f"vocab_size={config.vocab_size}")
    checkpoint["vocab"] = _vocab_dict(resolved)
    checkpoint["version"] = VERSION
    atomic_save(on_disk(checkpoint), dst)
    logger.info("converted %s to %s", src, dst)
    return checkpoint
