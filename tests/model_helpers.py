"""Shared helpers for the model tests: golden files -> SGRAF models and random tiny models."""

from __future__ import annotations

import pathlib

import pytest
import torch

from sgraf import torch_compat
from sgraf.config import ModelConfig
from sgraf.model.sgraf import SGRAF

DATA = pathlib.Path(__file__).parent / "data"


# the emulated GPU plan's training step runs Adam's fused kernel on CPU tensors: PyTorch 2.4 and later
needs_fused_adam_on_cpu = pytest.mark.skipif(
    not torch_compat.fused_adam_runs(torch.device("cpu")),
    reason="the emulated GPU plan's step needs Adam's fused kernel on the CPU (PyTorch 2.4 or later)")
# sgraf's compiled paths (`sgraf.kernels.compiled`) need PyTorch 2.5 or later
needs_compile = pytest.mark.skipif(not torch_compat.compile_supported(),
                                   reason="sgraf's compiled paths need PyTorch 2.5 or later")

def golden_config(entry: dict, module: str, dropout: float = 0.4) -> ModelConfig:
    opts = entry["config"]
    return ModelConfig(vocab_size=opts["vocab_size"], img_dim=opts["img_dim"], word_dim=opts["word_dim"],
                       embed_size=opts["embed_size"], sim_dim=opts["sim_dim"], num_regions=opts["n_regions"],
                       num_layers=opts["num_layers"], bi_gru=opts["bi_gru"], img_norm=not opts["no_imgnorm"],
                       txt_norm=not opts["no_txtnorm"], module=module.lower(), sgr_step=opts["sgr_step"],
                       dropout=dropout)


def flat_state(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": tensor for prefix, part in parts.items() for name, tensor in part.items()}


def golden_model(entry: dict, module: str, state_key: str = "state_dict", dropout: float = 0.4) -> SGRAF:
    model = SGRAF(golden_config(entry, module, dropout))
    model.load_state_dict(flat_state(entry[state_key]))
    return model.eval()


def random_model(seed: int = 0, *, vocab_size: int = 30, img_dim: int = 20, embed_size: int = 16, sim_dim: int = 12,
                 num_regions: int = 5, dropout: float = 0.0, **config) -> SGRAF:
    """A tiny model with random (non-zero) biases and BatchNorm statistics."""
    torch.manual_seed(seed)
    model = SGRAF(ModelConfig(vocab_size=vocab_size, img_dim=img_dim, word_dim=8, embed_size=embed_size,
                              sim_dim=sim_dim, num_regions=num_regions, dropout=dropout, **config))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("bias"):
                tensor.normal_(0, 0.3)
            elif name.endswith("running_mean"):
                tensor.normal_(0, 0.2)
            elif name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5)
    return model.eval()


def random_batch(model: SGRAF, n_img: int, lengths: list[int], pad_to: int | None = None, seed: int = 1):
    """Images (n_img, K, D), captions `<start> w... <end>` zero-padded, lengths as given."""
    generator = torch.Generator().manual_seed(seed)
    cfg = model.config
    images = torch.randn(n_img, cfg.num_regions, cfg.img_dim, generator=generator)
    width = pad_to or max(lengths)
    captions = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, length in enumerate(lengths):
        captions[i, :length] = torch.randint(4, cfg.vocab_size, (length,), generator=generator)
        captions[i, 0] = 1
        captions[i, length - 1] = 2
    return images, captions, torch.tensor(lengths)


def training_batch(model: SGRAF, lengths: list[int], image_ids: list[int] | None = None, seed: int = 1):
    """A training batch of `len(lengths)` images and captions (`random_batch`), image i with
    caption i unless `image_ids` says otherwise, and region boxes for a place model."""
    from types import SimpleNamespace

    images, captions, token_counts = random_batch(model, len(lengths), lengths, seed=seed)
    boxes = None
    if model.needs_boxes:
        generator = torch.Generator().manual_seed(seed)
        corner = torch.rand(len(lengths), model.config.num_regions, 2, generator=generator)
        boxes = torch.cat([corner * 0.6, corner * 0.6 + 0.3], dim=2)
    ids = torch.arange(len(lengths)) if image_ids is None else torch.tensor(image_ids)
    return SimpleNamespace(images=images, captions=captions, lengths=token_counts, image_ids=ids, boxes=boxes)


def step_gradients(model: SGRAF, batch, config):
    """One `train_step` of a copy of `model` (nothing updated: SGD at rate 0): its result and
    every parameter's gradient."""
    import copy

    from sgraf.training.step import train_step

    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    result = train_step(model, optimizer, batch, config)
    return result, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
