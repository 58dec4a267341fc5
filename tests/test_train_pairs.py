"""The training step's backward through the pairs its loss reads (`sgraf.training.pairs`): the
same loss and gradients as the backward through the whole score matrix."""

from __future__ import annotations

import pytest
import torch

from model_helpers import random_model, step_gradients, training_batch
from sgraf.errors import InputError
from sgraf.model.loss import max_pairs, ranking_loss
from sgraf.training import pairs
from sgraf.training.config import preset
from sgraf.training.step import NonFiniteLossError, train_step

LENGTHS = [3, 7, 5, 2, 7, 4, 6, 3, 5, 8]
# hardest negatives, and a recipe's batch that takes the pairs' backward (the steps here take 10 pairs)
HARDEST = dict(max_violation=True, batch_size=pairs.MIN_BATCH)


def _batch(model, image_ids=None, seed=1):
    return training_batch(model, LENGTHS, image_ids, seed)


def _gradients(model, batch, config, pair_backward):
    """The loss and every parameter's gradient of one step (nothing updated: SGD at rate 0)."""
    result, grads = step_gradients(model, batch, config.replace(pair_backward=pair_backward, grad_clip=0.0))
    return result.loss, grads


def _largest_difference(dense, by_pairs):
    """The largest gradient difference, relative to the whole gradient's norm."""
    assert dense.keys() == by_pairs.keys()
    norm = torch.sqrt(sum(g.double().square().sum() for g in dense.values()))
    return max(float((dense[k].double() - by_pairs[k].double()).abs().max() / norm) for k in dense)


CONFIGS = [dict(module="sgr"), dict(module="sgr", alignments="local"), dict(module="ave"),
           dict(module="sgr", sgr_step=1)]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_the_pairs_backward_gives_the_whole_matrix_gradients_to_float64_rounding(options, monkeypatch):
    model = random_model(**options).double()
    batch = _batch(model)
    batch.images = batch.images.double()
    config = preset("tiny").replace(**HARDEST)
    assert pairs.applies(model, config)
    selected = []
    listing = pairs.loss_and_pairs
    monkeypatch.setattr(pairs, "loss_and_pairs", lambda *args: selected.append(listing(*args)) or selected[-1])
    loss, dense = _gradients(model, batch, config, pair_backward=False)
    assert selected == []
    pair_loss, by_pairs = _gradients(model, batch, config, pair_backward=True)
    # the backward went through at most three pairs per caption, the positives among them
    (_, rows, cols, _), = selected
    assert len(rows) <= 3 * len(LENGTHS) and set(range(len(LENGTHS))) <= set(rows[rows == cols].tolist())
    assert pair_loss == pytest.approx(loss, rel=1e-12)
    assert _largest_difference(dense, by_pairs) < 1e-12


@pytest.mark.parametrize("extra", [dict(same_image_positive=True), dict(global_loss_weight=0.5)],
                         ids=["same-image-positives", "global-loss"])
def test_positives_and_the_auxiliary_loss_take_the_same_gradients(extra):
    model = random_model(module="sgr").double()
    batch = _batch(model, image_ids=[0, 0, 1, 2, 2, 2, 3, 4, 5, 5])
    batch.images = batch.images.double()
    config = preset("tiny").replace(**HARDEST, **extra)
    loss, dense = _gradients(model, batch, config, pair_backward=False)
    pair_loss, by_pairs = _gradients(model, batch, config, pair_backward=True)
    assert pair_loss == pytest.approx(loss, rel=1e-12)
    assert _largest_difference(dense, by_pairs) < 1e-12


def test_a_place_model_takes_the_same_gradients_in_float32():
    model = random_model(module="sgr", positions="place")
    batch = _batch(model)
    config = preset("tiny").replace(module="sgr", positions="place", **HARDEST)
    loss, dense = _gradients(model, batch, config, pair_backward=False)
    pair_loss, by_pairs = _gradients(model, batch, config, pair_backward=True)
    assert pair_loss == pytest.approx(loss, rel=1e-6)
    assert _largest_difference(dense, by_pairs) < 1e-5


def test_train_scores_are_the_forward_scores_and_a_pair_is_its_matrix_entry():
    model = random_model(module="sgr").train()
    batch = _batch(model)
    torch.manual_seed(3)
    dense = model(batch.images, batch.captions, batch.lengths)
    torch.manual_seed(3)
    scores = model.train_scores(batch.images, batch.captions, batch.lengths)
    assert not scores.values["sgr"].requires_grad
    torch.testing.assert_close(scores.values["sgr"], dense.detach(), rtol=0, atol=1e-6)
    rows, cols = torch.tensor([0, 9, 4, 4, 2]), torch.tensor([0, 3, 1, 9, 2])
    again = scores.pairs(rows, cols)["sgr"]
    assert again.requires_grad and again.shape == (5,)
    torch.testing.assert_close(again, scores.values["sgr"][rows, cols], rtol=0, atol=1e-6)


