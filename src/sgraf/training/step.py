"""One optimisation step: the authors' step, vectorised, on one process's share of a batch.

The step is the authors' (official.md): the (images x captions) train-mode score matrix of the
batch, the VSE++ hinge loss with hardest negatives summed over the batch (L_r + L_f for a joint
model), backward, gradient-norm clipping at 2.0, Adam. The learning rate is
`lr * 0.1 ** (epoch // lr_update)`. An epoch and a whole run are `sgraf.training.loop`'s.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from sgraf import distributed, torch_compat
from sgraf.kernels import plan
from sgraf.kernels.memory import keep_freed_memory
from sgraf.model.loss import max_pairs
from sgraf.precision import autocast, low_precision_weights, rnn_like_matmul
from sgraf.training import pairs
from sgraf.training.config import TrainConfig
from sgraf.training.families import truth_mask
from sgraf.training.global_batch import (average_gradients, gather_ids, global_batch_scores,
                                         global_batch_train_scores, global_vector_scores, merge_per_caption_norms,
                                         per_caption_norms, snapshot_norms)


class NonFiniteLossError(RuntimeError):
    """The loss (or the weights) became NaN or infinite; the run stops, its last checkpoint
    kept as it was.

    Attributes:
        inputs_finite: whether the batch's inputs were finite (then training diverged).
        step: the global step it happened at, when the raiser knows it.
    """

    def __init__(self, message: str, inputs_finite: bool = True, step: int | None = None) -> None:
        super().__init__(message)
        self.inputs_finite = inputs_finite
        self.step = step


class StepResult:
    """What one optimisation step reports.

    Attributes:
        loss: the batch loss (summed over the global batch; L_r + L_f for joint models).
        grad_norm: the global gradient norm before clipping.
        skipped: the fp16 gradient scaler found inf/NaN gradients and skipped the update.

    Under the GPU plan the step reads nothing back from the device: `loss` and `grad_norm` are
    read at their first use, and a non-finite loss (whose update the device skipped) raises
    `NonFiniteLossError` there, or at `check()`.
    """

    def __init__(self, loss: float | torch.Tensor, grad_norm: float | torch.Tensor, skipped: bool = False,
                 check: Callable[[], None] | None = None) -> None:
        self._loss, self._grad_norm, self.skipped, self._check = loss, grad_norm, skipped, check

    def __repr__(self) -> str:
        try:
            return f"StepResult(loss={self.loss:.6g}, grad_norm={self.grad_norm:.6g}, skipped={self.skipped})"
        except NonFiniteLossError:
            return f"StepResult(loss not finite, skipped={self.skipped})"

    def check(self) -> None:
        """Raise `NonFiniteLossError` if the loss was not finite (reads it from the device once)."""
        check, self._check = self._check, None
        if check is not None:
            check()

    @property
    def loss(self) -> float:
        self.check()
        return float(self._loss)

    @property
    def grad_norm(self) -> float:
        self.check()
        return float(self._grad_norm)


def learning_rate(config: TrainConfig, epoch: int) -> float:
    """The authors' step schedule: `lr * 0.1 ** (epoch // lr_update)` (epoch 0-based)."""
    return config.lr * 0.1 ** (epoch // config.lr_update)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Adam:
    """Adam over every parameter, at the learning rate of epoch 0.

    Under the GPU plan (`sgraf.kernels.plan`), Adam's fused kernel: a few launches per step for
    all parameters (PyTorch's CUDA default, `foreach`, launches about fifteen), and an update the
    device itself skips when the loss is not finite (`train_step` reads nothing back). Elsewhere
    PyTorch's default (on a CPU, one parameter at a time: the numerics of the golden tests), as
    under the emulated GPU plan with a PyTorch whose fused Adam runs on CUDA alone (before 2.4)."""
    device = next(model.parameters()).device
    return torch.optim.Adam(model.parameters(), lr=learning_rate(config, 0),
                            fused=True if plan.gpu_plan(device) and torch_compat.fused_adam_runs(device) else None)


def make_grad_scaler(config: TrainConfig, device: torch.device) -> Any | None:
    """A gradient scaler for fp16 (None for fp32 and bf16, which need none)."""
    if config.precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def batch_loss(scores: torch.Tensor | dict[str, torch.Tensor], config: TrainConfig,
               positives: torch.Tensor | None = None) -> torch.Tensor:
    """The ranking loss of a score matrix, or L_r + L_f of a joint model's {'sgr', 'saf'}."""
    from sgraf.model.loss import ranking_loss

    matrices = list(scores.values()) if isinstance(scores, dict) else [scores]
    losses = [ranking_loss(m.float(), config.margin, config.max_violation, positives) for m in matrices]
    return losses[0] if len(losses) == 1 else sum(losses[1:], losses[0])


def same_image_mask(image_ids: torch.Tensor) -> torch.Tensor:
    """(B, B) True where row i's image is column j's caption's image (B = global batch)."""
    ids = gather_ids(image_ids)
    return ids.unsqueeze(1) == ids.unsqueeze(0)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, config: TrainConfig,
               scaler: Any | None = None, device: torch.device | str = "cpu") -> StepResult:
    """One optimisation step on a batch (this process's share of the global batch).

    Args:
        model: an `SGRAF`; put in train mode.
        optimizer: its Adam.
        batch: a `sgraf.data.precomp.Batch` (images, captions, lengths, image_ids; boxes for a
            model with positions).
        config: margin, max_violation, same_image_positive, grad_clip, precision (a batch
            with `true_of`, drawn by families, masks every pair whose caption is true of the
            picture instead of only the same picture's).
        scaler: the fp16 gradient scaler, or None.
        device: where the model lives.

    Raises:
        NonFiniteLossError: the loss is NaN or infinite (nothing is updated); the message names
            the images whose features are not finite, if any (`inputs_finite` otherwise). With
            a fused optimizer under the GPU plan the step reads nothing back from the device:
            the device skips the update, and the error is raised when the result is first read.
    """
    from sgraf.model.loss import ranking_loss

    model.train()
    device = torch.device(device)
    if device.type == "cpu":
        keep_freed_memory()   # no page faults on re-used blocks (sgraf.kernels.memory)
    images = batch.images.to(device, non_blocking=True)          # (n, K, img_dim)
    captions = batch.captions.to(device, non_blocking=True)      # (n, L)
    lengths = batch.lengths                                      # (n,) on the CPU: read there, no device wait
    boxes = getattr(batch, "boxes", None)                        # (n, K, 4) for a model with positions
    boxes = None if boxes is None else boxes.to(device, non_blocking=True)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = per_caption_norms(model) if distributed.is_distributed() else []
    norms_before = snapshot_norms(norms)

    optimizer.zero_grad(set_to_none=True)
    true_of = getattr(batch, "true_of", None)
    if true_of is not None:   # family batches: a caption is no negative of a picture it is true of
        positives = truth_mask(batch.image_ids.to(device, non_blocking=True), true_of.to(device, non_blocking=True))
    elif config.same_image_positive:
        positives = same_image_mask(batch.image_ids.to(device, non_blocking=True))
    else:
        positives = None
    # the backward pass through the pairs the loss reads only (sgraf.training.pairs), where it applies
    by_pairs = pairs.applies(model, config)
    # the device lists the pairs without a read under the GPU plan
    on_device = scaler is None and plan.gpu_plan(device) and bool(optimizer.defaults.get("fused"))
    # bf16/fp16: the linear layers' weights cast once for the step (forward, recomputed chunks and
    # backward), not by autocast at every use; their gradients reach the parameters on leaving
    with low_precision_weights(model, config.precision, device):
        with autocast(config.precision, device):
            if by_pairs:
                train_scores = global_batch_train_scores(model, images, captions, lengths, boxes)
            else:
                scores = global_batch_scores(model, images, captions, lengths, boxes)   # (B, B) or {'sgr', 'saf'}
            global_scores = global_vector_scores(model) if config.global_loss_weight > 0 else None
        if by_pairs:
            (values,) = train_scores.values.values()
            columns = train_scores.columns
            loss, rows, cols, weights = pairs.loss_and_pairs(
                values, lambda matrix: batch_loss(matrix, config, positives),
                max_pairs(values.size(0), values[:, columns].size(1)) if on_device else None, columns)
        else:
            loss = batch_loss(scores, config, positives)
        auxiliary = None
        if global_scores is not None:  # auxiliary loss: global vectors as a retrieval embedding
            auxiliary = config.global_loss_weight * ranking_loss(global_scores.float(), config.margin,
                                                                 config.max_violation, positives)
            loss = loss + auxiliary

        def check_loss() -> None:
            if not bool(torch.isfinite(loss)):
                bad_images = (~torch.isfinite(images)).flatten(1).any(dim=1).cpu()
                if bool(bad_images.any()):
                    raise NonFiniteLossError(f"the training loss is {loss.item()} on non-finite inputs: the features "
                                             f"of images {batch.image_ids[bad_images][:5].tolist()} hold NaN/inf",
                                             inputs_finite=False)
                raise NonFiniteLossError(f"the training loss is {loss.item()}")

        # without a host read: the fused optimizer skips the update on the device when the loss is not finite
        if not on_device:
            check_loss()
        objective = loss
        if by_pairs:   # the selected pairs again, with autograd: the loss's gradient, not its value
            with autocast(config.precision, device):
                (pair_scores,) = train_scores.pairs(rows, cols).values()
            objective = pairs.surrogate(pair_scores, weights, train_scores.copies)
            if auxiliary is not None:
                objective = objective + auxiliary
        # cuDNN reads its TF32 flag again for the GRU's backward: the same as the forward's (`rnn_like_matmul`)
        with rnn_like_matmul(device):
            (scaler.scale(objective) if scaler is not None else objective).backward()
    average_gradients(params)
    merge_per_caption_norms(norms, norms_before)
    grad_norm, skipped = _update(optimizer, params, config, scaler, loss if on_device else None)
    if on_device:
        return StepResult(loss.detach(), grad_norm.detach(), check=check_loss)
    return StepResult(loss=float(loss.item()), grad_norm=float(grad_norm), skipped=skipped)


def _update(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], config: TrainConfig, scaler: Any | None,
            loss_on_device: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Clip the gradients (or only measure their norm) and take the optimizer's step: through the
    fp16 scaler, or with `loss_on_device` given, a fused optimizer that skips the update itself
    when that loss is not finite (nothing read back). Returns (gradient norm before clipping,
    whether the scaler skipped the update)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if config.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    else:
        grad_norm = torch_compat.total_norm([p.grad for p in params if p.grad is not None])
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return grad_norm, scaler.get_scale() < scale
    if loss_on_device is not None:
        optimizer.found_inf = torch.isfinite(loss_on_device).logical_not().float()   # read by the fused kernel
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        optimizer.step()
    return grad_norm, False
