"""`sgraf demo`: the whole pipeline on the embedded benchmark, in one command.

1. Generate the benchmark (`sgraf.data.benchmark`): CNN features of the rendered scenes when
   the vision extra is installed, otherwise its synthetic region features.
2. Train, independently, an SGR model, a SAF model and a global-only baseline (the paper's
   Table 3 row 1: FC + sigmoid on the global alignment alone, `alignments='global'`,
   `module='ave'`) with the training engine (`sgraf.training.fit`, the `demo` preset).
3. Evaluate each, and the SGRAF ensemble (the mean of the SGR and SAF score matrices), on
   the test split; print a table laid out like the paper's Table 1, and what each model tells
   apart in the benchmark's families (`sgraf.diagnose`: Winoground scores per kind of hard
   negative, truth-aware recall).
   With `positions` ('place' by default, 'box' or 'relation': `ModelConfig.positions`; issue
   21), also SAF and SGR with region positions ("SAF+pos", "SGR+pos") and their ensemble
   "SGRAF+pos", trained and evaluated the same way beside the paper's models; 'none' trains
   the paper's models only. The models train side by side, one per CPU core
   (`sgraf.training.pool`).
4. With several training seeds, repeat 2-3 per seed on the same data and report the mean and
   standard deviation of every figure.
5. Write a run folder: `report.md`, `results.json`, the training curves, the per-kind group
   scores (the tables, the report and these two pictures: `sgraf.demo_report`), retrieval
   examples (through a gallery index and two-stage search) and attention pictures
   (`sgraf.explain`), the pictures from the first seed's models. The index, which `sgraf serve`
   searches, and those pictures are the place models' ensemble's where they were trained
   (`served_ensemble`), else the paper's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from sgraf.atomic_write import ensure_folder, missing_folders, taken_back_on_failure, write_text
from sgraf.significance import chance_rsum
from sgraf.demo_report import (draw_curves, draw_diagnosis, format_diagnosis, format_table, mean_sd, story,
                               story_tests, write_report)
from sgraf.errors import InputError
from sgraf.folder_lock import LOCK_FILE, FolderLock
from sgraf.output_folder import DEMO_MARKER
from sgraf.signals import Stopped

logger = logging.getLogger(__name__)

MARKER = DEMO_MARKER
METHODS = (  # label, training overrides
    ("global-only", {"module": "ave", "alignments": "global"}),
    ("SAF", {"module": "saf"}),
    ("SGR", {"module": "sgr"}),
)
# With `positions`: the paper's two heads again, with region positions (issue 21).
POSITION_METHODS = (
    ("SAF+pos", {"module": "saf"}),
    ("SGR+pos", {"module": "sgr"}),
)
# Each model's training time relative to global-only's (the one-seed demo at a387085, CNN
# features, one thread each on a 2-core Zen 3: 111, 272, 430, 289, 449 s): the longest start
# first when several train at once (`sgraf.training.pool`).
TRAINING_COST = {"global-only": 1.0, "SAF": 2.5, "SGR": 3.9, "SAF+pos": 2.6, "SGR+pos": 4.0}
ENSEMBLES = {"SGRAF": ("SGR", "SAF"), "SGRAF+pos": ("SGR+pos", "SAF+pos")}
# Training keys the demo sets itself (per model, per seed), so `--set` may not change them.
FIXED_KEYS = ("module", "alignments", "seed", "positions")


# How the position-aware models of each design are trained, beyond `positions` itself, per model:
# the place term learns its relation words from hard negatives, so 'place' draws half of the
# families whole; SGR + place also ranks the global vectors (the auxiliary loss of
# `global_loss_weight`), which lifts SGR off the plateau where it otherwise stayed on one seed in
# three (docs/positions.md, "SGR's plateau"). Both score with the places read from an attention
# twice as sharp as the nodes' (`place_sharpness`, chosen on the dev split: "Reading the places"),
# and their term only lowers a score (`place_penalty`: "The penalty").
_PLACE = {"batches": "families", "family_share": "0.5", "place_sharpness": "2", "place_penalty": "true"}
POSITION_RECIPES = {"place": {"SAF+pos": _PLACE, "SGR+pos": {**_PLACE, "global_loss_weight": "1"}}}


def methods(positions: str = "none") -> list[tuple[str, dict[str, str]]]:
    """The demo's models: (label, training overrides); with `positions` the position-aware ones too."""
    if positions == "none":
        return list(METHODS)
    recipes = POSITION_RECIPES.get(positions, {})
    return [*METHODS, *((label, {**changes, "positions": positions, **recipes.get(label, {})})
                        for label, changes in POSITION_METHODS)]


