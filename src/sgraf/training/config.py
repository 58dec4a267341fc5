"""Training configuration: a frozen dataclass, named presets, YAML files and `key=value` overrides.

A configuration is resolved in layers, each overriding the one before:
the `TrainConfig` defaults, a named preset, a YAML file, then `--set key=value` pairs.
Unknown keys are rejected with the list of valid ones, values are coerced to the field's type
(`--set lr=1e-4`, `--set bi_gru=false`, `--set img_dim=none`).

The model's hyper-parameters are fields here too (flat, so `--set sgr_step=4` works); they
become a `sgraf.config.ModelConfig` once the vocabulary size is known (`model_config`).
`img_dim` and `num_regions` may be left to the data (`None`); a recipe that names them is
checked against the data before the first step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from sgraf.config import (ALIGNMENTS, ATTENTIONS, MODULES, POSITIONS, PRECISIONS, SIMILARITIES, ModelConfig,
                          unused_settings)
from sgraf import text_files
from sgraf.errors import InputError, plain_integer

logger = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1
BATCHES = ("random", "families")  # numpy's legacy seeding takes 0 .. 2**32 - 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the data folder and the run folder.

    The defaults are the authors' Flickr30K SGR recipe (official.md) at the paper's size.

    Attributes:
        module: 'sgr', 'saf', 'ave' (one head, trained alone) or 'joint' (one similarity
            representation feeding SGR and SAF, trained with L_r + L_f, Table 5).
        img_dim: region feature size; None takes it from the data, a number must match it.
        num_regions: regions per image; None takes it from the data, a number must match it.
        word_dim: the model's `word_dim` (see `sgraf.config.ModelConfig`).
        embed_size: the model's `embed_size` (see `sgraf.config.ModelConfig`).
        sim_dim: the model's `sim_dim` (see `sgraf.config.ModelConfig`).
        num_layers: the model's `num_layers` (see `sgraf.config.ModelConfig`).
        bi_gru: the model's `bi_gru` (see `sgraf.config.ModelConfig`).
        img_norm: the model's `img_norm` (see `sgraf.config.ModelConfig`).
        txt_norm: the model's `txt_norm` (see `sgraf.config.ModelConfig`).
        sgr_step: the model's `sgr_step` (see `sgraf.config.ModelConfig`).
        alignments: the model's `alignments` (see `sgraf.config.ModelConfig`).
        similarity: the model's `similarity` (see `sgraf.config.ModelConfig`).
        attention: the model's `attention` (see `sgraf.config.ModelConfig`).
        lambda_softmax: the model's `lambda_softmax` (see `sgraf.config.ModelConfig`).
        dropout: the model's `dropout` (see `sgraf.config.ModelConfig`).
        positions: the model's `positions` (see `sgraf.config.ModelConfig`; other than 'none' it
            needs the data's region boxes, `sgraf.data.boxes`).
        place_sharpness: the model's `place_sharpness` (see `sgraf.config.ModelConfig`).
        place_penalty: the model's `place_penalty` (see `sgraf.config.ModelConfig`).
        epochs: passes over the training captions.
        batch_size: captions (each with its image) per optimisation step, over all processes.
        lr: Adam's initial learning rate.
        lr_update: the learning rate is multiplied by 0.1 every `lr_update` epochs.
        grad_clip: clip the global gradient norm to this value (0 disables clipping).
        margin: hinge margin of the ranking loss.
        max_violation: hardest negatives only (VSE++); False sums over all negatives.
        warmup_epochs: with `max_violation`, sum the hinge over all negatives for the first
            N epochs, then take the hardest negatives (0: hardest from the first step, the
            authors' loss). Trained from scratch, hardest negatives can sit on the plateau of
            a constant score; a summed warm-up leaves it (docs/getting-started.md, the demo's loss).
        same_image_positive: do not count another caption of the batch's same image as a
            negative (off in the authors' code).
        pair_backward: with hardest negatives and a batch of at least 32, run the backward pass
            through the pairs the loss reads only (at most three per caption), not the whole
            score matrix: the same gradients up to float rounding, for SGR and AVE models
            (`sgraf.training.pairs`); false backpropagates through every pair, as the authors' code.
        batches: 'random' (the authors' batches: captions in a random order) or 'families':
            each batch holds whole families of hard negatives (one caption of each picture of
            a family), and a caption is not a negative of a family picture it is true of
            (`sgraf.training.families`; needs the `train_scenes.jsonl` of `sgraf generate`).
        family_share: with batches='families', the share of families drawn whole each epoch
            (chosen anew per epoch); the captions of the others are drawn one by one, like random
            batches, so each batch mixes families of hard negatives with random ones (1: whole
            families only).
        global_loss_weight: weight of an auxiliary ranking loss on the cosines of the
            self-attention global vectors (0: off, the authors' loss). It makes those vectors a
            retrieval embedding, so a search shortlist on them loses little (docs/guides/search-and-serve.md).
        seed: seeds the initialisation, the shuffling and dropout.
        precision: 'fp32', 'bf16' or 'fp16' autocast (fp16 uses a gradient scaler).
        tf32: on CUDA, let float32 matmuls and cuDNN (the GRU) use TF32 (faster, 10-bit
            mantissa); off by default, so fp32 stays exact float32.
        device: 'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'.
        workers: DataLoader worker processes (0 loads in the main process).
        val_max_captions: validate on the first N dev captions (the authors use 5000);
            None validates on the whole dev split.
        val_batch_size: batch size of the validation encoders.
        val_every: also validate every N optimisation steps (0: only after each epoch).
        patience: stop early once N epochs in a row have ended without a better dev rsum (a
            better one from any validation of an epoch counts); 0 trains every epoch, as the
            authors do. A resume may change it (0 goes on past an early stop).
        checkpoint_every: write `last.pt` every N optimisation steps (0: only per epoch).
        log_every: update the progress bar's loss every N steps.
        vocab: vocabulary JSON; None looks beside the data, then builds one from the
            train and dev captions (words seen at least 4 times).
        progress: show a tqdm progress bar.
    """

    module: str = "sgr"
    img_dim: int | None = 2048
    num_regions: int | None = 36
    word_dim: int = 300
    embed_size: int = 1024
    sim_dim: int = 256
    num_layers: int = 1
    bi_gru: bool = True
    img_norm: bool = True
    txt_norm: bool = True
    sgr_step: int = 3
    alignments: str = "both"
    similarity: str = "vector"
    attention: str = "t2i"
    lambda_softmax: float = 9.0
    dropout: float = 0.4
    positions: str = "none"
    place_sharpness: float = 1.0
    place_penalty: bool = False
    epochs: int = 40
    batch_size: int = 128
    lr: float = 2e-4
    lr_update: int = 30
    grad_clip: float = 2.0
    margin: float = 0.2
    max_violation: bool = True
    warmup_epochs: int = 0
    same_image_positive: bool = False
    pair_backward: bool = True
    batches: str = "random"
    family_share: float = 1.0
    global_loss_weight: float = 0.0
    seed: int = 0
    precision: str = "fp32"
    tf32: bool = False
    device: str = "auto"
    workers: int = 0
    val_max_captions: int | None = 5000
    val_batch_size: int = 128
    val_every: int = 0
    patience: int = 0
    checkpoint_every: int = 500
    log_every: int = 10
    vocab: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        # values given in Python as strings ("1e-3", "false") take their field's type, as YAML's and
        # --set's do; a value of no fitting type (None for a number) is an InputError naming the key
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            coerced = _coerce(field.name, value, "TrainConfig")
            if coerced is not value:
                object.__setattr__(self, field.name, coerced)
        choices = {"module": MODULES, "alignments": ALIGNMENTS, "similarity": SIMILARITIES,
                   "attention": ATTENTIONS, "precision": PRECISIONS, "positions": POSITIONS,
                   "batches": BATCHES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"training config field {name!r} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("epochs", "batch_size", "lr_update", "word_dim", "embed_size", "sim_dim",
                     "num_layers", "sgr_step", "val_batch_size"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("log_every", self.log_every, minimum=1)
        for name in ("workers", "val_every", "patience", "checkpoint_every", "warmup_epochs"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        for name in ("img_dim", "num_regions", "val_max_captions"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for field in dataclasses.fields(self):   # inf passes every range check below
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"training config field {field.name!r} must be a finite number, got {value!r}")
        if not self.lr > 0:
            raise InputError(f"training config field 'lr' must be > 0, got {self.lr!r}")
        if self.grad_clip < 0 or self.margin < 0:
            raise InputError("training config fields 'grad_clip' and 'margin' must be >= 0, "
                             f"got {self.grad_clip!r} and {self.margin!r}")
        if not 0.0 < self.family_share <= 1.0:
            raise InputError(f"training config field 'family_share' must be in (0, 1], got {self.family_share!r}")
        if self.family_share < 1.0 and self.batches != "families":
            raise InputError(f"training config field 'family_share' ({self.family_share!r}) is the share of families "
                             f"drawn whole: it needs batches=families, got batches={self.batches!r}")
        if self.global_loss_weight < 0:
            raise InputError(f"training config field 'global_loss_weight' must be >= 0, got {self.global_loss_weight!r}")
        if self.global_loss_weight > 0 and self.alignments == "local":
            raise InputError("training config field 'global_loss_weight' needs the global vectors: alignments must be "
                             "'both' or 'global', got 'local'")
        if self.warmup_epochs and not self.max_violation:
            raise InputError("training config field 'warmup_epochs' sums the hinge over all negatives before "
                             "switching to the hardest ones: it needs max_violation=true (with "
                             f"max_violation=false the loss is summed throughout), got warmup_epochs={self.warmup_epochs}")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"training config field 'dropout' must be in [0, 1), got {self.dropout!r}")
        if not (isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device.strip())):
            raise InputError(f"training config field 'device' must be auto, cpu, cuda or cuda:N (training does not "
                             f"run on mps), got {self.device!r}")
        # the model's own rules across its fields (ModelConfig's messages), before any data is read
        self.model_config(1, self.img_dim or 1, self.num_regions or 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        """Builds a config from plain values, coercing strings; `source` names them in errors."""
        return cls(**_coerce_all(values, source))

    def replace(self, **changes: Any) -> "TrainConfig":
        return _from_preset(dataclasses.replace(self, **_coerce_all(changes, "override")), self.preset)

    @property
    def preset(self) -> str | None:
        """The preset `resolve_config` started this config from (kept by `replace`), which `fit`
        records in config.yaml when it is given none; None for a config built otherwise. Not a
        field: two configs of the same values are equal whichever preset they came from."""
        return self.__dict__.get("_preset")

    def loss_for_epoch(self, epoch: int) -> "TrainConfig":
        """The config whose loss fields hold during 0-based `epoch`: summed during a warm-up."""
        if epoch < self.warmup_epochs:
            return dataclasses.replace(self, max_violation=False, warmup_epochs=0)
        return self

    def model_config(self, vocab_size: int, img_dim: int, num_regions: int) -> ModelConfig:
        """The `ModelConfig` of this recipe for a vocabulary and data of the given sizes."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)
                  if f.name not in ("vocab_size", "img_dim", "num_regions")}
        return ModelConfig(vocab_size=vocab_size, img_dim=img_dim, num_regions=num_regions, **values)


def patience_ran_out(patience: Any, epochs_done: int, best_epoch: int | None) -> bool:
    """The early stop's rule, for the training loop (from its progress) and `sgraf runs` (from a
    run's records) alike: `patience` (> 0) epochs have ended since `best_epoch`, the epoch of the
    best dev rsum (None before any validation)."""
    return (isinstance(patience, int) and not isinstance(patience, bool) and patience > 0
            and best_epoch is not None and epochs_done - best_epoch >= patience)


# Keys that may change when a run is resumed; the others define the run and stay as recorded.
RESUMABLE_KEYS = ("epochs", "patience", "val_every", "checkpoint_every", "log_every", "workers", "device",
                  "progress", "val_batch_size", "tf32")


def fixed_keys_changed(recorded: TrainConfig, changes: dict[str, Any]) -> list[str]:
    """The keys of `changes` (key -> new value) outside `RESUMABLE_KEYS` whose value differs from
    the run's `recorded` one, in config order (a key set to its recorded value is no change)."""
    return [f.name for f in dataclasses.fields(TrainConfig)
            if f.name in changes and f.name not in RESUMABLE_KEYS and changes[f.name] != getattr(recorded, f.name)]


def check_resumable(recorded: TrainConfig, config: TrainConfig, run: str) -> None:
    """Refuses to resume the run `run`, configured as `recorded`, with a `config` that differs in
    a key outside `RESUMABLE_KEYS` (InputError naming each such key with both values)."""
    keys = fixed_keys_changed(recorded, {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)})
    changed = [f"{key}={getattr(config, key)!r} (the run's: {getattr(recorded, key)!r})" for key in keys]
    if changed:
        raise InputError(f"cannot resume {run} with another config: {', '.join(changed)}; a resume may change only "
                         f"{', '.join(RESUMABLE_KEYS)}")


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise InputError(f"training config field {name!r} must be an integer {bounds}, got {value!r}")


