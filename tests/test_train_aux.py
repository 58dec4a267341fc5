"""The optional auxiliary global-embedding loss (`global_loss_weight`), for search shortlists."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from numerics import REORDERED, approx
from sgraf.config import ModelConfig
from sgraf.errors import InputError
from sgraf.model.loss import ranking_loss
from sgraf.model.sgraf import SGRAF
from sgraf.training.config import preset
from sgraf.training.step import batch_loss, build_optimizer, train_step

pytestmark = pytest.mark.numeric


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


def make_problem(module: str = "sgr"):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 9, 4, 7, 6, 3])
    captions = torch.zeros(6, 9, dtype=torch.int64)
    for i, n in enumerate(lengths.tolist()):
        captions[i, :n] = torch.randint(4, 30, (n,), generator=gen)
        captions[i, 0], captions[i, n - 1] = 1, 2
    images = torch.randn(6, 6, 20, generator=gen)
    batch = SimpleNamespace(images=images, captions=captions, lengths=lengths, image_ids=torch.arange(6))
    config = ModelConfig(vocab_size=30, img_dim=20, word_dim=8, embed_size=16, sim_dim=8, num_regions=6,
                         module=module, sgr_step=2, dropout=0.0)
    torch.manual_seed(5)
    return SGRAF(config), batch


def _global_vector_loss(model, batch, config):
    """The auxiliary loss computed by hand from the model's self-attention global vectors."""
    img = model.encode_images(batch.images)
    words = model.encode_captions(batch.captions, batch.lengths)
    mask = torch.arange(words.shape[1])[None] < batch.lengths[:, None]
    v, t = model.sim_enc.global_vectors(img, words, mask)
    return ranking_loss(v @ t.t(), config.margin, config.max_violation)


@pytest.mark.parametrize("module", ["sgr", "saf", "joint"])
def test_the_step_adds_the_weighted_hinge_loss_of_global_cosines(module):
    weight = 0.7
    config = preset("tiny").replace(module=module, global_loss_weight=weight)
    model, batch = make_problem(module)
    reference = copy.deepcopy(model).train()
    main_loss = batch_loss(reference(batch.images, batch.captions, batch.lengths), config)
    expected = main_loss + weight * _global_vector_loss(copy.deepcopy(model).train(), batch, config)

    step = train_step(model, build_optimizer(model, config), batch, config)
    assert step.loss == approx(expected.item(), REORDERED)


def test_the_auxiliary_loss_changes_gradients_but_not_batchnorm_running_statistics():
    base = preset("tiny").replace(module="saf")
    runs = {}
    for weight in (0.0, 1.0):
        model, batch = make_problem("saf")
        config = base.replace(global_loss_weight=weight)
        train_step(model, build_optimizer(model, config), batch, config)
        runs[weight] = model.state_dict()
    buffers = [k for k in runs[0.0] if "running_" in k or "num_batches_tracked" in k]
    assert buffers
    for key in buffers:  # the global vectors are computed once per step: BatchNorm advances once
        assert torch.equal(runs[1.0][key], runs[0.0][key]), key
    weight_key = "sim_enc.t_global_w.embedding_common.0.weight"
    assert not torch.equal(runs[1.0][weight_key], runs[0.0][weight_key])


def test_global_loss_needs_global_vectors():
    with pytest.raises(InputError, match="global_loss_weight"):
        preset("tiny").replace(alignments="local", global_loss_weight=1.0)
    with pytest.raises(InputError, match="global_loss_weight"):
        preset("tiny").replace(global_loss_weight=-1.0)
