"""The score matrix of the GLOBAL batch when training on several processes.

The loss takes, for every image and every caption, its hardest negative over the whole batch,
so one process with batch B and W processes with B/W each must see the same (B, B) score
matrix. Each process:

1. encodes its own images and captions;
2. gathers every process's image embeddings (with gradient flow), so the similarity head sees
   all B images, and VisualSA's BatchNorm takes its statistics over the same B images as one
   process would (each process computes identical statistics and running averages);
3. scores all B images against its own captions, a (B, B/W) block of columns;
4. gathers the blocks (with gradient flow) into the full (B, B) matrix, in rank order, which
   is the order of the global batch.

Every process then computes the same loss. The gathers' backward passes sum the gradient
copies of all W processes, so each process's gradients are W times its share; averaging them
over processes (`average_gradients`) gives exactly one process's gradients. That average is
done by hand after `backward()` rather than by `DistributedDataParallel`, because DDP only
hooks `forward()` and this computation calls the encoders and the head separately.

SAF's BatchNorm advances once per caption, in caption order (the authors' numerics). Each
process sees only its captions, so `merge_per_caption_norms` combines the per-process updates
into the update one process makes over the whole batch, in closed form.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sgraf.distributed import all_gather_cat, communication_device, is_distributed


def _sizes(n_local: int, device: torch.device) -> list[int]:
    """The first-dimension size of every process's local tensor."""
    local = torch.tensor([n_local], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, local)
    return [int(s.item()) for s in sizes]