# The authors' recipes (official.md): Adam 2e-4, batch 128, clip 2.0, margin 0.2, hardest
# negatives, 2048-d features of 36 regions, validation on the first 5000 dev captions.
_PAPER = dict(img_dim=2048, num_regions=36, batch_size=128, lr=2e-4, grad_clip=2.0, margin=0.2,
              max_violation=True, val_max_captions=5000, workers=4)

PRESETS: dict[str, dict[str, Any]] = {
    "f30k-sgr": dict(_PAPER, module="sgr", epochs=40, lr_update=30),
    "f30k-saf": dict(_PAPER, module="saf", epochs=30, lr_update=20),
    "coco-sgr": dict(_PAPER, module="sgr", epochs=20, lr_update=10),
    "coco-saf": dict(_PAPER, module="saf", epochs=20, lr_update=10),
    # The embedded benchmark (`sgraf generate`): a few minutes on a laptop CPU. At these sizes
    # and step counts the hardest-negative loss sits on its plateau (every score equal, loss
    # 2 * batch * margin) for longer than the whole run, so the small presets sum over all
    # negatives, with a larger learning rate.
    "demo": dict(module="sgr", img_dim=None, num_regions=None, word_dim=64, embed_size=128,
                 sim_dim=64, sgr_step=3, epochs=6, lr_update=4, batch_size=64, lr=2e-3,
                 max_violation=False, val_max_captions=None, checkpoint_every=100, log_every=5),
    # The smallest configuration that still learns; the tests train it.
    "tiny": dict(module="sgr", img_dim=None, num_regions=None, word_dim=16, embed_size=32,
                 sim_dim=16, sgr_step=2, epochs=2, lr_update=10, batch_size=8, lr=1e-2, max_violation=False,
                 val_max_captions=None, val_batch_size=64, checkpoint_every=5, log_every=1,
                 progress=False),
}


