"""The training engine: one epoch, validation, and `fit` (a whole resumable run).

Each step is `sgraf.training.step.train_step` (the authors' step); an epoch takes the batches
of `EpochBatchSampler` (or, for family batches, `FamilyBatchSampler`), and `fit` builds the
model, its optimizer and data, validates, and writes the run folder (`sgraf.training.run_dir`).

Determinism: the initial weights come from `seed`, the order of the captions of epoch e from
(seed, e) alone (`EpochBatchSampler`), and dropout from torch's global generator, whose state
is saved in every checkpoint. A resumed run therefore takes exactly the steps an uninterrupted
one takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import random
import shlex
import time
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from sgraf import distributed
from sgraf.atomic_write import missing_folders, remove_empty_folders
from sgraf.devices import available_cores
from sgraf.errors import InputError, NonFiniteFeatures
from sgraf.folder_lock import FolderLock
from sgraf.kernels.memory import keep_freed_memory
from sgraf.precision import tf32, validation_precision
from sgraf.training import pairs
from sgraf.training import run_dir as rd
from sgraf.training.batches import PlannedBatches
from sgraf.training.config import TrainConfig, check_resumable, patience_ran_out
from sgraf.training.families import FamilyBatchSampler, TruthCollate
from sgraf.training.state import (STATE_KEY, Progress, StopSignals, ValidationCut, build_train_state,
                                  restore_train_state)
from sgraf.training.step import (NonFiniteLossError, StepResult, build_optimizer, learning_rate,
                                 make_grad_scaler, set_learning_rate, train_step)

logger = logging.getLogger(__name__)


# A vocabulary leaving more than this share of the training tokens unknown is refused (the
# model would learn from almost no words) unless asked for; above UNKNOWN_WARN_SHARE, a warning.
UNKNOWN_REFUSE_SHARE = 0.5
VOCAB_SAMPLE = 5000  # training captions tokenised to measure it (a share needs no more)


def loader_workers(asked: int) -> int:
    """`asked` DataLoader worker processes, at most the CPUs this process may use (the paper's
    presets ask for 4, as the authors' GPU machines ran; past the CPUs PyTorch warns that its
    loader may slow down or freeze). The batches do not depend on it: the samplers draw the
    order, the workers only read."""
    return min(asked, available_cores())


class EpochBatchSampler(PlannedBatches):
    """Batches of caption indices: a permutation that depends only on (seed, epoch).

    The last, partial batch is kept when it holds at least `max(2, world_size)` captions
    (BatchNorm in training mode needs two images). With several processes each batch is the
    global batch; rank r yields its contiguous share (`sgraf.distributed.shard_range`), so the
    shares concatenated in rank order are the batch of one process (`PlannedBatches`).

    Args:
        n_items: captions in the training split.
        batch_size: global batch size.
        seed: the run's seed.
        epoch: 0-based epoch.
        start_batch: batches of this epoch already taken (resume).
        rank, world_size: this process and how many share each batch.
    """

    def __init__(self, n_items: int, batch_size: int, seed: int, epoch: int, start_batch: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        order = np.random.default_rng([seed, epoch]).permutation(n_items)
        super().__init__([order[i:i + batch_size] for i in range(0, n_items, batch_size)], start_batch, rank,
                         world_size)


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
                    config: TrainConfig, progress: Progress, scaler: Any | None = None,
                    device: torch.device | str = "cpu",
                    after_step: Callable[[StepResult], bool] | None = None,
                    bar: Any | None = None) -> dict[str, float]:
    """Trains on the batches of `loader` (the rest of the epoch `progress.epoch`).

    The hinge is summed over all negatives while `progress.epoch` is in the config's warm-up
    (`TrainConfig.loss_for_epoch`), then follows `max_violation`.

    Args:
        after_step: called after each step (progress already advanced); returning True stops
            the epoch early (a signal, say).
        bar: a tqdm bar to advance.

    Raises:
        InputError: a `CheckedLoader` found NaN/inf features (naming the file and the image).

    Returns:
        {'loss': mean batch loss, 'steps': steps taken, 'seconds': wall time, 'stopped': 0/1}.
    """
    start, losses, stopped = time.perf_counter(), [], False
    config = config.loss_for_epoch(progress.epoch)   # summed hinge during a warm-up
    for batch in loader:
        result = train_step(model, optimizer, batch, config, scaler, device)
        losses.append(result.loss)
        progress.epoch_step += 1
        progress.global_step += 1
        progress.loss_sum += result.loss
        progress.loss_steps += 1
        if bar is not None:
            bar.update(1)
            if progress.global_step % config.log_every == 0:
                bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2g}")
        if after_step is not None and after_step(result):
            stopped = True
            break
    return {"loss": float(np.mean(losses)) if losses else float("nan"), "steps": len(losses),
            "seconds": time.perf_counter() - start, "stopped": float(stopped)}


def validate(model: nn.Module, split: Any, vocab: Any, config: TrainConfig,
             device: torch.device | str = "cpu", warn_place_term: bool = True,
             cut: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """Recalls and rsum of `model` on a split with the fast scorer (`sgraf.scoring`); on a GPU
    the matrix stays there and only the ranks come to the host (`sgraf.metrics`). A place model's
    term spread too (`place_term_spread`, its warning only if `warn_place_term`).

    `cut`: a context manager around the arithmetic (encoding, scoring, ranks) that a stop signal
    may interrupt (`StopSignals.cut_short`); the place term's spread, which sets the model's
    weights aside for a moment, runs outside it."""
    from sgraf.evaluate import warn_saturated
    from sgraf.metrics import evaluate_sims
    from sgraf.scoring import encode_split, score_matrix

    precision = validation_precision(config.precision)
    with cut():
        encoded = encode_split(model, split, vocab, batch_size=config.val_batch_size, precision=precision,
                               device=device)
        sims = score_matrix([model], [encoded], precision=precision, keep_on_device=True)
        warn_saturated(sims, [model])
        result = evaluate_sims(sims, caps_per_image=split.caps_per_image)
    if getattr(model.config, "positions", "none") == "place":
        result["place_term"] = place_term_spread(model, split, vocab, device, warn=warn_place_term)
    return result


VAL_FEW_IMAGES = 10           # a validation of this many dev images or fewer: every R@10 is 100
PLACE_TERM_SAMPLE = 32       # images (with one caption each) whose every pair `place_term_spread` reads
PLACE_TERM_WARN_RATIO = 1.5  # a place term more spread than this many times the heads' logits outweighs them


def place_term_spread(model: nn.Module, split: Any, vocab: Any, device: torch.device | str = "cpu",
                      warn: bool = True) -> dict[str, float]:
    """The sd and largest |value| of the place term a place model adds to its heads' logits, and
    the sd of those logits (the scores without the term, before the sigmoid; for a 'joint' model
    the logit of its heads' mean score), over every pair of
    the split's first `PLACE_TERM_SAMPLE` images and one caption of each, as it scores (eval mode,
    the places read at `place_sharpness`). With `warn`, a warning once the term's sd passes
    `PLACE_TERM_WARN_RATIO` times the logits': at their best checkpoints the demo's place models
    had 0.33 (SGR) and 0.92 (SAF) and went on learning; one trained on 300 pictures had 1.1, then
    2.6 while its dev rsum fell from 198 to 129."""
    from sgraf.data.precomp import first_pairs
    from sgraf.model.blocks import eval_mode

    batch = first_pairs(split, vocab, PLACE_TERM_SAMPLE, with_boxes=True)
    device = torch.device(device)
    term_module = model.sim_enc.place_term
    with eval_mode([model]), torch.no_grad():
        img_embs = model.encode_images(batch.images.to(device), batch.boxes.to(device))
        lengths = torch.as_tensor(batch.lengths)
        cap_embs = model.encode_captions(batch.captions.to(device), lengths)
        regions, centres = model.split_places(img_embs)
        mask = torch.arange(cap_embs.size(1), device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)
        term = model.sim_enc.place_offset(regions, centres, cap_embs, mask).double()
        saved = [parameter.clone() for parameter in term_module.relation.parameters()]
        try:    # D = 0: the term is zero, and the scores are the heads' alone
            for parameter in term_module.relation.parameters():
                parameter.zero_()
            alone = model.similarity(img_embs, cap_embs, lengths).double()
        finally:
            for parameter, value in zip(term_module.relation.parameters(), saved):
                parameter.copy_(value)
        logits = torch.logit(alone.clamp(1e-12, 1 - 1e-12))
    spread = {"sd": float(term.std()) if term.numel() > 1 else 0.0, "largest": float(term.abs().max()),
              "logit_sd": float(logits.std()) if logits.numel() > 1 else 0.0}
    if (warn and spread["sd"] > PLACE_TERM_WARN_RATIO * spread["logit_sd"] and model not in _WARNED_PLACE_TERM
            and distributed.is_main_process()):     # said once, not by every process of a torchrun job
        _WARNED_PLACE_TERM.add(model)
        logger.warning("the place term has grown to sd %.2f on dev (largest |term| %.1f) beside heads' logits of sd "
                       "%.2f: it outweighs what the heads learnt, and dev rsum may fall (best.pt keeps the best "
                       "validation). The place recipe was measured on the demo's benchmark, where the term stayed "
                       "under the logits' sd; on less data it can outgrow them (docs/positions.md)",
                       spread["sd"], spread["largest"], spread["logit_sd"])
    return spread


_WARNED_PLACE_TERM: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# ---------------------------------------------------------------------------------- fit

def _find_vocab(data_dir: pathlib.Path) -> pathlib.Path | None:
    """A vocabulary JSON beside the data: DATA/vocab.json, DATA/*vocab*.json, the authors' layout."""
    name = data_dir.name
    stem = name[: -len("_precomp")] if name.endswith("_precomp") else name
    candidates = [data_dir / "vocab.json", *sorted(data_dir.glob("*vocab*.json")),
                  data_dir.parent / f"{name}_vocab.json", data_dir.parent / f"{stem}_vocab.json",
                  data_dir.parent / "vocab" / f"{name}_vocab.json",
                  data_dir.parent.parent / "vocab" / f"{name}_vocab.json"]
    return next((c for c in candidates if c.is_file()), None)


def resolve_vocab(config: TrainConfig, data_dir: pathlib.Path, train: Any, dev: Any) -> Any:
    """The configured vocabulary, else one found beside the data, else one built from the
    train and dev captions (words seen at least 4 times, as the authors build theirs)."""
    from sgraf.data.captions import read_captions
    from sgraf.data.vocab import build_vocab, load_vocab

    if config.vocab is not None:
        return load_vocab(config.vocab)
    found = _find_vocab(data_dir)
    if found is not None:
        logger.info("vocabulary: %s", found)
        return load_vocab(found)
    logger.info("vocabulary: built from the train and dev captions of %s (min count 4)", data_dir)
    # every dev caption, as the authors' vocab.py reads the file: not only the first
    # `val_max_captions` that validation scores (the vocabulary had depended on that setting)
    dev_captions = dev.captions if dev.max_captions is None else read_captions(dev.caps_path)
    return build_vocab(list(train.captions) + list(dev_captions), min_count=4)


def check_data_fits(config: TrainConfig, splits: list[Any]) -> tuple[int, int]:
    """(img_dim, num_regions) of the data; InputError if a split differs from another or from
    the sizes the config names."""
    first = splits[0]
    dims = (first.feature_dim, first.num_regions)
    for split in splits[1:]:
        if (split.feature_dim, split.num_regions) != dims:
            raise InputError(f"{split.ims_path}: {split.num_regions} regions x {split.feature_dim} features per "
                             f"image, but {first.ims_path} has {dims[1]} x {dims[0]}")
    wanted = {"img_dim": (config.img_dim, dims[0], "feature size"),
              "num_regions": (config.num_regions, dims[1], "regions per image")}
    for key, (expected, found, what) in wanted.items():
        if expected is not None and expected != found:
            raise InputError(f"{first.ims_path}: {what} is {found} but the training config has {key}={expected}; "
                             f"use data of that shape, or --set {key}={found} (or {key}=none to take it from "
                             "the data)")
    return dims


def check_model_fits(model_config: Any, dims: tuple[int, int], source: str) -> None:
    """InputError if resumed weights were built for other feature sizes than the data's."""
    if (model_config.img_dim, model_config.num_regions) != dims:
        raise InputError(f"{source}: the model takes {model_config.num_regions} regions x {model_config.img_dim} "
                         f"features, but the data has {dims[1]} x {dims[0]}")


def _open_tensorboard(run: pathlib.Path, resumed_step: int | None = None) -> Any | None:
    """A SummaryWriter into `run/tensorboard`; a resumed run drops the events its killed
    predecessor logged after `resumed_step`, as `truncate_metrics` does for metrics.jsonl."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except (ImportError, ModuleNotFoundError):
        logger.debug("tensorboard is not installed: no event files")
        return None
    return SummaryWriter(log_dir=str(run / rd.TENSORBOARD_DIR), purge_step=resumed_step)


@contextlib.contextmanager
def _global_generators_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global random generators as they were before (a run seeds
    them from its `seed`): code that calls `fit` draws after it as it would have without it. CUDA's
    are put back when CUDA was in use before `fit`."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fit(config: TrainConfig, data_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
        resume: bool = False, preset: str | None = None, allow_other_data: bool = False,
        allow_unknown_words: bool = False) -> dict[str, Any]:
    """Trains a model on a precomp data folder, writing the run folder; resumable.

    Everything that can be wrong with the input (config, output folder, data shapes,
    vocabulary, resumed checkpoint) is checked before the first step. Under `torchrun` each
    process trains on its share of every global batch (see `sgraf.training.global_batch`);
    rank 0 writes the files.

    Args:
        config: the resolved training config.
        data_dir: folder with `train_*` and `dev_*` precomp files.
        out_dir: the run folder.
        resume: continue the run in `out_dir` from its `last.pt`.
        preset: the preset name the config came from, recorded in config.yaml; by default the
            one `resolve_config` started it from (`config.preset`).
        allow_other_data: resume on a data folder other than the run's (another folder, or
            files changed since; see `run_dir.other_data`) instead of refusing it.
        allow_unknown_words: train with a vocabulary that leaves more than
            `UNKNOWN_REFUSE_SHARE` of the training tokens unknown instead of refusing it.

    Returns:
        {'status': 'finished' | 'interrupted', 'signal', 'epoch', 'global_step', 'best_rsum',
        'best_step', 'best_epoch', 'stopped_early' (finished before its last epoch: `patience`
        ran out), 'last_loss', 'run_dir'}.

    The run folder is locked while the run owns it (`RUN_DIR/.sgraf-lock`, see
    `sgraf.training.run_dir.prepare_run_dir`). Python's, NumPy's and torch's global random
    generators are seeded from `config.seed` for the run, and put back as they were after it
    (CUDA's when CUDA was in use before the call).

    Raises:
        InputError: bad input (before the first step; NaN/inf training features when reached).
        FolderLockedError: another run owns `out_dir` (an `InputError`, naming it).
        NonFiniteLossError: the loss or the weights became NaN/inf; `last.pt`, if written, is
            the state before.
    """
    if not isinstance(config, TrainConfig):
        raise InputError(f"fit: config must be a TrainConfig (resolve_config returns (config, extras)), "
                         f"got {type(config).__name__}")
    preset = config.preset if preset is None else preset
    info = distributed.init_from_env(device=config.device, what="training config field 'device'")
    # the folders a new run makes: taken back if it stops before writing there (bad data, say)
    created = missing_folders(out_dir) if info.is_main and not resume else []
    run_lock = None
    try:
        run, run_lock = _claim_run_dir(out_dir, resume, info.is_main)   # its lock not written: taken back too
        if resume:   # what the command line allows (sgraf train --resume --set), held here for every caller
            if not (run / rd.CONFIG_FILE).is_file():
                raise InputError(f"cannot resume {run}: it has no {rd.CONFIG_FILE} (not a sgraf run folder)")
            check_resumable(rd.load_run_config(run)[0], config, str(run))
        with tf32(config.tf32), _global_generators_kept():
            return _fit(config, pathlib.Path(data_dir), run, resume, preset, info, allow_other_data=allow_other_data,
                        allow_unknown_words=allow_unknown_words)
    finally:
        if run_lock is not None:
            run_lock.release()
        remove_empty_folders(created)       # only empty ones: a run that wrote anything keeps its folder


def _claim_run_dir(out_dir: str | os.PathLike[str], resume: bool,
                   is_main: bool) -> tuple[pathlib.Path, FolderLock | None]:
    """The run folder, locked by the main process; every process raises if that failed."""
    try:
        run, run_lock = rd.prepare_run_dir(out_dir, resume=resume, lock=is_main)
        failure = None
    except InputError as error:
        run, run_lock, failure = pathlib.Path(out_dir), None, error
    if _agree_on_stop(failure is not None):
        if run_lock is not None:
            run_lock.release()
        raise failure if failure is not None else InputError(f"{out_dir}: the main process could not take the "
                                                             "run folder (see its error)")
    return run, run_lock


def _fit(config: TrainConfig, data_dir: pathlib.Path, run: pathlib.Path, resume: bool, preset: str | None,
         info: Any, *, allow_other_data: bool = False, allow_unknown_words: bool = False) -> dict[str, Any]:
    """`fit` in a run folder this process has claimed: everything checked and built before the
    first step (`_open_data`, `_start_model`, `_Batches`), then the epochs, each ended by a
    validation and `last.pt` (`_RunRecord`), until the last epoch or a stop signal."""
    from sgraf.data.precomp import CheckedLoader

    device, is_main = info.device, info.is_main
    if torch.device(device).type == "cpu":
        keep_freed_memory()   # before the first tensors and worker threads (sgraf.kernels.memory)
    train, dev, dims, fingerprint = _open_data(config, data_dir, run, resume, info, allow_other_data)
    model, optimizer, scaler, progress = _start_model(config, run, resume, train, dev, dims, info,
                                                      data_dir, allow_unknown_words)
    batches = _Batches(config, data_dir, train, dev, model, info)   # refusals here leave no config.yaml
    if is_main:   # on resume too: the config as changed by --set, the data as checked above
        rd.save_run_config(run, config, data_dir, preset, fingerprint)
    distributed.barrier()
    tensorboard = _open_tensorboard(run, progress.global_step if resume else None) if is_main else None
    record = _RunRecord(config, run, model, optimizer, scaler, progress, dev, device, is_main, tensorboard,
                        last_saved_step=progress.global_step if resume else None)
    workers = loader_workers(config.workers)
    if progress.epoch < config.epochs and not (resume and out_of_patience(config, progress)):
        _log_start(config, model, data_dir, batches, device, info, workers)   # not when nothing is left
    n_steps = batches.n_steps
    last_loss = float("nan")

    status, signal_name = "finished", None
    stopped_by: int | None = None     # the signal every process agreed to stop on (one process may have had it)
    with StopSignals(cuttable=not distributed.is_distributed()) as signals:
        def after_step(result: StepResult) -> bool:
            nonlocal last_loss, stopped_by
            last_loss = result.loss
            record.step(result)
            if config.val_every and progress.global_step % config.val_every == 0 and progress.epoch_step < n_steps:
                record.validation(end_of_epoch=False, signals=signals)
            stopped_by = _agreed_signal(signals.received)
            stop = stopped_by is not None
            if stop or (config.checkpoint_every and progress.global_step % config.checkpoint_every == 0):
                record.save_last()
            return stop

        try:
            if progress.pending_validation:     # not ended before this resume (a signal, a kill): first
                stopped_by = _resumed_validation(record, progress, config, signals)
                if stopped_by is not None and (progress.epoch < config.epochs or progress.pending_validation):
                    status, signal_name = "interrupted", _signal_name(stopped_by)
            while (stopped_by is None and progress.epoch < config.epochs
                   and not out_of_patience(config, progress)):
                set_learning_rate(optimizer, learning_rate(config, progress.epoch))
                sampler = batches.sampler(progress.epoch, progress.epoch_step)
                n_steps = len(sampler.batches)     # family batches pack each epoch's pictures anew
                loader = CheckedLoader(batches.dataset, batch_sampler=sampler, collate_fn=batches.collate,
                                       num_workers=workers,
                                       generator=torch.Generator().manual_seed(config.seed),
                                       pin_memory=device.type == "cuda")   # NaN/inf batches refused
                bar = _progress_bar(config, is_main, n_steps, progress, signals)
                try:
                    stats = train_one_epoch(model, optimizer, loader, config, progress, scaler, device,
                                            after_step=after_step, bar=bar)
                finally:
                    if bar is not None:
                        bar.close()
                if stats["stopped"]:
                    status = "interrupted"
                    signal_name = _signal_name(stopped_by)
                    break
                progress.epoch += 1
                progress.epoch_step = 0
                record.validation(end_of_epoch=True, signals=signals)
                stopped_by = _end_validation(record, progress, config, signals)
                if stopped_by is not None:
                    if progress.epoch < config.epochs or progress.pending_validation:
                        status, signal_name = "interrupted", _signal_name(stopped_by)
                    break
        except NonFiniteLossError as error:
            raise NonFiniteLossError(_non_finite_message(error, progress, config, run, record.last_saved_step),
                                     error.inputs_finite, error.step) from None
        except NonFiniteFeatures as error:     # met mid-run: features are checked as they are read
            last = run / rd.LAST_CHECKPOINT
            if record.last_saved_step is None or not last.is_file():
                raise
            raise NonFiniteFeatures(f"{error}. {last} (step {record.last_saved_step}) is kept: once the features "
                                    f"are repaired, sgraf train --resume {shlex.quote(str(run))} goes on "
                                    "from it") from None
    record.close()
    distributed.barrier()
    stopped_early = status == "finished" and progress.epoch < config.epochs
    summary = {"status": status, "signal": signal_name, "epoch": progress.epoch, "global_step": progress.global_step,
               "best_rsum": progress.best_rsum, "best_step": progress.best_step, "best_epoch": progress.best_epoch,
               "stopped_early": stopped_early, "last_loss": last_loss, "run_dir": str(run)}
    if stopped_early:
        logger.info("stopped early after %d of %d epochs: no better dev rsum in the last %d (best %.2f at epoch %d); "
                    "to go on: sgraf train --resume %s --set patience=0", progress.epoch, config.epochs,
                    progress.epochs_without_better(), progress.best_rsum, progress.best_epoch, shlex.quote(str(run)))
    if status == "interrupted":
        logger.info("stopped by %s in epoch %d of %d (%d done), step %d; continue with: sgraf train --resume %s",
                    signal_name, progress.epoch + 1, config.epochs, progress.epoch, progress.global_step,
                    shlex.quote(str(run)))
    return summary


def _open_data(config: TrainConfig, data_dir: pathlib.Path, run: pathlib.Path, resume: bool, info: Any,
               allow_other_data: bool) -> tuple[Any, Any, tuple[int, int], dict[str, str]]:
    """The train and dev splits, checked against the config (and, resuming, against the run's
    own data): (train, dev, (img_dim, regions), the data's fingerprint)."""
    from sgraf.data.precomp import PrecompSplit

    if not data_dir.is_dir():
        raise InputError(f"data folder {data_dir} does not exist or is not a folder")
    if config.batch_size < max(2, info.world_size):
        raise InputError(f"batch_size={config.batch_size} is too small: it needs at least 2 captions "
                         f"and one per process ({info.world_size} processes)")
    train = PrecompSplit(data_dir, "train")   # its features are checked batch by batch
    # dev is read whole at the first validation: scanned now, not after an epoch of training
    dev = PrecompSplit(data_dir, "dev", max_captions=_val_captions(config, data_dir), full_scan=True)
    dims = check_data_fits(config, [train, dev])
    if dev.n_images <= VAL_FEW_IMAGES and info.is_main:     # val_max_captions=5 had validated on 1, rsum 600 unsaid
        logger.warning("validation scores %d dev image%s (%d captions): R@10 is 100 whatever the model, and best.pt is "
                       "chosen on little (val_max_captions, or a larger dev split)", dev.n_images,
                       "" if dev.n_images == 1 else "s", dev.n_captions)
    fingerprint = run_fingerprint(config, data_dir)
    same = [name for name in ("caps.txt", "ims.npy") if fingerprint[f"train_{name}"] == fingerprint[f"dev_{name}"]]
    if same and info.is_main:
        what = " and ".join({"caps.txt": "captions", "ims.npy": "features"}[name] for name in same)
        logger.warning("%s: the dev split's %s are the training split's (the same files, or copies): its rsum will "
                       "measure how well the model fits its training data, not how well it matches new pairs",
                       data_dir, what)
    if resume:
        _check_same_data(run, data_dir, fingerprint, allow_other_data)
    return train, dev, dims, fingerprint


def run_fingerprint(config: TrainConfig, data_dir: str | os.PathLike[str]) -> dict[str, str]:
    """`data_fingerprint` of the train and dev files a run with `config` reads: with the boxes and
    picture sizes a position model reads, and the scenes that `batches=families` draws from. What
    its config.yaml records, and what a resume (of `sgraf train` or `sgraf demo`) compares."""
    from sgraf.data.precomp import BOX_FILES, SCENE_FILES, data_fingerprint

    extras = (BOX_FILES if config.positions != "none" else ()) + (SCENE_FILES if config.batches == "families" else ())
    return data_fingerprint(data_dir, extras=extras)


def _start_model(config: TrainConfig, run: pathlib.Path, resume: bool, train: Any, dev: Any, dims: tuple[int, int],
                 info: Any, data_dir: pathlib.Path, allow_unknown_words: bool) -> tuple[nn.Module, Any, Any, Progress]:
    """The model (with its vocabulary), optimizer, gradient scaler and progress: new, from
    `seed`, or resumed from `last.pt` (its metrics after the saved step dropped)."""
    from sgraf.checkpoint import load_checkpoint, load_state_checked
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    checkpoint = None
    if resume:
        checkpoint = load_checkpoint(run / rd.LAST_CHECKPOINT)
        if STATE_KEY not in checkpoint["extra"]:
            raise InputError(f"{run / rd.LAST_CHECKPOINT}: no training state to resume from")
        _check_config_as_trained(run, config, checkpoint["extra"].get("train_config"))
        vocab = Vocabulary.from_dict(checkpoint["vocab"], source=str(run / rd.LAST_CHECKPOINT))
    else:
        vocab = resolve_vocab(config, data_dir, train, dev)
    check_vocab_coverage(vocab, train, allow_unknown_words)
    _seed_everything(config.seed)
    model_config = config.model_config(len(vocab), img_dim=dims[0], num_regions=dims[1])
    if checkpoint is not None:
        model_config = ModelConfig.from_dict(checkpoint["config"])
        check_model_fits(model_config, dims, str(run / rd.LAST_CHECKPOINT))
    model = SGRAF(model_config)   # initialised from `seed`
    model.vocab = vocab
    if checkpoint is not None:
        load_state_checked(model, checkpoint["state_dict"], str(run / rd.LAST_CHECKPOINT))
    model.to(info.device)
    optimizer = build_optimizer(model, config)
    scaler = make_grad_scaler(config, info.device)
    progress = Progress()
    if checkpoint is not None:
        progress = restore_train_state(checkpoint["extra"][STATE_KEY], optimizer, scaler)
        if config.epochs < progress.epoch:
            raise InputError(f"cannot resume {run} with epochs={config.epochs}: it has trained {progress.epoch} "
                             f"epochs (--set epochs=N trains on to N; N >= {progress.epoch})")
        if info.is_main:
            rd.truncate_metrics(run, progress.last_val_step)
        if progress.pending_validation:
            logger.info("resuming %s at epoch %d, step %d: first the validation that had not ended there (%s)",
                        run, min(progress.epoch + 1, config.epochs), progress.global_step, progress.describe_best())
        elif progress.epoch >= config.epochs:
            logger.info("%s has trained its %d epoch%s: nothing to train (--set epochs=N trains on to N)", run,
                        config.epochs, "" if config.epochs == 1 else "s")
        elif out_of_patience(config, progress):
            logger.info("%s stopped early at epoch %d: nothing to train (--set patience=0, or a larger patience, "
                        "goes on)", run, progress.epoch)
        else:
            logger.info("resuming %s at epoch %d, step %d (%s)", run, progress.epoch + 1,
                        progress.global_step, progress.describe_best())   # never "best rsum -inf"
    if info.rank > 0:
        # distinct dropout masks per process; last.pt holds the random state of rank 0 alone, so on a
        # resume the others draw from (seed, rank, step): they had all drawn rank 0's masks
        torch.manual_seed(config.seed + 7919 * info.rank + progress.global_step)
    return model, optimizer, scaler, progress


class _Batches:
    """A run's training captions and how each epoch draws them: the dataset (with the regions'
    boxes for a model with positions: a split without them is refused here in one line, and
    dev's before the first step), the epoch's sampler (by scene families with
    `batches=families`) and the collate function."""

    def __init__(self, config: TrainConfig, data_dir: pathlib.Path, train: Any, dev: Any, model: nn.Module,
                 info: Any) -> None:
        from sgraf.data.precomp import PrecompDataset, collate_batch

        self.config, self.info = config, info
        for split in (train, dev):
            split.check_caption_lengths()
        self.dataset = PrecompDataset(train, model.vocab, with_boxes=model.needs_boxes)
        if model.needs_boxes:
            dev.read_boxes(required=True)
        self.families = None
        if config.batches == "families":   # the scenes are read and checked before the first step
            from sgraf.data.families import read_families
            self.families = read_families(data_dir, "train", train.n_images, train.caps_per_image)
        self.collate = collate_batch if self.families is None else TruthCollate(self.families.true_of)
        self.n_steps = len(self.sampler(0))
        if self.n_steps == 0:
            raise InputError(f"{train.caps_path}: {len(self.dataset)} training captions make no batch of "
                             f"at least 2 (batch_size={config.batch_size})")

    def sampler(self, epoch: int, start_batch: int = 0) -> PlannedBatches:
        """This process's batches of `epoch` from batch `start_batch` on."""
        config, info = self.config, self.info
        if self.families is not None:
            return FamilyBatchSampler(self.families.groups, self.families.captions_per_image, config.batch_size,
                                      config.seed, epoch, start_batch, info.rank, info.world_size,
                                      config.family_share)
        return EpochBatchSampler(len(self.dataset), config.batch_size, config.seed, epoch, start_batch,
                                 info.rank, info.world_size)


def _log_start(config: TrainConfig, model: nn.Module, data_dir: pathlib.Path, batches: _Batches,
               device: torch.device, info: Any, workers: int) -> None:
    """What the run will do, in the log (`workers`: the loader's worker processes)."""
    logger.info("training %s on %s: %d captions, %s%d steps per epoch, %d epoch%s, %s on %s%s",
                model.config.module, data_dir, len(batches.dataset),
                "about " if batches.families is not None else "", batches.n_steps, config.epochs,
                "" if config.epochs == 1 else "s", config.precision, device,
                f", {info.world_size} processes" if info.world_size > 1 else "")
    if config.batch_size > len(batches.dataset):
        logger.warning("batch_size=%d is more than the %d training captions: every step takes all of them "
                       "(one step per epoch)", config.batch_size, len(batches.dataset))
    if workers < config.workers:
        logger.info("data loading: %d worker processes (workers=%d asked; this process may use %d CPUs)",
                    workers, config.workers, workers)
    if config.patience:
        logger.info("early stopping: once %d epoch%s in a row end without a better dev rsum", config.patience,
                    "" if config.patience == 1 else "s")
    if config.warmup_epochs >= config.epochs:
        logger.info("loss: the hinge summed over all negatives (warmup_epochs=%d covers all %d epoch%s: the hardest "
                    "negatives would come after)", config.warmup_epochs, config.epochs,
                    "" if config.epochs == 1 else "s")
    elif config.warmup_epochs:
        logger.info("loss: the hinge summed over all negatives for the first %d epoch%s, then the hardest "
                    "negatives", config.warmup_epochs, "" if config.warmup_epochs == 1 else "s")
    if pairs.applies(model, config.loss_for_epoch(config.epochs - 1)):
        logger.info("backward: through the pairs the hardest-negative loss reads (at most 3 per caption; "
                    "pair_backward=false backpropagates through the whole score matrix)")


class _RunRecord:
    """What a run writes as it trains, on the main process: `last.pt` (only ever a good state:
    the weights are checked first, on every process), each validation (metrics.jsonl,
    `best.pt`, TensorBoard, the plots) and the training curves."""

    def __init__(self, config: TrainConfig, run: pathlib.Path, model: nn.Module, optimizer: Any, scaler: Any,
                 progress: Progress, dev: Any, device: torch.device, is_main: bool, tensorboard: Any | None,
                 last_saved_step: int | None) -> None:
        self.config, self.run, self.model, self.optimizer, self.scaler = config, run, model, optimizer, scaler
        self.progress, self.dev, self.device, self.is_main = progress, dev, device, is_main
        self.tensorboard = tensorboard
        self.last_saved_step = last_saved_step   # the step last.pt holds (None: not written by this run)

    def check_weights(self) -> None:
        from sgraf.checkpoint import non_finite_tensor

        broken = non_finite_tensor(self.model.state_dict())
        if broken is not None:
            raise NonFiniteLossError(f"the weights hold NaN/inf (tensor {broken})", step=self.progress.global_step)

    def step(self, result: StepResult) -> None:
        """A training step's loss and gradient norm to TensorBoard, every `log_every` steps."""
        step = self.progress.global_step
        if self.tensorboard is not None and step % self.config.log_every == 0:
            self.tensorboard.add_scalar("train/loss", result.loss, step)
            self.tensorboard.add_scalar("train/grad_norm", result.grad_norm, step)

    def save_last(self) -> None:
        from sgraf.checkpoint import save_model

        self.check_weights()   # last.pt only ever holds a good state
        progress, config = self.progress, self.config
        if self.is_main:
            extra = {"epoch": progress.epoch, "step": progress.global_step, "best_rsum": progress.best_rsum,
                     "train_config": config.to_dict(),
                     STATE_KEY: build_train_state(progress, self.optimizer, self.scaler)}
            save_model(self.model, self.run / rd.LAST_CHECKPOINT, vocab=self.model.vocab, extra=extra)
        self.last_saved_step = progress.global_step       # once written (a failed write keeps the earlier)

    def validation(self, end_of_epoch: bool, signals: StopSignals) -> None:
        """Validate on dev and record it (a new best: `best.pt`). `last.pt` is written first, with
        the validation as `progress.pending_validation` (unless it holds this step already), so that
        a resumed run validates first if this process dies before the validation ends. A stop signal
        during its arithmetic cuts it short before anything is written (`StopSignals.cut_short`): it
        stays pending."""
        from sgraf.checkpoint import save_model

        self.check_weights()
        progress, config, model = self.progress, self.config, self.model
        epoch = progress.epoch + (0 if end_of_epoch else 1)
        pending = "epoch" if end_of_epoch else "step"
        if self.last_saved_step != progress.global_step:
            # last.pt holds this step, the validation pending, before the validation starts: a process
            # killed during it (SIGKILL, out of memory, or under torchrun, where a signal lets it run to
            # its end, once a scheduler's grace period is out) loses the validation alone, not the steps
            # since the last save, and `--resume` runs it first
            progress.pending_validation = pending
            self.save_last()
        # the place term against the heads from the second epoch on: after one the heads have barely begun
        # (the quick demo's one epoch had warned of its own recipe)
        with signals.during("validation"):
            try:
                result = validate(model, self.dev, model.vocab, config, self.device, warn_place_term=epoch >= 2,
                                  cut=signals.cut_short)
            except ValidationCut:
                progress.pending_validation = pending
                return
        progress.pending_validation = ""
        loss = progress.loss_sum / progress.loss_steps if progress.loss_steps else None
        record = {"epoch": epoch, "step": progress.global_step,
                  "end_of_epoch": end_of_epoch, "rsum": result["rsum"], "i2t": result["i2t"],
                  "t2i": result["t2i"], "train_loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
                  "n_images": result["n_images"], "n_captions": result["n_captions"]}
        if "place_term" in result:     # a place model's term on dev (`place_term_spread`)
            record["place_term"] = result["place_term"]
        is_best = result["rsum"] > progress.best_rsum
        record["best"] = is_best
        progress.loss_sum, progress.loss_steps = 0.0, 0
        progress.last_val_step = progress.global_step
        if is_best:
            progress.best_rsum, progress.best_step = float(result["rsum"]), progress.global_step
            progress.best_epoch = record["epoch"]
        if not self.is_main:
            return
        logger.info("validation at epoch %d step %d: rsum %.2f (i2t R@1 %.1f, t2i R@1 %.1f)%s",
                    record["epoch"], record["step"], record["rsum"], result["i2t"]["r1"],
                    result["t2i"]["r1"], " best" if is_best else "")
        if is_best:
            save_model(model, self.run / rd.BEST_CHECKPOINT, vocab=model.vocab,
                       extra={"epoch": record["epoch"], "step": record["step"], "rsum": record["rsum"],
                              "metrics": record, "train_config": config.to_dict()})
        rd.append_metrics(self.run, record)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("val/rsum", record["rsum"], record["step"])
            for side in ("i2t", "t2i"):
                for key in ("r1", "r5", "r10"):
                    self.tensorboard.add_scalar(f"val/{side}_{key}", result[side][key], record["step"])
        _plot(self.run)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def out_of_patience(config: TrainConfig, progress: Progress) -> bool:
    """Whether the run stops early: `patience` epochs ended since the one with the best dev rsum
    (`config.patience_ran_out`, the rule `sgraf runs` reads from the records)."""
    return patience_ran_out(config.patience, progress.epoch, progress.best_epoch if progress.best_step >= 0 else None)


def _check_config_as_trained(run: pathlib.Path, config: TrainConfig, trained: Any) -> None:
    """Refuse a resume whose config.yaml no longer says what last.pt was trained with (edited by
    hand, a line deleted): it had trained on at the edited values (a deleted lr: the default),
    unsaid, and written them back. `last.pt` records the config it saved under."""
    from sgraf.training.config import fixed_keys_changed

    if not isinstance(trained, dict):
        return                          # a last.pt of a version that did not record it
    try:
        recorded = TrainConfig.from_dict(trained, source=str(run / rd.LAST_CHECKPOINT))
    except InputError:
        return
    keys = fixed_keys_changed(recorded, config.to_dict())
    if keys:
        differ = ", ".join(f"{key}: {getattr(config, key)!r} there, {getattr(recorded, key)!r} in last.pt"
                           for key in keys)
        raise InputError(f"cannot resume {run}: its {rd.CONFIG_FILE} no longer says what {rd.LAST_CHECKPOINT} was "
                         f"trained with ({differ}); was it edited? Put last.pt's values back (a resume may change "
                         "only the keys --set takes with --resume)")


def _non_finite_message(error: NonFiniteLossError, progress: Progress, config: TrainConfig, run: pathlib.Path,
                        last_saved_step: int | None) -> str:
    """What is known when training stops on NaN/inf: where, the cause, the checkpoint left."""
    last = run / rd.LAST_CHECKPOINT
    if last_saved_step is not None and last.is_file():
        kept = f"{last} (step {last_saved_step}) was written before it and is kept"
    else:
        kept = f"No checkpoint was written before it (checkpoint_every={config.checkpoint_every})"
    hint = ""
    if error.inputs_finite:
        hint = "; the inputs were finite, so training diverged: try a lower lr" + (
            "" if config.precision == "fp32" else " or precision=fp32")
    where = (f"after step {error.step}" if error.step is not None
             else f"at epoch {progress.epoch + 1}, step {progress.global_step + 1}")
    return f"{error} {where}; stopping. {kept}{hint}"


def _check_same_data(run: pathlib.Path, data_dir: pathlib.Path, fingerprint: dict[str, str], allow: bool) -> None:
    """Refuse to resume a run on data other than its own, unless `allow` (then a warning)."""
    reason = rd.other_data(run, data_dir, fingerprint)
    if reason is None:
        return
    if not allow:
        raise InputError(f"--data {data_dir}: not the data this run trained on ({run / rd.CONFIG_FILE}): {reason}; "
                         "resuming would train on other data and compare dev rsum across different dev "
                         "splits. Pass --allow-other-data to resume on it anyway")
    logger.warning("resuming %s on other data (--allow-other-data): %s; its earlier dev rsum and best.pt come "
                   "from the other dev split", run, reason)


def check_vocab_coverage(vocab: Any, train: Any, allow: bool = False) -> float:
    """The share of unknown tokens in (a spread sample of) the training captions.

    A WARNING above `UNKNOWN_WARN_SHARE`; refused above `UNKNOWN_REFUSE_SHARE` unless `allow`.

    Raises:
        InputError: naming the vocabulary, the captions file, the share and the limit.
    """
    from sgraf.data.vocab import warn_unknown_share

    captions = train.captions
    step = -(-len(captions) // VOCAB_SAMPLE)
    sample = captions[::step]
    where = str(train.caps_path) + (f" (a sample of {len(sample)} of its {len(captions)} captions)"
                                    if step > 1 else "")
    share = warn_unknown_share(vocab, [vocab.encode(c) for c in sample], where)
    if share > UNKNOWN_REFUSE_SHARE and not allow:
        name = getattr(vocab, 'source', 'the vocabulary')
        raise InputError(f"{name}: {100 * share:.1f}% of the tokens of {where} are unknown to this "
                         f"vocabulary (<unk>), above the {100 * UNKNOWN_REFUSE_SHARE:.0f}% limit: the model would "
                         "learn from almost no words. Use this data's vocabulary (sgraf vocab build), or pass "
                         "--allow-unknown-words to train anyway")
    return share


def _val_captions(config: TrainConfig, data_dir: pathlib.Path) -> int | None:
    """`val_max_captions`, or None when the dev split is no larger (the whole split)."""
    if config.val_max_captions is None:
        return None
    from sgraf.data.precomp import PrecompSplit

    dev = PrecompSplit(data_dir, "dev")
    if config.val_max_captions < dev.n_captions and config.val_max_captions % dev.caps_per_image:
        raise InputError(f"training config field 'val_max_captions' is {config.val_max_captions}: expected a multiple "
                         f"of the {dev.caps_per_image} captions per image of {dev.caps_path} (validation scores whole "
                         "images), or none for every dev caption")
    return config.val_max_captions if config.val_max_captions < dev.n_captions else None


def _agree_on_stop(local: bool) -> bool:
    """True on every process when any process received a stop signal."""
    return _agreed_signal(1 if local else None) is not None


def _end_validation(record: _RunRecord, progress: Progress, config: TrainConfig, signals: StopSignals) -> int | None:
    """After an end-of-epoch validation, or a resumed one (`_resumed_validation`): the run
    finished if it was its last epoch's, and `last.pt` written; the stop signal every process
    agreed on, or None."""
    if progress.epoch >= config.epochs and not progress.pending_validation:
        progress.finished = True
    record.save_last()
    return _agreed_signal(signals.received)


def _resumed_validation(record: _RunRecord, progress: Progress, config: TrainConfig,
                        signals: StopSignals) -> int | None:
    """The validation that had not ended before this resume (`progress.pending_validation`),
    then `last.pt` (which says it ran: a run killed later does not run it twice); the stop signal
    every process agreed on, or None."""
    if progress.pending_validation == "epoch":
        record.validation(end_of_epoch=True, signals=signals)
        return _end_validation(record, progress, config, signals)
    record.validation(end_of_epoch=False, signals=signals)   # `val_every`'s, after the step last.pt holds
    record.save_last()
    return _agreed_signal(signals.received)


def _agreed_signal(local: int | None) -> int | None:
    """The stop signal every process agrees on: the largest any of them received (`local`: this
    one's, None if none), None if none did. Each process then reports the signal (a process that
    got none had reported 'stopped by None' and failed reading its number)."""
    if not distributed.is_distributed():
        return local
    import torch.distributed as dist

    flag = torch.tensor([float(local or 0)])
    if dist.get_backend() == "nccl":  # NCCL reduces only tensors on this process's GPU
        flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    agreed = int(flag.item())
    return agreed or None


def _signal_name(signum: int | None) -> str | None:
    import signal

    return signal.Signals(signum).name if signum is not None else None


def _progress_bar(config: TrainConfig, is_main: bool, n_steps: int, progress: Progress, signals: Any) -> Any | None:
    if not (config.progress and is_main):
        return None
    from sgraf.progress import bar

    return bar(n_steps, f"epoch {progress.epoch + 1}/{config.epochs}", "step", initial=progress.epoch_step)


def _plot(run: pathlib.Path) -> None:
    try:
        from sgraf.training.plots import plot_curves

        plot_curves(run)
    except Exception as error:  # a plot is never worth stopping a run for
        logger.warning("could not draw %s: %s", run / rd.CURVES_FILE, error)
