"""Must-show: one and two optimisation steps through `train_step` equal the authors' code.

tests/data/golden_train.pt holds, for SGR and SAF, a batch of 6 pairs, the model before, and
the state after one and two official steps (Adam lr 2e-4, clipping at 2.0, dropout off). See
its `note` key. Tolerances come from `numerics` (float32 noise scaled by what is compared);
the tensors whose exact gradient is zero or ~1e-12 (`noise_dominated_grads`, biases in front of
a BatchNorm or a softmax) get `adam_noise`: Adam turns their float noise into updates of up to lr.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch

from model_helpers import needs_fused_adam_on_cpu
from numerics import AUTHORS, GRADIENT, STEP, adam_noise, approx, assert_close, excess, largest
from sgraf.config import ModelConfig
from sgraf.kernels import plan
from sgraf.model.sgraf import SGRAF
from sgraf.training.config import preset
from sgraf.training.step import build_optimizer, train_step

pytestmark = pytest.mark.numeric

LR = 2e-4


DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def golden():
    return torch.load(DATA / "golden_train.pt", weights_only=True)


def _flat(parts: dict) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": tensor for prefix, part in parts.items() for name, tensor in part.items()}


def _setup(golden, name: str):
    case = golden[name]
    opt = case["config"]
    assert case["optimizer"]["lr"] == LR and case["grad_clip"] == 2.0
    model_config = ModelConfig(vocab_size=opt["vocab_size"], img_dim=opt["img_dim"], word_dim=opt["word_dim"],
                               embed_size=opt["embed_size"], sim_dim=opt["sim_dim"], num_regions=opt["n_regions"],
                               module=name.lower(), sgr_step=opt["sgr_step"], dropout=0.0)
    model = SGRAF(model_config)
    model.load_state_dict(_flat(case["state_dict_before"]))
    # The paper's recipe (Adam 2e-4, clip 2.0, margin 0.2, hardest negatives), fp32.
    config = preset("f30k-sgr" if name == "SGR" else "f30k-saf")
    optimizer = build_optimizer(model, config)
    batch = SimpleNamespace(images=case["images"], captions=case["captions"],
                            lengths=torch.as_tensor(case["lengths"]), image_ids=torch.arange(6))
    return case, model, config, optimizer, batch


def _assert_params(state: dict, after: dict, noisy: set, steps: int) -> None:
    """Parameters and buffers after `steps` steps equal the authors' (see the module docstring)."""
    scale = largest([v for k, v in after.items() if not k.endswith("num_batches_tracked")])
    for key, expected in after.items():
        if key.endswith("num_batches_tracked"):
            # VisualSA's BatchNorms advance once per forward, SAF's once per caption (6).
            assert int(state[key]) == int(expected), key
        elif key in noisy:
            assert (state[key] - expected).abs().max() <= adam_noise(LR, steps), key
        elif steps > 1 and key.endswith("running_mean"):
            # A BatchNorm's running mean includes the noise-dominated bias of the layer in front
            # of it (which the normalisation itself cancels): it inherits that bias's spread.
            assert (state[key] - expected).abs().max() < LR, key
        else:
            assert_close(state[key], expected, STEP, scale=scale, what=key)


@pytest.mark.parametrize("name", ["SGR", "SAF"])
def test_one_step_matches_authors(golden, name):
    case, model, config, optimizer, batch = _setup(golden, name)
    result = train_step(model, optimizer, batch, config)

    assert result.loss == approx(case["loss"], AUTHORS)
    assert result.grad_norm == approx(case["grad_norm"], GRADIENT)
    # The gradients left on the parameters are the clipped ones (SAF's norm 2.7 > 2.0 is clipped).
    named = dict(model.named_parameters())
    assert set(named) == set(case["grads_clipped"])
    scale = largest(case["grads_clipped"])
    for key, expected in case["grads_clipped"].items():
        assert_close(named[key].grad, expected, GRADIENT, scale=scale, what=key)

    after = _flat(case["state_dict_after"])
    state = model.state_dict()
    assert set(state) == set(after)
    _assert_params(state, after, set(case["noise_dominated_grads"]), steps=1)
    for key, (before, after_count) in case["num_batches_tracked_before_after"].items():
        assert int(state[key]) == after_count and after_count - before == (6 if "SAF" in key else 1)