def preset(name: str) -> TrainConfig:
    """The named recipe (`f30k-sgr`, `f30k-saf`, `coco-sgr`, `coco-saf`, `demo`, `tiny`)."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return _from_preset(TrainConfig.from_dict(PRESETS[name], source=f"preset {name}"), name)


def valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


# Keys a YAML file may hold besides the config fields (a run's config.yaml records them).
_FILE_ONLY_KEYS = ("data", "preset", "sgraf_version", "data_fingerprint")


def load_config_file(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a YAML training config.

    Returns:
        (fields, extras): config fields to apply, and the file-only keys (`data`, `preset`,
        `sgraf_version`, `data_fingerprint`) it holds.
    """
    import yaml

    path = pathlib.Path(path)
    try:
        text = text_files.read_text(path, "a UTF-8 YAML file of config keys")
    except FileNotFoundError:
        raise FileNotFoundError(2, "training config file not found", str(path)) from None
    try:
        values = yaml.load(text, Loader=_loader_refusing_repeated_keys(str(path)))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}:{where} not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise InputError(f"{path}: expected a mapping of config keys to values, got {type(values).__name__}")
    extras = {k: values.pop(k) for k in _FILE_ONLY_KEYS if k in values}
    return _coerce_all(values, str(path)), extras


def _loader_refusing_repeated_keys(source: str) -> type:
    """A `yaml.SafeLoader` that refuses a mapping holding a key twice (PyYAML keeps the last
    value without a word: `epochs: 1` then `epochs: 3` trained 3 epochs)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    hash(key)
                except TypeError:                   # a list as a key: SafeLoader names it below
                    continue
                if key in seen:
                    raise InputError(f"{source}: line {line}: key {key!r} is given again (first on line "
                                     f"{seen[key]}); give each key once")
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader


def parse_overrides(pairs: str | Iterable[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Parses `key=value` strings (one string is one pair; a mapping gives the values as they are),
    each value coerced against its field's type."""
    if isinstance(pairs, Mapping):       # from Python: named as the argument it came in
        return _coerce_all(dict(pairs), "overrides")
    overrides: dict[str, Any] = {}
    for pair in [pairs] if isinstance(pairs, str) else pairs:
        if not isinstance(pair, str):
            raise InputError(f"--set expects key=value strings, got {type(pair).__name__} {pair!r}")
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--set expects key=value, got {pair!r}")
        more = [word.partition("=")[0] for word in value.split()[1:] if "=" in word]
        if more and more[0] in {field.name for field in dataclasses.fields(TrainConfig)}:
            raise InputError(f"--set {pair!r} holds several pairs in one string ({key}, then {more[0]}): give each "
                             "its own (--set a=1 b=2 on the command line, a list or a dict in Python)")
        if key in overrides and overrides[key] != value.strip():
            raise InputError(f"--set {key} is given twice ({overrides[key]}, then {value.strip()}): give it once")
        overrides[key] = value.strip()
    return _coerce_all(overrides, "--set")


