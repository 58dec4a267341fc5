"""The authors' own training step, from a checkout of their repository, for the benchmarks that time it.

`authors_module(DIR)` loads their model.py (Paranioar/SGRAF, branch python3.6: `git clone -b
python3.6 https://github.com/Paranioar/SGRAF`; nothing of it is copied here) with one edit that
changes no math: the loss's diagonal mask is put on the scores' device (their code defines it
only on a CUDA machine). `authors_step` builds their SGRAF on our model's weights (every tensor of
theirs checked) and returns a function running one `train_emb` on a batch; their `logger` is a
stub that keeps the loss. `calibrate_authors.py` steps it in one process beside the stand-in and
sgraf; `bench_train.py --theirs DIR` in a process of its own.
"""

from __future__ import annotations

import types
from pathlib import Path

# their loss builds the diagonal mask, and moves it to the GPU only when one is present
MASK_EDIT = ("        if torch.cuda.is_available():\n            I = mask.cuda()\n",
             "        I = mask.to(scores.device)\n")


class _Logger:
    """What their `train_emb` calls on `self.logger`: keeps the last loss."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def update(self, key: str, value: float, count: int = 1) -> None:
        self.values[key] = value


def authors_module(checkout: Path) -> types.ModuleType:
    """Their model.py as a module, with `MASK_EDIT` applied (an error if the file differs)."""
    path = checkout / "model.py"
    if not path.is_file():
        raise SystemExit(f"{checkout} has no model.py: give a checkout of Paranioar/SGRAF (branch python3.6)")
    source = path.read_text(encoding="utf-8")
    if source.count(MASK_EDIT[0]) != 1:
        raise SystemExit(f"{path}: the loss's mask is not where this harness expects it (branch python3.6?)")
    module = types.ModuleType("authors_model")
    module.__file__ = str(path)
    exec(compile(source.replace(*MASK_EDIT), str(path), "exec"), module.__dict__)   # noqa: S102
    return module


def authors_step(module: types.ModuleType, ours, batch, name: str):
    """Their SGRAF built on our model's weights and a function running one `train_emb` on `batch`
    (sorted by length, longest first, as their collate_fn gives it); returns the loss."""
    import torch

    config = ours.config
    opt = types.SimpleNamespace(grad_clip=2.0, img_dim=config.img_dim, embed_size=config.embed_size,
                                no_imgnorm=False, vocab_size=config.vocab_size, word_dim=config.word_dim,
                                num_layers=1, bi_gru=True, no_txtnorm=False, sim_dim=config.sim_dim,
                                module_name=name.upper(), sgr_step=3, margin=0.2, max_violation=True,
                                learning_rate=2e-4)
    model = module.SGRAF(opt)
    for theirs, mine in ((model.img_enc, ours.img_enc), (model.txt_enc, ours.txt_enc),
                         (model.sim_enc, ours.sim_enc)):
        state = mine.state_dict()
        theirs.load_state_dict(state)     # their EncoderImage's own load_state_dict takes no `strict`
        for key, value in theirs.state_dict().items():
            if key not in state or not torch.equal(value, state[key]):
                raise SystemExit(f"our model's {key} did not load into theirs")
        for layer in theirs.modules():
            if isinstance(layer, torch.nn.Dropout):
                layer.p = 0.0
    model.logger = _Logger()
    order = torch.sort(batch.lengths, descending=True, stable=True).indices
    images, captions = batch.images[order], batch.captions[order]
    lengths = batch.lengths[order].tolist()

    def step() -> float:
        model.train_start()
        model.train_emb(images, captions, lengths)
        return float(model.logger.values["Loss"])

    return step
