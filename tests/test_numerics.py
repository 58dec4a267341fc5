"""The tolerances of `numerics` catch real bugs, and the helper itself.

Each mistake below is of the size real bugs have (a dropped term, a wrong sign, statistics over
the wrong set, a biased variance, a skipped clip: see test_train_golden.py's
`test_without_clipping_the_update_differs`), made on purpose in an otherwise correct model, and
must miss the authors' numbers by at least 10x the budget the real tests allow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_helpers import DATA, flat_state, golden_model
from numerics import AUTHORS, EPS, GRADIENT, STEP, assert_close, conditioned_scale, excess, largest, mismatch
from sgraf.model.filtration import AttentionFiltration
from sgraf.model.loss import ranking_loss

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def golden_train():
    return torch.load(DATA / "golden_train.pt", weights_only=True)


@pytest.fixture(scope="module")
def perturbed():
    return torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)


def _gradients(entry, module):
    model = golden_model(entry, module, state_key="state_dict_before", dropout=0.0).train()
    ranking_loss(model(entry["images"], entry["captions"], entry["lengths"])).backward()
    return model, {name: p.grad for name, p in model.named_parameters()}


def _worst_gradient(grads, expected):
    scale = largest(expected)
    return max(excess(grads[k], expected[k], GRADIENT, scale=scale) for k in expected)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_a_dropped_bias_misses_the_golden_scores(perturbed, module):
    """Eq. 1 without its `+ b` in the local similarity layer."""
    entry = perturbed[module]
    model = golden_model(entry, module)
    assert_close(model.score(entry["images"], entry["captions"], entry["lengths"]), entry["sims"], AUTHORS)
    with torch.no_grad():
        model.sim_enc.sim_tranloc_w.bias.zero_()
    scores = model.score(entry["images"], entry["captions"], entry["lengths"])
    assert excess(scores, entry["sims"], AUTHORS) > 10


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_a_wrong_sign_in_a_hand_written_backward_misses_the_golden_gradients(golden_train, monkeypatch, module):
    """The weight gradient of `W_loc` in `_LocalNodes.backward` with its sign flipped."""
    import sgraf.kernels.nodes as nodes

    entry = golden_train[module]
    _, grads = _gradients(entry, module)
    assert _worst_gradient(grads, entry["grads"]) <= 1
    correct = nodes.weight_gradient
    monkeypatch.setattr(nodes, "weight_gradient", lambda rows, inputs: -correct(rows, inputs))
    _, grads = _gradients(entry, module)
    assert excess(grads["sim_enc.sim_tranloc_w.weight"], entry["grads"]["sim_enc.sim_tranloc_w.weight"], GRADIENT,
                  scale=largest(entry["grads"])) > 10


def test_saf_statistics_over_the_whole_batch_miss_the_golden_step(golden_train, monkeypatch):
    """SAF's training BatchNorm over every caption at once instead of one caption at a time (what
    a naive vectorisation of the authors' per-caption loop computes)."""
    entry = golden_train["SAF"]
    correct = AttentionFiltration.per_caption_batch_norm

    def batch_wide(self, logits, node_mask):
        normed, means, variances = correct(self, logits.reshape(-1, 1, logits.size(1) * logits.size(2)),
                                           node_mask.reshape(1, -1))
        n_cap = logits.size(1)
        return normed.view_as(logits), means.expand(n_cap), variances.expand(n_cap)

    monkeypatch.setattr(AttentionFiltration, "per_caption_batch_norm", batch_wide)
    model, grads = _gradients(entry, "SAF")
    with torch.no_grad():
        scores = model(entry["images"], entry["captions"], entry["lengths"])
    assert excess(scores, entry["sims"], AUTHORS) > 10
    assert _worst_gradient(grads, entry["grads"]) > 10


def test_a_biased_running_variance_misses_the_golden_state(golden_train, monkeypatch):
    """SAF's running variance advanced with the biased batch variance (PyTorch's BatchNorm uses
    the unbiased one; over 6 images x about 12 nodes the two differ by about 1.4 %)."""
    entry = golden_train["SAF"]
    correct = AttentionFiltration.per_caption_batch_norm

    def biased(self, logits, node_mask):
        normed, means, variances = correct(self, logits, node_mask)
        count = logits.size(0) * node_mask.sum(dim=1).to(variances.dtype)
        return normed, means, variances * (count - 1) / count

    model = golden_model(entry, "SAF", state_key="state_dict_before", dropout=0.0).train()
    monkeypatch.setattr(AttentionFiltration, "per_caption_batch_norm", biased)
    with torch.no_grad():
        model(entry["images"], entry["captions"], entry["lengths"])
    expected = flat_state(entry["state_dict_after"])
    scale = largest([v for k, v in expected.items() if not k.endswith("num_batches_tracked")])
    key = "sim_enc.SAF_module.bn.running_var"
    assert excess(model.state_dict()[key], expected[key], STEP, scale=scale) > 10


# ---------------------------------------------------------------- the helper itself
def test_the_budget_is_ulps_of_the_reference_scale():
    reference = np.array([0.5, -2.0, 1e-3], dtype=np.float32)
    allowed = 64 * EPS * 2.0
    assert mismatch(reference + np.float32(0.9 * allowed), reference, 64) is None
    problem = mismatch(reference + np.array([0, 0, 1.1 * allowed]), reference, 64, what="x")
    assert problem.startswith("x: max |diff|") and "exceeds 64 ulps of 2" in problem and "(2,)" in problem
    # an explicit scale (a sum that cancels keeps the error of its large terms)
    assert mismatch(np.array([1e-9]), np.array([0.0]), 64, scale=1.0) is None
    assert mismatch(np.array([1e-9]), np.array([0.0]), 64) is not None


def test_the_conditioned_scale_is_raised_only_as_far_as_float32_misses_float64():
    exact = {"a": torch.tensor([1.0, -3.0], dtype=torch.float64), "b": torch.tensor([0.25], dtype=torch.float64)}
    close = {name: value.float() for name, value in exact.items()}     # one rounding: the scale stands
    assert conditioned_scale(close, exact, 3.0) == 3.0
    off = {"a": close["a"] + torch.tensor([0.0, 1e-3]), "b": close["b"]}   # float32 1e-3 off float64
    scale = conditioned_scale(off, exact, 3.0)
    assert scale == pytest.approx(1e-3 / (64 * EPS), rel=1e-3) and scale > 3.0
    assert conditioned_scale(off, exact, 3.0, ulps=128) == pytest.approx(scale / 2)
    assert conditioned_scale(off["a"], exact["a"], 3.0) == pytest.approx(scale)       # tensors alike
    # two float32 orders as far apart as float32 is from float64 pass at that scale; a wrong value does not
    assert mismatch(off["a"] + 1e-2, off["a"], GRADIENT, scale=scale) is None     # 10x float32's error
    assert mismatch(off["a"] + 0.5, off["a"], GRADIENT, scale=scale) is not None


def test_nan_shape_and_infinity_are_mismatches_unless_shared():
    assert "NaN" in mismatch(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]), 64)
    assert mismatch(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]), 64) is None
    assert mismatch(torch.tensor([float("inf")]), torch.tensor([float("inf")]), 64) is None
    assert "NaN or inf" in mismatch(torch.tensor([float("inf")]), torch.tensor([1.0]), 64)
    assert "shape" in mismatch(torch.zeros(2, 3), torch.zeros(3, 2), 64)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close(torch.ones(3), torch.zeros(3), 64, scale=1.0)
