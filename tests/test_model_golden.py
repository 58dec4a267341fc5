"""The authors' numbers: golden eval-mode scores, embeddings and losses, official checkpoints."""

from __future__ import annotations

import pytest
import torch

from numerics import AUTHORS, ROUNDING, approx, assert_close
from model_helpers import DATA, golden_model
from sgraf.checkpoint import load_model
from sgraf.model.loss import ranking_loss

pytestmark = pytest.mark.numeric

GOLDEN = ["golden_small.pt", "golden_small_perturbed.pt"]


@pytest.fixture(scope="module", params=GOLDEN)
def golden(request):
    return torch.load(DATA / request.param, weights_only=True)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_eval_embeddings_scores_and_loss_match_golden(golden, module):
    entry = golden[module]
    model = golden_model(entry, module)
    with torch.no_grad():
        img_embs = model.encode_images(entry["images"])
        cap_embs = model.encode_captions(entry["captions"], entry["lengths"])
        sims = model.similarity(img_embs, cap_embs, entry["lengths"])
    assert_close(img_embs, entry["img_embs"], AUTHORS, what="image embeddings")
    assert_close(cap_embs, entry["cap_embs"], AUTHORS, what="caption embeddings")
    assert_close(sims, entry["sims"], AUTHORS, what="similarity")
    scored = model.score(entry["images"], entry["captions"], entry["lengths"])
    assert scored.dtype == torch.float32
    assert_close(scored, entry["sims"], AUTHORS, what="score")
    square = scored[:, :7]
    assert_close(square, entry["sims_square"], AUTHORS)
    assert ranking_loss(square).item() == approx(entry["loss"], AUTHORS)
    assert ranking_loss(square, max_violation=False).item() == approx(entry["loss_sum_violation"], AUTHORS)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_float64_run_matches_golden_float64(golden, module):
    entry = golden[module]
    model = golden_model(entry, module).double()
    scored = model.score(entry["images"].double(), entry["captions"], entry["lengths"])
    # score() returns float32; compare before rounding through similarity()
    with torch.no_grad():
        sims = model.similarity(model.encode_images(entry["images"].double()),
                                model.encode_captions(entry["captions"], entry["lengths"]), entry["lengths"])
    # float64: the same rule with float64's epsilon (2^-52), i.e. AUTHORS ulps of float64
    assert (sims - entry["sims_f64"]).abs().max() <= AUTHORS * torch.finfo(torch.float64).eps
    # score() rounds the float64 result once to float32, as the golden float64 was rounded here
    assert_close(scored, entry["sims_f64"].float(), ROUNDING)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_shuffled_captions_give_permuted_columns(golden, module):
    entry = golden[module]
    model = golden_model(entry, module)
    perm = torch.randperm(entry["captions"].size(0), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor(entry["lengths"])[perm]
    scored = model.score(entry["images"], entry["captions"][perm], lengths)
    assert_close(scored, entry["sims"][:, perm], AUTHORS)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_official_checkpoint_loads_and_scores_like_golden(module):
    golden = torch.load(DATA / "golden_small.pt", weights_only=True)[module]
    model = load_model(DATA / f"official_ckpt_{module}.pth.tar")
    assert not model.training
    assert model.config.module == module.lower()
    assert model.config.num_regions == 36 and model.config.img_dim == 48 and model.config.sim_dim == 8
    assert model.vocab is None
    scored = model.score(golden["images"], golden["captions"], golden["lengths"])
    assert_close(scored, golden["sims"], AUTHORS)


def test_top_level_load_model_is_the_checkpoint_loader():
    import sgraf

    model = sgraf.load_model(DATA / "official_ckpt_SGR.pth.tar", map_location="cpu")
    assert isinstance(model, sgraf.SGRAF)