@pytest.mark.parametrize("name", ["SGR", "SAF"])
def test_second_step_matches_authors(golden, name):
    """`step2`: the same batch again, so Adam's moments and the BatchNorm statistics carry over."""
    case, model, config, optimizer, batch = _setup(golden, name)
    train_step(model, optimizer, batch, config)
    result = train_step(model, optimizer, batch, config)
    step2 = case["step2"]
    assert result.loss == approx(step2["loss"], AUTHORS)
    assert result.grad_norm == approx(step2["grad_norm"], GRADIENT)
    _assert_params(model.state_dict(), _flat(step2["state_dict_after"]), set(case["noise_dominated_grads"]), steps=2)


@needs_fused_adam_on_cpu
@pytest.mark.parametrize("name", ["SGR", "SAF"])
def test_two_steps_under_the_gpu_plan_match_authors(golden, name):
    """The plan a CUDA device gets, run on the CPU (`plan.emulate_gpu`): the batch in one chunk,
    PyTorch's own matmuls, Adam's fused kernel, nothing read back from the device inside the step."""
    with plan.emulate_gpu():
        case, model, config, optimizer, batch = _setup(golden, name)
        assert optimizer.defaults["fused"]
        first = train_step(model, optimizer, batch, config)
        assert first.loss == approx(case["loss"], AUTHORS)
        assert first.grad_norm == approx(case["grad_norm"], GRADIENT)
        result = train_step(model, optimizer, batch, config)
    step2 = case["step2"]
    assert result.loss == approx(step2["loss"], AUTHORS)
    assert result.grad_norm == approx(step2["grad_norm"], GRADIENT)
    _assert_params(model.state_dict(), _flat(step2["state_dict_after"]), set(case["noise_dominated_grads"]), steps=2)


@pytest.mark.parametrize("keep_share", [0.25, 0.0])
@pytest.mark.parametrize("name", ["SGR", "SAF"])
def test_a_step_in_several_chunks_under_the_gpu_plan_matches_authors(golden, name, keep_share, monkeypatch):
    """The GPU plan's training cut (several chunks since the H200 sweep, `TRAIN_GPU_CHUNK_PAIRS`),
    with every chunk's intermediates kept (the default share) or every chunk recomputed: the
    same loss and gradients as the authors' one pass."""
    from sgraf.kernels import train_chunks

    monkeypatch.setattr(train_chunks, "TRAIN_GPU_KEEP_SHARE", keep_share)
    with plan.emulate_gpu():
        case, model, config, optimizer, batch = _setup(golden, name)
        model.train_chunk = 2                                       # 6 captions: 3 chunks
        assert len(model.train_chunks(6, batch.lengths)) == 3
        first = train_step(model, optimizer, batch, config)
    assert first.loss == approx(case["loss"], AUTHORS)
    assert first.grad_norm == approx(case["grad_norm"], GRADIENT)
    named = dict(model.named_parameters())
    scale = largest(case["grads_clipped"])
    for key, expected in case["grads_clipped"].items():
        assert_close(named[key].grad, expected, GRADIENT, scale=scale, what=key)
    state = model.state_dict()
    # parameters, and SAF's running statistics applied per caption in caption order across chunks
    _assert_params(state, _flat(case["state_dict_after"]), set(case["noise_dominated_grads"]), steps=1)
    for key, (_, after_count) in case["num_batches_tracked_before_after"].items():
        assert int(state[key]) == after_count


def test_without_clipping_the_update_differs(golden):
    """The SAF case is clipped (norm 2.7 > 2.0): skipping the clip must change the result."""
    case, model, config, optimizer, batch = _setup(golden, "SAF")
    train_step(model, optimizer, batch, config.replace(grad_clip=0.0))
    grads = {k: p.grad for k, p in model.named_parameters()}
    scale = largest(case["grads"])
    for key, grad in grads.items():      # unclipped gradients equal the authors' raw gradients
        assert_close(grad, case["grads"][key], GRADIENT, scale=scale, what=key)
    # and miss the clipped ones by far more than float32 noise: the skipped clip is caught
    worst = max(excess(grads[k], case["grads_clipped"][k], GRADIENT, scale=scale) for k in grads)
    assert worst > 100