def gather_with_grad(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenation over processes (rank order) of tensors whose first dimensions are `sizes`.

    Gradients flow back to every process's input (the backward pass sums the copies).
    """
    from torch.distributed.nn.functional import all_gather

    longest = max(sizes)
    pad = [0, 0] * (tensor.dim() - 1) + [0, longest - tensor.shape[0]]
    with warnings.catch_warnings():  # deprecated in favour of a private API; still the public one
        warnings.simplefilter("ignore", FutureWarning)
        parts = all_gather(F.pad(tensor, pad) if longest > tensor.shape[0] else tensor)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)], dim=0)


def global_batch_scores(model: nn.Module, images: torch.Tensor, captions: torch.Tensor,
                        lengths: torch.Tensor, boxes: torch.Tensor | None = None
                        ) -> torch.Tensor | dict[str, torch.Tensor]:
    """Train-mode scores of the global batch: (B, B), or {'sgr', 'saf'} of them for joint models.

    On one process this is `model(images, captions, lengths)`. On several, the arguments are this
    process's share of the batch (rank r holds a contiguous slice; shares may differ by one).

    Args:
        model: an `SGRAF` in train mode.
        images: (n_local, K, img_dim).
        captions: (n_local, L) word ids.
        lengths: (n_local,).
        boxes: (n_local, K, 4) normalised region boxes for a model with positions, else None.
    """
    if not is_distributed():
        return model(images, captions, lengths) if boxes is None else model(images, captions, lengths, boxes)
    all_img_embs, cap_embs, sizes = _encode_and_gather(model, images, captions, lengths, boxes)
    if getattr(model.config, "module", None) == "joint":
        columns = model.similarity_heads(all_img_embs, cap_embs, lengths)  # {'sgr','saf'}: (B, n_local)
        return {head: _gather_columns(block, sizes) for head, block in columns.items()}
    block = model.similarity(all_img_embs, cap_embs, lengths)            # (B, n_local)
    return _gather_columns(block, sizes)


def _encode_and_gather(model: nn.Module, images: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor,
                       boxes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """This process's share encoded: every process's image embeddings (B, K, d), gathered with
    gradient flow in rank order, this process's caption embeddings (n_local, L, d), and every
    process's share size."""
    img_embs = (model.encode_images(images) if boxes is None
                else model.encode_images(images, boxes))                 # (n_local, K, d)
    cap_embs = model.encode_captions(captions, lengths)                  # (n_local, L, d)
    sizes = _sizes(img_embs.shape[0], communication_device())
    return gather_with_grad(img_embs, sizes), cap_embs, sizes


def global_batch_train_scores(model: nn.Module, images: torch.Tensor, captions: torch.Tensor,
                              lengths: torch.Tensor, boxes: torch.Tensor | None = None) -> Any:
    """`SGRAF.train_scores` of the global batch (`sgraf.training.pairs`): on one process the
    model's; on several, every process's images (gathered with gradient flow, as in
    `global_batch_scores`) against this process's captions, the (B, B) matrix assembled from
    every process's columns (without autograd), and pairs scored again in this process's columns.
    """
    from sgraf.model.sgraf import TrainScores

    if not is_distributed():
        return model.train_scores(images, captions, lengths, boxes)
    all_img_embs, cap_embs, sizes = _encode_and_gather(model, images, captions, lengths, boxes)
    local = model.train_scores_from(all_img_embs, cap_embs, lengths)   # (B, n_local)
    start = sum(sizes[:dist.get_rank()])
    with torch.no_grad():
        values = {head: _gather_columns(block, sizes) for head, block in local.values.items()}
    return TrainScores(values, local.pairs, columns=slice(start, start + sizes[dist.get_rank()]),
                       copies=dist.get_world_size())


def global_vector_scores(model: nn.Module) -> torch.Tensor:
    """(B, B) cosines of the self-attention global vectors of the last train-mode scoring.

    For the auxiliary global-embedding loss. The vectors are the ones the scores used (the same
    dropout, VisualSA's BatchNorm advanced once); on several processes the image vectors already
    cover the global batch and the caption columns are gathered as the scores' are.
    """
    img_glo, cap_glo = getattr(model, "train_global_vectors", (None, None))
    if img_glo is None or cap_glo is None:
        raise RuntimeError("no global vectors: score a batch in train mode with global alignments first")
    block = img_glo @ cap_glo.t()                                        # (B, n_local)
    if not is_distributed():
        return block
    return _gather_columns(block, _sizes(cap_glo.shape[0], communication_device()))


def _gather_columns(block: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(B, n_local) column blocks of every process -> (B, B)."""
    return gather_with_grad(block.t(), sizes).t()


def gather_ids(ids: torch.Tensor) -> torch.Tensor:
    """Concatenation over processes of a 1-D id tensor (no gradient), on its device."""
    return all_gather_cat(ids)


def average_gradients(parameters: list[torch.Tensor]) -> None:
    """Averages `.grad` over processes in one flat all-reduce (missing gradients count as zero)."""
    if not is_distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    device = communication_device()
    reduced = flat.to(device)
    dist.all_reduce(reduced)
    reduced = reduced.to(flat.device) / dist.get_world_size()
    offset = 0
    for p, g in zip(parameters, grads):
        p.grad = reduced[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def per_caption_norms(model: nn.Module) -> list[nn.BatchNorm1d]:
    """The BatchNorms that advance once per caption (SAF's) rather than once per batch."""
    from sgraf.model.filtration import AttentionFiltration

    return [m.bn for m in model.modules() if isinstance(m, AttentionFiltration)]


def snapshot_norms(norms: list[nn.BatchNorm1d]) -> list[dict[str, Any]]:
    return [{"mean": bn.running_mean.detach().double().clone(), "var": bn.running_var.detach().double().clone(),
             "count": int(bn.num_batches_tracked)} for bn in norms]


def merge_per_caption_norms(norms: list[nn.BatchNorm1d], before: list[dict[str, Any]]) -> None:
    """Makes per-caption BatchNorm running statistics those of one process over the global batch.

    Rank r applied `x <- (1 - m) x + m s_c` for its n_r captions, ending at
    `(1 - m)^n_r x0 + D_r`. One process over all captions in rank order ends at
    `(1 - m)^N x0 + sum_r (1 - m)^(captions after rank r) D_r`.
    """
    if not norms or not is_distributed():
        return
    world = dist.get_world_size()
    for bn, start in zip(norms, before):
        if bn.momentum is None:
            raise ValueError("per-caption BatchNorm with momentum=None cannot be merged across processes")
        n_local = int(bn.num_batches_tracked) - start["count"]
        decay = 1.0 - float(bn.momentum)
        own = torch.cat([
            torch.tensor([float(n_local)], dtype=torch.float64),
            (bn.running_mean.detach().double().cpu() - decay ** n_local * start["mean"].cpu()),
            (bn.running_var.detach().double().cpu() - decay ** n_local * start["var"].cpu()),
        ])
        device = communication_device()
        parts = [torch.empty_like(own, device=device) for _ in range(world)]
        dist.all_gather(parts, own.to(device))
        parts = [p.cpu() for p in parts]
        counts = [int(p[0].item()) for p in parts]
        total = sum(counts)
        channels = bn.running_mean.numel()
        mean = decay ** total * start["mean"].cpu()
        var = decay ** total * start["var"].cpu()
        after = total
        for part, count in zip(parts, counts):
            after -= count
            mean = mean + decay ** after * part[1:1 + channels]
            var = var + decay ** after * part[1 + channels:]
        with torch.no_grad():
            bn.running_mean.copy_(mean.to(bn.running_mean))
            bn.running_var.copy_(var.to(bn.running_var))
            bn.num_batches_tracked.fill_(start["count"] + total)