# Keys of the place term (`ModelConfig.place_sharpness`, `place_penalty`): `--set` gives them to
# the place models only (the paper's models refuse them).
PLACE_KEYS = ("place_sharpness", "place_penalty")


def model_overrides(settings: "DemoSettings", label: str, changes: dict[str, str],
                    extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The training overrides of the demo's model `label` (its `methods` `changes`): the demo's
    settings, `extra` (seed, progress), the model's own changes, then the user's `--set`, which
    win over a recipe's (the place term's keys only for a place model)."""
    place = changes.get("positions") == "place"
    user = [pair for pair in settings.user_overrides if place or pair.partition("=")[0] not in PLACE_KEYS]
    merged = dict(pair.partition("=")[::2] for pair in merge_overrides(
        settings.train_overrides, extra, (f"{key}={value}" for key, value in changes.items()), user))
    _drop_unused(merged, {pair.partition("=")[0] for pair in user})
    return tuple(f"{key}={value}" for key, value in merged.items())


def _drop_unused(values: dict[str, str], given: set[str]) -> None:
    """The demo's settings that have no effect in this model left out (`sgraf.config.unused_settings`):
    `--quick`'s `sgr_step` in a SAF model had been warned of as if the user had set it, and a
    place recipe's `family_share` under `--set batches=random` is refused without family batches.
    One the user gave stays, to be said (or refused) in its name."""
    from sgraf.config import unused_settings

    for key in unused_settings(values):
        if key not in given:
            values.pop(key, None)


def recipe_text(positions: str, user: Iterable[str] = ()) -> str:
    """How the position-aware models of `positions` are trained beyond the demo's settings, in words
    ('' when as the paper's models): "SAF+pos with `batches=families ...`, SGR+pos with `...`";
    the user's `--set` values in place of the recipe's, and the place term's keys they set."""
    recipes = POSITION_RECIPES.get(positions, {})
    given = dict(pair.partition("=")[::2] for pair in user)
    texts = []
    for label, _ in POSITION_METHODS:
        recipe = {**recipes.get(label, {})}
        recipe.update({key: value for key, value in given.items()
                       if key in recipe or (positions == "place" and key in PLACE_KEYS)})
        if recipe.get("batches", "families") != "families" and "family_share" not in given:
            recipe.pop("family_share", None)        # a share of families drawn whole: none drawn
        if recipe:
            texts.append(f"{label} with `{' '.join(f'{k}={v}' for k, v in recipe.items())}`")
    return ", ".join(texts)


def served_ensemble(positions: str) -> str:
    """The ensemble whose index the demo writes, and whose retrieval and attention pictures it
    draws: "SGRAF+pos" where its models read places ('place': the only positions that learn
    relations, and the better SGRAF on every figure of the demo's three seeds but attribute, within
    its sd), else the paper's "SGRAF" (with 'box' or 'relation' the paper's ensemble is as good)."""
    return "SGRAF+pos" if positions == "place" else "SGRAF"


def run_name(label: str) -> str:
    """The folder of a model's run under `runs/`: 'sgr', 'global-only', 'sgr-pos'."""
    return label.lower().replace("+", "-")


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run.

    Attributes:
        n_train, n_dev, n_test: images per split (5 captions each).
        train_overrides: `key=value` training overrides applied over the `demo` preset (the
            user's `--set` included, but for the place term's keys, which only the place models
            take).
        positions: 'none', or the `ModelConfig.positions` of the position-aware models trained
            beside the paper's ones.
        user_overrides: the user's `--set` pairs, applied last to every model that takes them
            (over the position-aware models' recipes too: `model_overrides`).
    """

    n_train: int
    n_dev: int
    n_test: int
    train_overrides: tuple[str, ...]
    positions: str = "none"
    user_overrides: tuple[str, ...] = ()


def merge_overrides(*groups: Iterable[str]) -> tuple[str, ...]:
    """`key=value` overrides with each key once: a later value replaces an earlier one in place."""
    merged: dict[str, str] = {}
    for group in groups:
        for pair in group:
            key, _, value = pair.partition("=")
            merged[key] = value
    return tuple(f"{key}={value}" for key, value in merged.items())


# The `demo` preset, smaller. Trained from scratch with hardest negatives only (the authors'
# max_violation), these models stayed at the loss of a constant score (2 x margin x batch) on
# this benchmark, and a one-epoch summed warm-up did not lift them off it (rsum 91-134); summed
# violations learn from the first epoch. The full demo sums them until the learning rate drops
# (epoch 6) and takes the authors' hardest negatives for the last two epochs: over 3 seeds that
# gave every model a higher test rsum than summing throughout (measured; docs/getting-started.md, "The loss").
_SMALL = ("embed_size=64", "sim_dim=32", "word_dim=32", "batch_size=32", "lr=5e-4", "max_violation=false",
          "checkpoint_every=0")
FULL = DemoSettings(n_train=1500, n_dev=100, n_test=300,
                    train_overrides=merge_overrides(_SMALL, ("epochs=8", "lr_update=6", "max_violation=true",
                                                             "warmup_epochs=6")))
QUICK = DemoSettings(n_train=96, n_dev=24, n_test=32,
                     train_overrides=merge_overrides(_SMALL, ("epochs=1", "word_dim=16", "embed_size=32",
                                                              "sim_dim=16", "sgr_step=2")))


def _choose_features(features: str) -> tuple[str, Any]:
    """('cnn', backbone) when asked for or available ('auto'), else ('synthetic', None)."""
    if features == "synthetic":
        return "synthetic", None
    from sgraf.data.features import efficientnet_lite0

    try:
        return "cnn", efficientnet_lite0()
    except InputError as error:
        if features == "cnn":
            raise
        logger.info("vision extra not installed (%s): using the benchmark's synthetic region features", error)
        return "synthetic", None


# What a demo writes at the top of its folder; removed when the next demo starts, so that a
# stopped demo never leaves the report of an earlier one beside its new runs. Only the files a
# demo recorded writing (`.sgraf-files.json`, see `sgraf.output_folder`) are ever removed: a file
# the user put under runs/ stays, one under index/ (which is replaced whole) is refused.
OUTPUTS = ("results.json", "report.md", "curves.png", "diagnose.png", "retrieval_t2i.png", "retrieval_i2t.png",
           "explain_positive.png", "explain_negative.png", "runs", "index")
_TOP_FILES = OUTPUTS[:-2]


def _prepare_out(out: Path) -> None:
    """Makes `out` a demo folder (refusing one with other content); the caller holds its lock."""
    from sgraf.output_folder import folder_files, read_record, record_files, remove_recorded

    content = [p for p in out.iterdir() if p.name != LOCK_FILE]
    if content and not (out / MARKER).exists():
        raise InputError(f"--out {out} is not empty and holds no earlier demo; choose another folder")
    recorded = set(read_record(out)) or _written_before_the_record(out)
    # the runs stay until the demo knows which it resumes (`_resume_or_remove`)
    earlier = [name for name in folder_files(out)
               if name.split("/")[0] in OUTPUTS and name.split("/")[0] != "runs" and name in recorded]
    foreign = [name for name in folder_files(out) if name.startswith("index/") and name not in recorded]
    if foreign:
        raise InputError(f"{out / foreign[0]} was not written by sgraf demo and would be deleted with the earlier "
                         "demo's index (sgraf deletes only files it wrote); move it away")
    write_text(out / MARKER, "written by sgraf demo; the folder is rewritten by the next demo run\n")
    remove_recorded(out, earlier)
    record_files(out, [*_TOP_FILES, *(name for name in recorded if name.startswith("runs/"))], "demo")


def _written_before_the_record(out: Path) -> set[str]:
    """The files a demo from before `.sgraf-files.json` wrote under `out`, known by their names:
    the report and pictures, each run folder's files, and the index's manifest and what it lists."""
    from sgraf.output_folder import folder_files
    from sgraf.training.run_dir import RUN_FILES, TENSORBOARD_DIR

    names = {name for name in _TOP_FILES if (out / name).is_file()}
    for name in folder_files(out):
        parts = name.split("/")
        if parts[0] == "runs" and (parts[-1] in RUN_FILES or TENSORBOARD_DIR in parts[:-1]):
            names.add(name)
    try:
        manifest = json.loads((out / "index" / "manifest.json").read_text(encoding="utf-8"))
        names.update(f"index/{name}" for name in [*manifest["files"], "manifest.json"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return names


def _data(out: Path, settings: DemoSettings, features: str, seed: int) -> dict[str, Any]:
    """Generate the benchmark, or reuse the one a previous demo left with the same settings."""
    from sgraf.data.benchmark import GENERATOR_VERSION, generate_benchmark

    data = out / "data"
    wanted_images = {"train": settings.n_train, "dev": settings.n_dev, "test": settings.n_test}
    meta_path = data / "benchmark.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_bytes())
        except ValueError:  # not JSON or not UTF-8: the benchmark is generated again
            logger.warning("%s is unreadable: generating the benchmark again", meta_path)
            meta = {}
        if isinstance(meta, dict) and meta.get("images") == wanted_images and meta.get("seed") == seed and meta.get(
                "generator_version") == GENERATOR_VERSION and (
                features == "auto" or meta.get("features") == features):
            changed = _changed_files(data, meta.get("fingerprint"))
            if changed == []:
                logger.info("reusing the benchmark in %s", data)
                return meta
            why = "has no record of its files (an earlier sgraf's)" if changed is None else (
                f"changed since it was generated ({', '.join(changed[:3])}"
                + (f" and {len(changed) - 3} more)" if len(changed) > 3 else ")"))
            logger.warning("the benchmark in %s %s: generating it again", data, why)
    kind, backbone = _choose_features(features)
    return generate_benchmark(data, seed=seed, features=kind, n_train=settings.n_train, n_dev=settings.n_dev,
                              n_test=settings.n_test, backbone=backbone, overwrite=True)


def _changed_files(data: Path, recorded: Any) -> list[str] | None:
    """The files of the benchmark in `data` that differ from its recorded fingerprint
    (`benchmark_fingerprint`; a file gone counts), or None when it has no record."""
    from sgraf.data.benchmark import benchmark_fingerprint
    from sgraf.data.precomp import fingerprint_differences

    if not isinstance(recorded, dict):
        return None
    try:
        return fingerprint_differences(benchmark_fingerprint(data), recorded)
    except OSError as error:
        return [os.path.basename(error.filename or "") or "a file"]


def _evaluate(models: dict[str, Any], split: Any, scenes: list[dict[str, Any]]
              ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Test metrics and diagnosis of each model and of the SGR + SAF ensemble; also the score matrices.

    Returns:
        ({label: `evaluate_sims` result}, {label: `diagnose_sims` result},
        {label: (n_images, n_captions) scores}).
    """
    from sgraf.diagnose import diagnose_sims
    from sgraf.evaluate import warn_saturated
    from sgraf.metrics import evaluate_sims
    from sgraf.scoring import average_matrices, encode_split, score_matrix

    sims: dict[str, np.ndarray] = {}
    for label, model in models.items():
        encoded = encode_split(model, split, model.vocab, batch_size=128)
        sims[label] = score_matrix([model], [encoded])
        warn_saturated(sims[label], [model])
    for ensemble, (first, second) in ENSEMBLES.items():
        if first in sims:
            sims[ensemble] = average_matrices([sims[first], sims[second]])
    results = {label: evaluate_sims(matrix) for label, matrix in sims.items()}
    diagnosis = {label: diagnose_sims(matrix, scenes) for label, matrix in sims.items()}
    return results, diagnosis, sims


def check_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    """The demo's `--set` pairs, refusing keys the demo sets itself and pairs without '='."""
    from sgraf.training.config import reject_unknown_keys, valid_keys

    pairs = tuple(overrides)
    given: dict[str, str] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise InputError(f"--set {pair}: expected KEY=VALUE")
        if given.get(key, value) != value:
            raise InputError(f"--set {key} is given twice ({given[key]}, then {value}): give it once")
        given[key] = value
        if key in FIXED_KEYS:
            raise InputError(f"--set {pair}: the demo sets {key} itself ({', '.join(FIXED_KEYS)} are per model or "
                             "per seed; use --seed and --seeds for the seeds)")
    # the keys a user may set here: not those the demo sets per model or seed
    reject_unknown_keys([pair.partition("=")[0] for pair in pairs], "--set",
                        [key for key in valid_keys() if key not in FIXED_KEYS])
    return pairs


def demo_settings(quick: bool, positions: str, overrides: Iterable[str] = ()) -> DemoSettings:
    """The demo's sizes and training settings with the user's `--set` pairs, each model's
    settings checked (a bad key or value is refused before anything runs, naming the model)."""
    from sgraf.training import resolve_config

    settings = replace(QUICK if quick else FULL, positions=positions)
    user = check_overrides(overrides)
    if not user:
        return settings
    place_keys = [pair for pair in user if pair.partition("=")[0] in PLACE_KEYS]
    if place_keys and positions != "place":
        raise InputError(f"--set {place_keys[0]}: a setting of the place term, and this demo trains no place "
                         f"model (--positions {positions})")
    settings = replace(settings, user_overrides=user,
                       train_overrides=merge_overrides(settings.train_overrides,
                                                       (pair for pair in user if pair not in place_keys)))
    resolve_config("demo", overrides=settings.train_overrides)   # what every model takes: said without a model
    for label, changes in methods(positions):
        try:
            resolve_config("demo", overrides=model_overrides(settings, label, changes))
        except InputError as error:
            raise InputError(f"{error} (the demo's {label} model)") from None
    return settings


def run_demo(out: str | os.PathLike[str] = "sgraf-demo", quick: bool = False, features: str = "auto",
             seed: int = 0, progress: bool = True, seeds: int = 1, overrides: Iterable[str] = (),
             positions: str = "place", jobs: int | None = None) -> dict[str, Any]:
    """Run the demo end to end (see the module docstring).

    Args:
        out: the run folder (created; a folder from an earlier demo is rewritten).
        quick: a small, fast configuration for smoke tests (under a minute on 2 CPU cores).
        features: 'auto' (CNN when the vision extra is installed; synthetic with `quick`),
            'cnn' or 'synthetic'.
        seed: the data seed, and the first training seed.
        progress: progress bars while training.
        seeds: training seeds `seed, seed + 1, ...`, each training every model on the same data;
            the first seed's runs are `runs/{label}`, the others `runs/seed-{s}/{label}`.
        overrides: `key=value` training overrides applied over the demo's settings (not
            module, alignments, seed or positions).
        positions: 'place' (the default), 'box' or 'relation': also train SAF and SGR with region
            positions of that design (`ModelConfig.positions`) and report them and their
            ensemble beside the paper's; 'none': the paper's models only.
        jobs: models trained at once, each in its own process on its share of the CPU cores
            (`sgraf.training.pool`); None: one per core on a CPU (a small model gains little
            from a second thread), one at a time on a GPU. With 1, in this process with
            progress bars.

    Returns:
        The content of `results.json`: settings, timings, the first seed's test metrics and
        diagnosis, every seed's, their mean and sd, the story check, and the pictures' paths.

    Raises:
        InputError: bad arguments, or `out` holds something else or is in use by another demo.
        Stopped: SIGTERM or SIGINT stopped a training run (its `last.pt` is saved; no results
            or report are written).
    """
    from sgraf.training.config import MAX_SEED

    from sgraf.config import POSITIONS

    if features not in ("auto", "cnn", "synthetic"):
        raise InputError(f"features must be auto, cnn or synthetic, got {features!r}")
    if positions not in POSITIONS:
        raise InputError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise InputError(f"jobs must be an integer >= 1, got {jobs!r}")
    if not isinstance(seeds, int) or seeds < 1 or seed + seeds - 1 > MAX_SEED:
        raise InputError(f"seeds must be an integer >= 1 with seed + seeds - 1 <= {MAX_SEED}, got {seeds!r}")
    settings = demo_settings(quick, positions, overrides)
    if quick and features == "auto":
        features = "synthetic"  # a smoke test should not spend its time in the CNN
    created = missing_folders(out)
    out = ensure_folder(out, "--out")
    with taken_back_on_failure(created), FolderLock(out):
        _prepare_out(out)
        return _run(out, settings, quick, features, seed, list(range(seed, seed + seeds)), progress, jobs)


def _jobs(out: Path, runs: Path, settings: DemoSettings, seed: int, progress: bool) -> list[Any]:
    """The `TrainJob` of every model of `methods(settings.positions)` with one seed, into
    `runs/{run_name(label)}`."""
    from sgraf.training import resolve_config
    from sgraf.training.pool import TrainJob

    jobs = []
    for label, changes in methods(settings.positions):
        overrides = list(model_overrides(settings, label, changes, (f"seed={seed}", f"progress={progress}")))
        config, _ = resolve_config("demo", overrides=overrides)
        logger.info("training %s (%s)", label, ", ".join(overrides))
        jobs.append(TrainJob(name=label, config=config, data=out / "data", run=runs / run_name(label),
                             preset="demo", cost=TRAINING_COST.get(label, 1.0)))
    return jobs


def _train(out: Path, jobs_by_seed: dict[int, list[Any]], workers: int, threads: int, seeds: list[int],
           timings: dict[str, float], cpu: dict[str, float]) -> dict[int, dict[str, dict[str, Any]]]:
    """Trains every seed's models, `workers` at a time (`sgraf.training.pool`); timings under
    `train {label}{suffix}` (each model's own), and `training` (the whole stage, wall clock).

    Raises:
        Stopped: a signal stopped the trainings (the running ones saved their `last.pt`)."""
    from sgraf.output_folder import folder_files, record_files
    from sgraf.training.pool import fit_all, without_progress
    from sgraf.training.run_dir import RUN_FILES, TENSORBOARD_DIR

    named = {}
    for training_seed, jobs in jobs_by_seed.items():
        suffix = f" seed {training_seed}" if len(seeds) > 1 else ""
        for job in jobs:
            named[f"{job.name}{suffix}"] = (training_seed, job)
    everything = [replace(job, name=name) for name, (_, job) in named.items()]
    if workers > 1:
        everything = [without_progress(job) for job in everything]
    for job in everything:
        relative = job.run.relative_to(out).as_posix()
        record_files(out, [f"{relative}/{name}" for name in RUN_FILES if name != TENSORBOARD_DIR], "demo")

    def done(job: Any, result: Any) -> None:
        logger.info("trained %s in %.0f s", job.name, result.wall_s)

    tic = time.perf_counter()
    try:
        results = fit_all(everything, workers=workers, threads=threads if workers > 1 else None, on_done=done)
    except Stopped as stop:
        raise Stopped(stop.signum, f"{stop.detail}; no results or report written (the same sgraf demo command "
                                   "resumes the trainings)") from None
    finally:   # event files are named as they are written
        for job in everything:
            relative = job.run.relative_to(out).as_posix()
            record_files(out, [f"{relative}/{TENSORBOARD_DIR}/{name}"
                               for name in folder_files(job.run / TENSORBOARD_DIR)], "demo")
    timings["training"] = time.perf_counter() - tic
    trained: dict[int, dict[str, dict[str, Any]]] = {training_seed: {} for training_seed in jobs_by_seed}
    for name, (training_seed, job) in named.items():
        result = results[name]
        timings[f"train {name}"], cpu[f"train {name}"] = result.wall_s, result.cpu_s
        trained[training_seed][job.name] = {"summary": result.summary, "config": job.config.to_dict()}
    return trained


def _resume_or_remove(out: Path, jobs_by_seed: dict[int, list[Any]]) -> tuple[dict[int, list[Any]], list[str]]:
    """The jobs whose run an earlier demo into `out` left with a last.pt, the same settings and the
    same data are resumed (a stopped demo goes on where it stopped; a finished run trains nothing);
    the earlier demo's other run files are removed. Returns the jobs and the resumed jobs' names."""
    from sgraf.folder_lock import FolderLock
    from sgraf.output_folder import read_record, remove_recorded
    from sgraf.training import run_dir as rd
    from sgraf.training.loop import run_fingerprint

    for jobs in jobs_by_seed.values():    # a run another process trains (a killed demo's worker): nothing removed
        for job in jobs:
            if job.run.is_dir():
                with FolderLock(job.run):
                    pass
    kept, resumed = {}, []
    fingerprints: dict[tuple[Path, str, str], dict[str, str]] = {}   # one data folder, a few kinds of run
    for training_seed, jobs in jobs_by_seed.items():
        kept[training_seed] = []
        for job in jobs:
            resume = False
            if (job.run / rd.LAST_CHECKPOINT).is_file() and (job.run / rd.CONFIG_FILE).is_file():
                try:
                    recorded = rd.load_run_config(job.run)[0]
                    if replace(recorded, progress=job.config.progress) == job.config:
                        key = (job.data, job.config.positions, job.config.batches)
                        if key not in fingerprints:     # the files the run reads, as `fit` records them
                            fingerprints[key] = run_fingerprint(job.config, job.data)
                        resume = rd.other_data(job.run, job.data, fingerprints[key]) is None
                except (InputError, OSError):
                    resume = False
            if resume:
                resumed.append(job.name + (f" seed {training_seed}" if len(jobs_by_seed) > 1 else ""))
                logger.info("resuming %s from %s (left by an earlier demo with these settings)", job.name,
                            job.run / rd.LAST_CHECKPOINT)
            kept[training_seed].append(replace(job, resume=resume))
    keep = [job.run.relative_to(out).as_posix() + "/" for jobs in kept.values() for job in jobs if job.resume]
    remove_recorded(out, [name for name in read_record(out)
                          if name.startswith("runs/") and not any(name.startswith(prefix) for prefix in keep)])
    return kept, resumed


def _on_gpu(device: str) -> bool:
    """Whether a training config's `device` puts the training on a GPU here (CUDA or MPS)."""
    from sgraf.devices import resolve_device

    return resolve_device(device).type != "cpu"


def _run(out: Path, settings: DemoSettings, quick: bool, features: str, seed: int, seeds: list[int],
         progress: bool, jobs: int | None = None) -> dict[str, Any]:
    """The demo's stages in a prepared folder (see `run_demo`)."""
    from sgraf.checkpoint import load_model
    from sgraf.data.benchmark import load_scenes
    from sgraf.data.precomp import PrecompSplit
    from sgraf.training.pool import plan_workers

    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    started, started_cpu = time.perf_counter(), time.process_time()
    meta = _data(out, settings, features, seed)
    timings["data"], cpu["data"] = time.perf_counter() - started, time.process_time() - started_cpu
    data = out / "data"

    runs_of = {training_seed: out / "runs" if training_seed == seeds[0] else out / "runs" / f"seed-{training_seed}"
               for training_seed in seeds}
    jobs_by_seed = {training_seed: _jobs(out, runs_of[training_seed], settings, training_seed, progress)
                    for training_seed in seeds}
    jobs_by_seed, resumed = _resume_or_remove(out, jobs_by_seed)
    first = jobs_by_seed[seeds[0]][0].config
    n_jobs = sum(len(seed_jobs) for seed_jobs in jobs_by_seed.values())
    workers, threads = plan_workers(n_jobs, jobs, on_gpu=_on_gpu(first.device))
    trained = _train(out, jobs_by_seed, workers, threads, seeds, timings, cpu)

    per_seed: list[dict[str, Any]] = []
    test = PrecompSplit(data, "test")
    scenes = load_scenes(data, "test")
    for training_seed in seeds:
        runs = runs_of[training_seed]
        suffix = f" seed {training_seed}" if len(seeds) > 1 else ""
        tic, tic_cpu = time.perf_counter(), time.process_time()
        models = {label: load_model(runs / run_name(label) / "best.pt") for label, _ in methods(settings.positions)}
        results, diagnosis, sims = _evaluate(models, test, scenes)
        timings[f"evaluate{suffix}"] = time.perf_counter() - tic
        cpu[f"evaluate{suffix}"] = time.process_time() - tic_cpu
        per_seed.append({"seed": training_seed, "runs": str(runs), "training": trained[training_seed],
                         "results": results, "diagnose": diagnosis})
        if training_seed == seeds[0]:
            first_models, first_sims = models, sims

    summary = {"results": mean_sd([entry["results"] for entry in per_seed]),
               "diagnose": mean_sd([entry["diagnose"] for entry in per_seed])}
    tic, tic_cpu = time.perf_counter(), time.process_time()
    served = served_ensemble(settings.positions)
    pictures = write_pictures(out, data, test, scenes, first_models, first_sims[served], served)
    pictures["diagnose"] = draw_diagnosis(summary["diagnose"], len(seeds), out / "diagnose.png")
    pictures["curves"] = draw_curves(out / "curves.png", {label: out / "runs" / run_name(label)
                                                          for label, _ in methods(settings.positions)})
    timings["pictures"], cpu["pictures"] = time.perf_counter() - tic, time.process_time() - tic_cpu
    timings["total"], cpu["total"] = time.perf_counter() - started, time.process_time() - started_cpu
    if workers > 1:   # the trainings ran in worker processes: their CPU time is theirs
        cpu["total"] += sum(value for key, value in cpu.items() if key.startswith("train "))

    where = (f"Test split of the embedded benchmark: {test.n_images} images, {test.n_captions} captions "
             f"({meta['features']} features)")
    if len(seeds) > 1:
        where += f"; mean \u00b1 sd over {len(seeds)} training seeds ({', '.join(map(str, seeds))})"
    # with one seed the summary's cells are that seed's figures (no sd): the same tables
    table = format_table(summary["results"], where)
    diagnosis_table = format_diagnosis(summary["diagnose"], "What each model tells apart in the test families (%)")
    record = {
        "settings": asdict(settings),
        "quick": quick,
        "seed": seed,
        "seeds": seeds,
        "training_workers": {"workers": workers, "threads": threads if workers > 1 else None},
        "resumed": resumed,
        "benchmark": meta,
        "training": per_seed[0]["training"],
        "results": per_seed[0]["results"],
        "diagnose": per_seed[0]["diagnose"],
        "per_seed": per_seed,
        "summary": summary,
        "story": {**story(summary["results"]), "tests": story_tests(first_sims, per_seed[0]["results"]),
                  "chance": chance_rsum(test.n_images, test.caps_per_image)},
        "timings_s": timings,
        "cpu_s": cpu,
        "pictures": pictures,
        "served": {"ensemble": served, "models": list(ENSEMBLES[served])},
        "table": table,
        "diagnosis_table": diagnosis_table,
    }
    write_text(out / "results.json", json.dumps(record, indent=1, default=str) + "\n")
    write_report(out, record, recipe_text(settings.positions, settings.user_overrides))
    return record


# --------------------------------------------------------------------------------- pictures
def write_pictures(out: Path, data: Path, test: Any, scenes: list[dict[str, Any]], models: dict[str, Any],
                   sims: np.ndarray, served: str) -> dict[str, str]:
    """The gallery index of the ensemble `served` (`served_ensemble`; with the test split's boxes
    where its models read places), retrieval examples through it (`sgraf.demo_retrieval`, queries
    picked on `sims`, that ensemble's score matrix of the table) and its attention pictures.

    Returns:
        {name: path relative to `out`}.
    """
    from sgraf.api import Matcher
    from sgraf.demo_retrieval import retrieval_pictures
    from sgraf.explain import explain_pair, region_layout, render_explanation
    from sgraf.output_folder import folder_files, record_files
    from sgraf.search import build_index, open_index

    pictures: dict[str, str] = {}
    members = ENSEMBLES[served]
    matcher = Matcher([models[label] for label in members],
                      sources=[str((out / "runs" / run_name(label) / "best.pt").resolve()) for label in members])
    boxes = test.boxes if matcher.needs_boxes else None
    build_index(matcher, test.images, test.captions, out / "index", caps_per_image=test.caps_per_image,
                source={"data_dir": str(data.resolve()), "split": "test"}, boxes=boxes)
    record_files(out, [f"index/{name}" for name in folder_files(out / "index")], "demo")
    index = open_index(out / "index", matcher=matcher)
    pictures.update(retrieval_pictures(index, test, scenes, sims, data, out))

    # attention: an image with its own caption and with the caption of its hard negative
    cpi = test.caps_per_image
    image_id = 0
    own = test.captions[:cpi]
    negative = next((c for c in test.captions[cpi:2 * cpi] if c not in own), test.captions[cpi])
    layout = region_layout(data, "test", image_id, test.num_regions)
    for name, caption, kind in (("explain_positive", own[0], "positive"), ("explain_negative", negative, "negative")):
        explanation = explain_pair(matcher, test.images[image_id], caption, allow_unknown=True,
                                   boxes=None if boxes is None else boxes[image_id])
        explanation.image_id = image_id
        render_explanation(explanation, layout, out / f"{name}.png",
                           title=f"{kind}: \u201c{caption}\u201d (test image {image_id})\nscore: "
                                 + ", ".join(f"{k} {v:.4f}" for k, v in explanation.scores.items()))
        pictures[name] = f"{name}.png"
    return {name: str(path) for name, path in pictures.items()}