def resolve_config(preset_name: str | None = None, config_file: str | pathlib.Path | None = None,
                   overrides: str | Iterable[str] | Mapping[str, Any] = ()) -> tuple[TrainConfig, dict[str, Any]]:
    """Defaults, then a preset, then a YAML file, then `key=value` overrides (`--set`'s strings,
    or a mapping of keys to values).

    Returns:
        The config and the YAML file's extra keys (e.g. `data`).
    """
    values: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    if config_file is not None:
        file_values, extras = load_config_file(config_file)
        if preset_name is None and extras.get("preset"):
            preset_name = str(extras["preset"])
        elif extras.get("preset") and str(extras["preset"]) != preset_name:
            logger.warning("%s names preset %s; the preset given, %s, is the one taken", config_file,
                           extras["preset"], preset_name)
    if preset_name is not None:
        if preset_name not in PRESETS:
            raise InputError(f"unknown preset {preset_name!r}; available: {', '.join(PRESETS)}")
        values.update(PRESETS[preset_name])
    given: dict[str, str] = {}          # the keys the caller set, by where (not a preset's)
    if config_file is not None:
        values.update(file_values)
        given.update({key: str(config_file) for key in file_values})
    parsed = parse_overrides(overrides)
    values.update(parsed)
    given.update({key: "overrides" if isinstance(overrides, Mapping) else "--set" for key in parsed})
    try:
        config = TrainConfig.from_dict(values)
    except InputError as error:        # a rule across the fields: say where the caller gave the value
        fields = re.match(r"training config fields? ('\w+'(?: and '\w+')*)", str(error))
        named = [key for key in re.findall(r"'(\w+)'", fields.group(1)) if key in given] if fields else []
        if not named:
            raise
        raise InputError(f"{given[named[0]]}: {error}") from None
    # a key at its default (the preset's, where one is used) changes nothing either way: a run's own
    # config.yaml reused as --config lists every key; sgr_step=3 over the tiny preset's 2 is a change
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    defaults.update(PRESETS[preset_name] if preset_name is not None else {})
    for key, why in unused_settings(config.to_dict()).items():
        if key in given and getattr(config, key) != defaults.get(key):
            logger.warning("%s: %s=%s has no effect: %s", given[key], key, getattr(config, key), why)
    return _from_preset(config, preset_name), extras