@pytest.mark.parametrize("columns", [slice(None), slice(0, 5), slice(5, 12)], ids=["all", "first", "last"])
def test_the_device_listing_without_a_read_gives_the_exact_listing_weights(columns):
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(12, 12, generator=generator)
    values[:, 7] += 0.5          # image rows whose hardest negative is caption 7: many entries in one column
    width = len(range(12)[columns])
    exact = pairs.loss_and_pairs(values, ranking_loss, None, columns)
    bounded = pairs.loss_and_pairs(values, ranking_loss, max_pairs(12, width), columns)
    assert len(exact[1]) <= max_pairs(12, width) == len(bounded[1])
    dense = []
    for loss, rows, cols, weights in (exact, bounded):
        matrix = torch.zeros(12, width)
        matrix.index_put_((rows, cols), weights, accumulate=True)
        dense.append(matrix)
    assert exact[0] == bounded[0]
    torch.testing.assert_close(dense[0], dense[1], rtol=0, atol=0)
    leaf = values.clone().requires_grad_()
    ranking_loss(leaf).backward()
    torch.testing.assert_close(dense[0], leaf.grad[:, columns], rtol=0, atol=0)
    assert max_pairs(12, 12) == 36


def test_only_hardest_negatives_of_a_pair_coupling_free_model_take_it():
    config = preset("tiny").replace(**HARDEST)
    sgr = random_model(module="sgr")
    assert pairs.applies(sgr, config)
    assert not pairs.applies(sgr, config.replace(pair_backward=False))
    assert not pairs.applies(sgr, config.replace(max_violation=False))
    assert not pairs.applies(sgr, config.replace(batch_size=pairs.MIN_BATCH - 1))
    warm = config.replace(warmup_epochs=1)
    assert not pairs.applies(sgr, warm.loss_for_epoch(0)) and pairs.applies(sgr, warm.loss_for_epoch(1))
    for module in ("saf", "joint"):
        model = random_model(module=module)
        assert not model.pair_training and not pairs.applies(model, config.replace(module=module))
    assert not random_model(module="ave", similarity="scalar").pair_training


@pytest.mark.parametrize("module, training", [("saf", True), ("sgr", False)])
def test_train_scores_refuses_a_model_it_cannot_serve(module, training):
    model = random_model(module=module).train(training)
    batch = _batch(model)
    with pytest.raises(InputError, match="train mode"):
        model.train_scores(batch.images, batch.captions, batch.lengths)


def test_a_non_finite_loss_stops_the_step_before_any_pair_is_scored_again(monkeypatch):
    model = random_model(module="sgr")
    batch = _batch(model)
    batch.images[3, 0, 0] = float("nan")
    optimizer = torch.optim.Adam(model.parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rescored = []
    monkeypatch.setattr(type(model), "_pair_scores", lambda self, *a: rescored.append(a) or {})
    with pytest.raises(NonFiniteLossError, match="images \\[3\\]"):
        train_step(model, optimizer, batch, preset("tiny").replace(**HARDEST))
    assert rescored == []
    for name, parameter in model.named_parameters():   # no update
        torch.testing.assert_close(parameter.detach(), before[name], rtol=0, atol=0)


def test_the_pairs_gather_their_images_and_captions_with_a_gradient_summed_in_a_fixed_order(monkeypatch):
    """The pairs repeat images and captions. `x[index]`'s gradient (`index_put_` accumulating)
    summed the repeated rows in the order two threads reached them, so two runs of one training
    step gave other gradients by rounding; `gather_rows` (`index_select`, its gradient
    `index_add_`) sums them in a fixed order. Every gather of the pairs goes through it."""
    from sgraf.kernels import plan
    from sgraf.kernels import train_chunks

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        rows = torch.randint(0, 64, (192,), generator=generator)          # images repeated
        regions = torch.randn(64, 36, 64, generator=generator)
        upstream = torch.randn(192, 36, 64, generator=generator)
        gradients = []
        for _ in range(8):
            leaf = regions.clone().requires_grad_()
            train_chunks.gather_rows(leaf, rows).backward(upstream)
            gradients.append(leaf.grad)
        assert all(torch.equal(gradients[0], grad) for grad in gradients[1:])
        with plan.emulate_gpu():                                           # a CUDA tensor's: as x[index]
            assert torch.equal(train_chunks.gather_rows(regions, rows), regions[rows])
    finally:
        torch.set_num_threads(threads)

    gathered = []
    real = train_chunks.gather_rows
    monkeypatch.setattr(train_chunks, "gather_rows", lambda tensor, index: gathered.append(tuple(tensor.shape))
                        or real(tensor, index))
    model = random_model(module="sgr")
    batch = training_batch(model, [3, 7, 5, 2, 7, 4, 6, 3] * 4)
    step_gradients(model, batch, preset("tiny").replace(max_violation=True, batch_size=pairs.MIN_BATCH, grad_clip=0.0))
    dim = model.config.embed_size
    # per pair group: the regions, the words, the images' and the captions' global vectors
    assert gathered and all(shape[-1] == dim for shape in gathered)
    assert {len(shape) for shape in gathered} == {2, 3}