def _from_preset(config: TrainConfig, name: str | None) -> TrainConfig:
    """`config`, remembering the preset it started from (`TrainConfig.preset`)."""
    if name is not None:
        object.__setattr__(config, "_preset", name)
    return config


# The authors' option names (official.md) that differ from ours.
_AUTHOR_NAMES = {"learning_rate": "lr", "num_epochs": "epochs", "module_name": "module", "n_regions": "num_regions",
                 "no_imgnorm": "img_norm", "no_txtnorm": "txt_norm", "workers": "workers", "val_step": "val_every"}


_INVERTED = ("no_imgnorm", "no_txtnorm")    # the authors' negated switches


def reject_unknown_keys(keys: Iterable[str], source: str, allowed: Sequence[str] | None = None) -> None:
    """InputError naming each of `keys` that is not a config key (with the closest one, or ours
    for an authors' option name) and listing the valid keys: every field, or `allowed` where the
    caller sets the others itself (`sgraf demo --set`)."""
    allowed = list(valid_keys() if allowed is None else allowed)
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        hints = []
        import difflib
        for key in unknown:
            close = [_AUTHOR_NAMES[key]] if key in _AUTHOR_NAMES else difflib.get_close_matches(key, allowed, n=1)
            inverted = f", whose meaning is the opposite: {key}=true is {close[0]}=false" if key in _INVERTED else ""
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}{inverted}?)" if close else ""))
        raise InputError(f"{source}: unknown training config key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(hints)}; valid keys: {', '.join(allowed)}")


_FIELD_TYPES = typing.get_type_hints(TrainConfig)


def _coerce_all(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    reject_unknown_keys(values, source)
    return {key: _coerce(key, value, source) for key, value in values.items()}


def _coerce(key: str, value: Any, source: str) -> Any:
    """Converts `value` (often a string from the command line) to the type of field `key`."""
    hint = _FIELD_TYPES[key]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))):
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            text = str(value).strip()
            if not plain_integer(text):             # int() also reads '1_0' as 10
                raise ValueError
            return int(text)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if isinstance(value, os.PathLike):      # vocab=Path(...)
                return os.fspath(value)
            if key == "device" and type(value).__name__ == "device":    # a torch.device
                return str(value)
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:  # pragma: no cover - every field type is handled above
        raise AssertionError(f"unhandled field type {hint!r}")
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[base]
    raise InputError(f"{source}: training config key {key!r} expects {expected}"
                     f"{' or none' if optional else ''}, got {value!r}")
