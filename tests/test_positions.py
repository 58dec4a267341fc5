"""A position-aware SGRAF (issue 21): regions with their boxes in the image encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_helpers import needs_compile, random_batch, random_model
from numerics import REORDERED, assert_close
from sgraf.checkpoint import load_model, save_model
from sgraf.config import ModelConfig
from sgraf.errors import InputError
from sgraf.model import blocks
from sgraf.model.positions import OBJECTNESS_GAIN, PLACE_GAIN, PlaceTerm, pair_geometry
from sgraf.model.sgraf import SGRAF
from sgraf.model.similarity import region_attention

POSITIONED = ("box", "relation", "place")


def _model(positions: str, module: str = "joint", seed: int = 0, **config):
    model = random_model(seed, module=module, positions=positions, **config)
    # The authors' VisualSelfAttention normalises each region SLOT with its own BatchNorm statistics,
    # which alone makes a trained model depend on the regions' order; equal statistics per slot
    # leave the order to the positions under test.
    with torch.no_grad():
        for norm in model.modules():
            if isinstance(norm, torch.nn.BatchNorm1d) and norm.num_features == model.config.num_regions:
                norm.running_mean.fill_(0.1)
                norm.running_var.fill_(1.2)
                norm.weight.fill_(0.9)
                norm.bias.fill_(0.05)
        if positions == "place":   # a new place term is zero (the model scores as without it)
            generator = torch.Generator().manual_seed(seed + 7)
            for parameter in model.sim_enc.place_term.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 / PLACE_GAIN)
    return model


def _boxes(n_img: int, k: int, seed: int = 2) -> torch.Tensor:
    """(n_img, K, 4) distinct normalised boxes."""
    generator = torch.Generator().manual_seed(seed)
    corner = torch.rand(n_img, k, 2, generator=generator) * 0.6
    size = torch.rand(n_img, k, 2, generator=generator) * 0.3 + 0.05
    return torch.cat([corner, corner + size], dim=-1)


def test_default_is_the_authors_model_and_old_configs_read_as_none():
    config = ModelConfig(vocab_size=10)
    assert config.positions == "none"
    values = config.to_dict()
    assert values["positions"] == "none"
    del values["positions"]                       # a checkpoint written before the field existed
    assert ModelConfig.from_dict(values).positions == "none"
    model = random_model(0)
    assert not model.needs_boxes
    assert not any("box_embed" in name or "relation" in name for name in model.state_dict())
    with pytest.raises(InputError, match="'positions' must be one of none, box, relation, place, got 'grid'"):
        ModelConfig(vocab_size=10, positions="grid")


@pytest.mark.parametrize("positions", POSITIONED)
def test_permuting_regions_with_their_boxes_leaves_every_score_unchanged(positions):
    model = _model(positions)
    assert model.needs_boxes
    images, captions, lengths = random_batch(model, 3, [7, 5, 4, 3])
    boxes = _boxes(3, model.config.num_regions)
    scores = model.score(images, captions, lengths, boxes=boxes)
    order = torch.tensor([3, 0, 4, 1, 2])
    permuted = model.score(images[:, order], captions, lengths, boxes=boxes[:, order])
    assert_close(permuted, scores, REORDERED)
    # ... while moving the regions without their boxes changes them: the positions are read
    moved = model.score(images[:, order], captions, lengths, boxes=boxes)
    assert (moved - scores).abs().max() > 1e-3


@pytest.mark.parametrize("positions", POSITIONED)
def test_swapping_two_objects_boxes_changes_the_score(positions):
    model = _model(positions)
    images, captions, lengths = random_batch(model, 2, [6, 4])
    boxes = _boxes(2, model.config.num_regions)
    swapped = boxes.clone()
    swapped[:, [0, 1]] = boxes[:, [1, 0]]
    difference = model.score(images, captions, lengths, boxes=swapped) - model.score(images, captions, lengths,
                                                                                     boxes=boxes)
    assert difference.abs().min() > 1e-5    # every pair's score moves


def test_a_model_without_positions_ignores_boxes_and_one_with_them_refuses_none():
    plain = _model("none")
    images, captions, lengths = random_batch(plain, 2, [5, 4])
    assert torch.equal(plain.score(images, captions, lengths, boxes=_boxes(2, 5)),
                       plain.score(images, captions, lengths))
    model = _model("box")
    with pytest.raises(ValueError, match=r"positions='box'\) needs each region's box"):
        model.score(images, captions, lengths)
    with pytest.raises(ValueError, match=r"positions='box'\) needs each region's box"):
        model.encode_images(images)
    with pytest.raises(ValueError, match=r"positions='box'\) needs each region's box"):
        blocks.encode_images(model, images)
    with pytest.raises(ValueError, match=r"boxes must be a float tensor of shape \(2, 5, 4\)"):
        model.score(images, captions, lengths, boxes=_boxes(2, 4))
    bad = _boxes(2, 5)
    bad[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"boxes: the box of image 1, region 3 \[nan, .*\] is not finite"):
        model.score(images, captions, lengths, boxes=bad)
    # as Matcher refuses them: pixel boxes (scores of 0, unsaid) and swapped corners
    with pytest.raises(ValueError, match=r"the box of image 0, region 0 \[.*\] lies outside \[0, 1\]; expected"):
        model.score(images, captions, lengths, boxes=_boxes(2, 5) * 192)
    swapped = _boxes(2, 5)[..., [2, 1, 0, 3]]
    with pytest.raises(ValueError, match=r"has x2 < x1 or y2 < y1"):
        model.score(images, captions, lengths, boxes=swapped)


@pytest.mark.parametrize("positions", POSITIONED)
def test_blocks_pass_boxes_batch_by_batch(positions):
    model = _model(positions)
    images, captions, lengths = random_batch(model, 5, [6, 4, 3])
    boxes = _boxes(5, model.config.num_regions)
    whole = model.encode_images(images, boxes)
    in_batches = blocks.encode_images(model, images.numpy(), batch_size=2, boxes=boxes.numpy())
    assert_close(in_batches, whole, REORDERED)


def test_training_forward_reaches_the_position_weights():
    model = random_model(0, module="sgr", positions="relation", dropout=0.0).train()
    images, captions, lengths = random_batch(model, 4, [6, 5, 4, 3])
    scores = model(images, captions, lengths, boxes=_boxes(4, 5))
    assert scores.shape == (4, 4)
    scores.diagonal().sum().backward()
    for name in ("img_enc.box_embed.mlp.0.weight", "img_enc.relation.geometry.0.weight", "img_enc.relation.qkv.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_pair_geometry_says_where_each_region_lies():
    boxes = torch.tensor([[[0.0, 0.0, 0.2, 0.2], [0.5, 0.6, 0.9, 0.8]]])
    geometry = pair_geometry(boxes)
    assert geometry.shape == (1, 2, 2, 6)
    assert_close(geometry[0, 0, 1, :2], torch.tensor([0.6, 0.6]), REORDERED)   # region 1 right of and below 0
    assert_close(geometry[0, 1, 0, :2], torch.tensor([-0.6, -0.6]), REORDERED)
    assert torch.equal(geometry[0, 0, 0], torch.zeros(6))


def test_checkpoint_records_positions(tmp_path):
    model = _model("relation")
    save_model(model, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt")
    assert loaded.config.positions == "relation" and loaded.needs_boxes
    images, captions, lengths = random_batch(model, 2, [5, 4])
    boxes = _boxes(2, 5)
    assert torch.equal(loaded.score(images, captions, lengths, boxes=boxes),
                       model.score(images, captions, lengths, boxes=boxes))


# ------------------------------------------------------------------ training, evaluate (tiny data)

@pytest.fixture(scope="module")
def toy_with_boxes(tmp_path_factory):
    """The training tests' toy data (6 regions) with each region a cell of a 2 x 3 grid."""
    from sgraf.data.boxes import grid_boxes, write_boxes
    from train_helpers import make_toy_precomp

    root = make_toy_precomp(tmp_path_factory.mktemp("toy") / "data", n_train=24, n_dev=8)
    for split, n in (("train", 24), ("dev", 8)):
        write_boxes(root, split, *grid_boxes(n, 2, 3, 60, 40))
    return root


def test_training_evaluate_and_the_refusals_of_data_without_boxes(toy_with_boxes, tmp_path, capsys):
    from sgraf.cli import main
    from sgraf.data.precomp import PrecompDataset, PrecompSplit, collate_batch
    from sgraf.data.vocab import build_vocab

    torch.set_num_threads(1)
    split = PrecompSplit(toy_with_boxes, "dev")
    dataset = PrecompDataset(split, build_vocab(split.captions, min_count=1), with_boxes=True)
    batch = collate_batch([dataset[0], dataset[7]])
    assert batch.boxes.shape == (2, 6, 4) and torch.equal(batch.boxes[1, 4], torch.tensor([1 / 3, 0.5, 2 / 3, 1]))
    assert collate_batch([PrecompDataset(split, dataset.vocab)[0]]).boxes is None

    run = tmp_path / "run"
    assert main(["train", "--data", str(toy_with_boxes), "--out", str(run), "--preset", "tiny",
                 "--set", "positions=relation", "epochs=1"]) == 0
    assert load_model(run / "best.pt").config.positions == "relation"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run / "best.pt"), "--data", str(toy_with_boxes), "--split", "dev",
                 "--json", "--quiet"]) == 0
    assert '"rsum"' in capsys.readouterr().out

    # the run's data fingerprint holds the boxes and sizes a position model reads: boxes changed in place
    # since are refused on resume (they had been taken silently), and a plain model's run does not hold them
    import shutil

    import yaml

    fingerprint = yaml.safe_load((run / "config.yaml").read_text())["data_fingerprint"]
    assert {"train_boxes.npy", "dev_boxes.npy", "train_image_sizes.npy", "dev_image_sizes.npy"} <= set(fingerprint)
    moved = tmp_path / "moved"
    shutil.copytree(toy_with_boxes, moved)
    assert main(["train", "--resume", str(run), "--data", str(moved), "--set", "epochs=2"]) == 0   # same files
    boxes = np.load(moved / "train_boxes.npy")
    np.save(moved / "train_boxes.npy", boxes[:, ::-1].copy())     # the regions' boxes in reverse order
    assert main(["train", "--resume", str(run), "--set", "epochs=3"]) == 2
    err = capsys.readouterr().err
    assert f"the files of {moved.resolve()} changed since the run recorded them (train_boxes.npy differ)" in err
    plain = tmp_path / "plain"
    assert main(["train", "--data", str(moved), "--out", str(plain), "--preset", "tiny", "--set", "epochs=1"]) == 0
    assert not any("boxes" in name for name in yaml.safe_load((plain / "config.yaml").read_text())["data_fingerprint"])

    # the same data without boxes: training and evaluation refuse it in one line
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("train_ims.npy", "train_caps.txt", "dev_ims.npy", "dev_caps.txt"):
        (bare / name).write_bytes((toy_with_boxes / name).read_bytes())
    assert main(["train", "--data", str(bare), "--out", str(tmp_path / "r2"), "--preset", "tiny",
                 "--set", "positions=box"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_boxes.npy: missing file; this model uses region positions" in err
    assert not (tmp_path / "r2" / "last.pt").exists()
    assert main(["evaluate", "--checkpoint", str(run / "best.pt"), "--data", str(bare), "--split", "dev"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(positions='relation'): " in err and "dev_boxes.npy: missing file" in err


def test_a_place_models_validation_records_its_terms_spread_and_warns_when_it_outgrows_the_heads(
        toy_with_boxes, tmp_path, caplog):
    """Each validation of a place model records the sd and largest |value| of its place term on dev
    and the sd of its heads' logits (`loop.place_term_spread`); past `PLACE_TERM_WARN_RATIO` times
    those a warning says the term outweighs the heads (a place model trained on 300 pictures had
    grown to 2.6 times while its dev rsum fell)."""
    import json
    import logging

    from sgraf.checkpoint import load_model
    from sgraf.cli import main
    from sgraf.data.precomp import PrecompSplit
    from sgraf.training import loop

    torch.set_num_threads(1)
    run = tmp_path / "run"
    assert main(["train", "--data", str(toy_with_boxes), "--out", str(run), "--preset", "tiny",
                 "--set", "positions=place", "epochs=1"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    spread = records[-1]["place_term"]
    assert set(spread) == {"sd", "largest", "logit_sd"} and 0 <= spread["sd"] <= spread["largest"] + 1e-9
    assert spread["logit_sd"] > 0
    model = load_model(run / "last.pt")
    dev = PrecompSplit(toy_with_boxes, "dev")
    assert loop.place_term_spread(model, dev, model.vocab) == pytest.approx(spread)   # as it validated
    model = load_model(run / "last.pt")
    with torch.no_grad():
        model.sim_enc.place_term.relation.weight.mul_(1e4)        # a term that has outgrown the heads
    with caplog.at_level(logging.WARNING, logger="sgraf.training.loop"):
        grown = loop.place_term_spread(model, dev, model.vocab)
        loop.place_term_spread(model, dev, model.vocab)
    assert grown["sd"] > loop.PLACE_TERM_WARN_RATIO * grown["logit_sd"]
    assert grown["logit_sd"] == pytest.approx(spread["logit_sd"])      # the heads' logits, without the term
    assert torch.equal(model.sim_enc.place_term.relation.weight, load_model(run / "last.pt").sim_enc.place_term
                       .relation.weight * 1e4)                          # the weights put back
    assert caplog.text.count(f"the place term has grown to sd {grown['sd']:.2f} on dev") == 1   # once per model
    # in training, from the second epoch on (after one the heads have barely begun: the quick demo had warned of
    # its own recipe)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgraf.training.loop"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "PLACE_TERM_WARN_RATIO", 0.0)                   # any term outgrows the heads
            for epochs in (1, 2):
                assert main(["train", "--data", str(toy_with_boxes), "--out", str(tmp_path / f"run{epochs}"),
                             "--preset", "tiny", "--set", "positions=place", f"epochs={epochs}"]) == 0
                assert caplog.text.count("the place term has grown") == epochs - 1, epochs
    plain = tmp_path / "plain"
    assert main(["train", "--data", str(toy_with_boxes), "--out", str(plain), "--preset", "tiny",
                 "--set", "epochs=1"]) == 0
    assert "place_term" not in (plain / "metrics.jsonl").read_text()


# ------------------------------------------------------------------ the place term ('place')

def _place_term() -> PlaceTerm:
    """A place term over 4-d embeddings: equal objectness, and only embedding channel 2 (the
    relation word below) carries a direction."""
    term = PlaceTerm(4)
    with torch.no_grad():
        for parameter in term.parameters():
            parameter.zero_()
        term.relation.weight[:, 2] = torch.tensor([1.0, -2.0])
    return term


def test_place_directions_pull_the_word_after_a_relation_against_the_word_before():
    term = _place_term()
    words = torch.eye(4)[[0, 2, 1]].unsqueeze(0)          # "X rel Y": only rel has a direction D
    directions = term.word_directions(words, torch.ones(1, 3, dtype=torch.bool))
    d = PLACE_GAIN * torch.tensor([1.0, -2.0])
    assert_close(directions[0], torch.stack([-d, torch.zeros(2), d]), REORDERED)
    # a padded word takes no part, and an empty side is the picture's centre: in "X rel" (as in "a
    # diamond on the top") the relation word compares X's place with the centre
    padded = torch.cat([words, torch.zeros(1, 2, 4)], dim=1)
    mask = torch.tensor([[True, True, True, False, False]])
    assert_close(term.word_directions(padded, mask)[0, :3], directions[0], REORDERED)
    assert torch.equal(term.word_directions(padded, mask)[0, 3:], torch.zeros(2, 2))
    assert_close(term.word_directions(words[:, :2], torch.ones(1, 2, dtype=torch.bool))[0],
                 torch.stack([-d, torch.zeros(2)]), REORDERED)


def test_objectness_weighs_the_places_on_each_side_of_a_relation_word():
    term = _place_term()
    with torch.no_grad():
        term.objectness.weight[0, 3] = -1.0   # channel 3 marks a word that is no object ("the")
    words = torch.eye(4)[[0, 2, 3, 1]].unsqueeze(0)        # "X rel the Y"
    directions = term.word_directions(words, torch.ones(1, 4, dtype=torch.bool))
    d = PLACE_GAIN * torch.tensor([1.0, -2.0])
    # after "rel": Y and "the", weighed 1/2 and sigmoid(-OBJECTNESS_GAIN): "the" hardly counts
    o = torch.sigmoid(torch.tensor(-OBJECTNESS_GAIN))
    share = torch.stack([0.5 / (0.5 + o), o / (0.5 + o)])
    assert_close(directions[0, 2:], share[[1, 0]].unsqueeze(1) * d, REORDERED)
    assert_close(directions[0, 0], -d, REORDERED)
    assert float(directions[0, 2].detach().abs().max()) < 1e-3 * PLACE_GAIN


def test_the_place_term_scores_the_offset_between_the_places_two_words_read():
    term = _place_term()
    regions = torch.eye(4)[[0, 1]].unsqueeze(0)           # region 0 is X, region 1 is Y
    words = torch.eye(4)[[0, 2, 1]].unsqueeze(0)           # "X rel Y"
    mask = torch.ones(1, 3, dtype=torch.bool)
    centres = torch.tensor([[[0.2, 0.5], [0.8, 0.3]]])     # X left of and below Y
    attn = region_attention(regions, words, smooth=50.0)   # each word's attention, sharp
    logit = term(attn, centres, words, mask)
    # D . (p_Y - p_X) with each word's attention on its own region
    expected = PLACE_GAIN * (1.0 * (0.8 - 0.2) - 2.0 * (0.3 - 0.5))
    assert abs(float(logit.detach()) - expected) < 1e-3 * PLACE_GAIN
    # exchange the two objects' places: the term changes sign
    assert abs(float(term(attn, centres[:, [1, 0]], words, mask).detach()) + expected) < 1e-3 * PLACE_GAIN


def test_as_a_penalty_the_term_only_lowers_a_score_and_learns_as_the_signed_term():
    term = _place_term()
    penalty = _place_term()
    penalty.penalty = True
    regions = torch.eye(4)[[0, 1]].unsqueeze(0)           # region 0 is X, region 1 is Y
    words = torch.eye(4)[[0, 2, 1]].unsqueeze(0)           # "X rel Y"
    mask = torch.ones(1, 3, dtype=torch.bool)
    centres = torch.tensor([[[0.2, 0.5], [0.8, 0.3]], [[0.8, 0.3], [0.2, 0.5]]])   # the relation holds; the twin
    attn = region_attention(regions.expand(2, 2, 4), words, smooth=50.0)
    signed, lowered = term(attn, centres, words, mask), penalty(attn, centres, words, mask)
    assert float(signed[0, 0].detach()) > 1 and float(signed[1, 0].detach()) < -1
    # where the relation holds the penalty adds nothing; where it is false, the signed term
    assert float(lowered[0, 0].detach()) == 0.0 and float(lowered[1, 0].detach()) == float(signed[1, 0].detach())
    # and its gradient is the signed term's, where it holds too: the relation word still learns there
    for value in (signed, lowered):
        value[0, 0].backward()
    assert float(term.relation.weight.grad.abs().sum()) > 0
    assert torch.equal(penalty.relation.weight.grad, term.relation.weight.grad)
    # explain's shares of the value: zero where the signed term is above 0, as they are elsewhere
    shares = PlaceTerm.word_shares(PlaceTerm.places(attn, centres), term.word_directions(words, mask)).detach()
    assert torch.equal(penalty.value_shares(shares)[0], torch.zeros(1, 3))
    assert torch.equal(penalty.value_shares(shares)[1], shares[1]) and torch.equal(term.value_shares(shares), shares)


def test_place_penalty_is_a_setting_of_the_place_model_that_every_path_applies(tmp_path):
    from sgraf.explain import place_shares
    from sgraf.training.config import TrainConfig

    assert ModelConfig(vocab_size=10).place_penalty is False          # checkpoints written before it: signed
    with pytest.raises(InputError, match=r"model config: place_penalty=true is a setting of the place term "
                                         r"\(positions='place'\), got positions='none'"):
        ModelConfig(vocab_size=10, place_penalty=True)
    with pytest.raises(InputError, match=r"model config field 'place_penalty' must be true or false, got 'yes'"):
        ModelConfig(vocab_size=10, positions="place", place_penalty="yes")
    assert TrainConfig(positions="place", place_penalty=True).model_config(5, 20, 4).place_penalty is True
    signed = _model("place", module="saf")
    penalty = _model("place", module="saf", place_penalty=True)
    penalty.load_state_dict(signed.state_dict())
    save_model(penalty, tmp_path / "penalty.pt")
    assert load_model(tmp_path / "penalty.pt").config.place_penalty is True
    images, captions, lengths = random_batch(signed, 4, [7, 5, 4, 3, 6])
    boxes = _boxes(4, signed.config.num_regions)
    img_embs, cap_embs = signed.encode_images(images, boxes), signed.encode_captions(captions, lengths)
    regions, centres = signed.split_places(img_embs)
    mask = torch.arange(cap_embs.size(1)).unsqueeze(0) < lengths.unsqueeze(1)
    with torch.no_grad():
        term = signed.sim_enc.place_offset(regions, centres, cap_embs, mask)
    assert bool((term > 0).any()) and bool((term < 0).any())
    # every scoring path adds min(term, 0): the fast path, the plain path and training
    plain_logits = torch.logit(signed.similarity(img_embs, cap_embs, lengths).detach().double()) - term.double()
    wanted = torch.sigmoid(plain_logits + term.clamp(max=0).double()).float()
    assert_close(penalty.score(images, captions, lengths, boxes=boxes), wanted, REORDERED, scale=1.0)
    with torch.enable_grad():
        assert_close(penalty.similarity(img_embs, cap_embs, lengths).detach(), wanted, REORDERED, scale=1.0)
    penalty.train(), signed.train()   # training reads the places at lambda, as place_offset here
    trained = penalty(images, captions, lengths, boxes=boxes).detach()
    trained_signed = signed(images, captions, lengths, boxes=boxes).detach()
    assert torch.equal(trained[term <= 0], trained_signed[term <= 0])
    assert bool((trained[term > 1e-3] < trained_signed[term > 1e-3]).all())
    # explain's word shares sum to the penalty's value
    read = region_attention(regions[:1], cap_embs[:1, : int(lengths[0])], penalty.sim_enc.place_smooth)[0, 0]
    shares = place_shares(penalty.sim_enc.place_term, read, centres[0], cap_embs[0, : int(lengths[0])]).detach()
    assert abs(float(shares.sum()) - min(float(term[0, 0]), 0.0)) < 1e-5
    signed_shares = place_shares(penalty.sim_enc.place_term, read, centres[0], cap_embs[0, : int(lengths[0])],
                                 signed=True).detach()
    assert abs(float(signed_shares.sum()) - float(term[0, 0])) < 1e-5        # explain shows it beside the penalty's


def test_explain_shows_a_penalty_models_signed_term_where_the_penalty_zeroed_it():
    """A penalty adds nothing where the signed term is above 0: explain says so and shows each word's
    share of the signed term beside its share of the penalty (it had printed only +0.000 there)."""
    from sgraf.cli.explain import format_explanation
    from sgraf.explain import Explanation, penalty_note

    common = dict(text="a red circle left of a square", tokens=["<start>", "a", "circle", "<end>"],
                  node_labels=["<start>", "a", "circle", "<end>"], scores={"sgr": 0.4}, attention=None,
                  attention_model=None, saf_beta=None, sgr_alignment=None, place_model="sgr")
    zeroed = Explanation(**common, place=np.zeros(4), place_signed=np.array([0.0, 0.5, 0.75, 0.0]))
    text = format_explanation(zeroed)
    assert "(place term +0.000, sgr, a penalty: the signed term +1.250 adds nothing)" in text
    assert "signed" in text.splitlines()[1] and text.splitlines()[4].endswith("+0.000  +0.750")
    lowered = Explanation(**common, place=np.array([0.0, -0.5, 0.0, 0.0]), place_signed=np.array([0.0, -0.5, 0.0, 0.0]))
    assert penalty_note(lowered) == "" and "(place term -0.500, sgr)" in format_explanation(lowered)
    signed_model = Explanation(**common, place=np.array([0.0, 0.5, 0.0, 0.0]))
    assert "signed" not in format_explanation(signed_model)


def test_explaining_an_ensemble_of_place_models_gives_each_ones_term():
    """SGR+pos with SAF+pos (the demo's SGRAF+pos) had shown the first model's place term alone."""
    from sgraf.api import Matcher
    from sgraf.cli.explain import format_explanation
    from sgraf.data.vocab import Vocabulary
    from sgraf.explain import explain_pair

    vocab = Vocabulary.from_words([f"w{i}" for i in range(26)])
    models = [_model("place", module=module, seed=seed) for seed, module in enumerate(("sgr", "saf"))]
    for model in models:
        model.vocab = vocab
    features = np.random.default_rng(0).standard_normal((1, 5, 20)).astype(np.float32)
    boxes = _boxes(1, 5)[0].numpy()
    both = explain_pair(Matcher(models), features, "w1 w2 w3 w4", boxes=boxes)
    alone = [explain_pair(Matcher([model]), features, "w1 w2 w3 w4", boxes=boxes) for model in models]
    assert list(both.place_terms) == list(both.scores)[:2] and len(set(both.place_terms)) == 2
    for label, one in zip(both.place_terms, alone):
        assert both.place_terms[label] == pytest.approx(float(one.place.sum()), abs=1e-6)
        assert one.place_terms == {next(iter(one.scores)): pytest.approx(float(one.place.sum()), abs=1e-6)}
    assert both.place_model == list(both.place_terms)[0] and np.array_equal(both.place, alone[0].place)
    second = list(both.place_terms)[1]
    assert f"; {second}'s term {both.place_terms[second] + 0.0:+.3f})" in format_explanation(both).splitlines()[0]
    assert "'s term" not in format_explanation(alone[0])
    assert all(abs(value) > 1e-4 for value in both.place_terms.values())     # the terms are not nothing


def test_a_new_place_model_scores_as_the_same_model_without_the_term():
    config = dict(vocab_size=30, img_dim=20, word_dim=8, embed_size=16, sim_dim=12, num_regions=5, module="joint")
    torch.manual_seed(0)
    place = SGRAF(ModelConfig(**config, positions="place")).eval()
    box = SGRAF(ModelConfig(**config, positions="box")).eval()
    box.load_state_dict({k: v for k, v in place.state_dict().items() if not k.startswith("sim_enc.place_term.")})
    images, captions, lengths = random_batch(place, 3, [6, 4, 3])
    boxes = _boxes(3, 5)
    assert torch.equal(place.score(images, captions, lengths, boxes=boxes),
                       box.score(images, captions, lengths, boxes=boxes))
    # its image embeddings carry each region's centre after the region embedding
    encoded = place.encode_images(images, boxes)
    assert encoded.shape == (3, 5, 16 + 2)
    # and its scoring takes them contiguous, as the box model's (a strided view took other
    # matmul kernels on an AVX-512 processor: 1 ulp off)
    assert place.split_places(encoded)[0].is_contiguous()
    assert_close(encoded[..., 16:], (boxes[..., :2] + boxes[..., 2:]) / 2, REORDERED)


@pytest.mark.parametrize("module,place_sharpness", [("sgr", 1.0), ("saf", 1.0), ("sgr", 4.0), ("saf", 2.5)])
def test_the_place_models_scoring_paths_agree(module, place_sharpness):
    model = _model("place", module=module, place_sharpness=place_sharpness)
    images, captions, lengths = random_batch(model, 4, [7, 5, 4, 3, 6])
    boxes = _boxes(4, model.config.num_regions)
    fast = model.score(images, captions, lengths, boxes=boxes)                    # eval fast path, blocks
    img_embs, cap_embs = model.encode_images(images, boxes), model.encode_captions(captions, lengths)
    with torch.enable_grad():
        plain = model.similarity(img_embs, cap_embs, lengths).detach()           # the reference path
    assert_close(fast, plain, REORDERED)
    # training: captions scored in chunks sorted by length give the place term to the right columns
    model.train()
    whole = model(images, captions, lengths, boxes=boxes).detach()
    model.train_chunk = 1
    assert_close(model(images, captions, lengths, boxes=boxes).detach(), whole, REORDERED)


def test_a_sharper_place_reads_each_word_at_its_object_when_scoring():
    sharp = _model("place", module="sgr", place_sharpness=4.0)
    soft = _model("place", module="sgr")
    soft.load_state_dict(sharp.state_dict())
    images, captions, lengths = random_batch(sharp, 3, [6, 4])
    boxes = _boxes(3, sharp.config.num_regions)
    img_embs = sharp.encode_images(images, boxes)
    cap_embs = sharp.encode_captions(captions, lengths)
    regions, centres = sharp.split_places(img_embs)
    # the places are read from the attention at lambda x 4: the same as a model of temperature
    # 4 lambda would read, and nearer the most attended region's centre than at lambda
    attn = region_attention(regions, cap_embs, sharp.sim_enc.smooth)
    read = region_attention(regions, cap_embs, 4 * sharp.sim_enc.smooth)
    assert_close(read, attn.pow(4) / attn.pow(4).sum(dim=3, keepdim=True), REORDERED)
    nearest = centres.unsqueeze(1).unsqueeze(1).expand(*attn.shape, 2).gather(
        3, attn.argmax(dim=3, keepdim=True).unsqueeze(-1).expand(*attn.shape[:3], 1, 2)).squeeze(3)
    soft_places, sharp_places = PlaceTerm.places(attn, centres), PlaceTerm.places(read, centres)
    assert bool(((sharp_places - nearest).norm(dim=3) <= (soft_places - nearest).norm(dim=3) + 1e-6).all())
    # and the model's term is the term of those places
    mask = torch.arange(cap_embs.size(1)).unsqueeze(0) < lengths.unsqueeze(1)
    with torch.enable_grad():
        term = sharp.sim_enc.place_offset(regions, centres, cap_embs, mask).detach()
        soft_term = soft.sim_enc.place_offset(regions, centres, cap_embs, mask).detach()
    expected = sharp.sim_enc.place_term(read, centres, cap_embs, mask).detach()
    assert_close(term, expected, REORDERED)
    assert not torch.allclose(term, soft_term)
    assert not torch.allclose(sharp.score(images, captions, lengths, boxes=boxes),
                              soft.score(images, captions, lengths, boxes=boxes))
    # training reads the places from the nodes' own attention, whatever the sharpness
    sharp.train(), soft.train()
    assert torch.equal(sharp(images, captions, lengths, boxes=boxes), soft(images, captions, lengths, boxes=boxes))


def test_place_sharpness_is_a_setting_of_the_place_model():
    assert ModelConfig(vocab_size=10).place_sharpness == 1.0     # checkpoints written before it: 1
    with pytest.raises(InputError, match=r"model config: place_sharpness=4.0 is a setting of the place term "
                                         r"\(positions='place'\), got positions='box'"):
        ModelConfig(vocab_size=10, positions="box", place_sharpness=4.0)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(InputError, match=r"model config field 'place_sharpness' must be a finite number >= 1, "
                                             rf"got {bad!r}"):
            ModelConfig(vocab_size=10, positions="place", place_sharpness=bad)


def test_train_refuses_a_model_setting_that_does_not_fit_before_reading_any_data(tmp_path, capsys):
    from sgraf.cli import main
    from sgraf.training.config import TrainConfig

    with pytest.raises(InputError, match=r"place_sharpness=2.0 is a setting of the place term"):
        TrainConfig(positions="box", place_sharpness=2.0)
    assert TrainConfig(positions="place", place_sharpness=2.0).model_config(5, 20, 4).place_sharpness == 2.0
    # the rule is the model's, and the command stops on it before it looks for the data
    assert main(["train", "--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "run"), "--preset", "tiny",
                 "--set", "positions=relation", "place_sharpness=2"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "place_sharpness=2.0 is a setting of the place term" in err
    assert not (tmp_path / "run").exists()


@needs_compile
def test_the_place_models_compiled_chunk_grid_pads_places_and_directions(monkeypatch):
    from sgraf.kernels import compiled

    model = _model("place", module="sgr")
    images, captions, lengths = random_batch(model, 11, [9, 5, 4, 3, 6, 2, 7])
    boxes = _boxes(11, model.config.num_regions)
    eager = model.score(images, captions, lengths, boxes=boxes)
    # the compiled path's fixed chunk grid (padded images, captions and words), without Inductor
    monkeypatch.setattr(compiled, "compiled", lambda function: function)
    with compiled.compiling("eval"):
        gridded = model.score(images, captions, lengths, boxes=boxes)
    assert_close(gridded, eager, REORDERED)


def test_a_place_model_needs_the_word_attention():
    with pytest.raises(InputError, match="positions='place' reads the place each word attends to: it needs "
                                         "alignments 'both' or 'local' and attention 't2i', got "
                                         "alignments='global', attention='t2i'"):
        ModelConfig(vocab_size=10, positions="place", alignments="global", module="ave")


def test_a_place_model_needs_a_head_that_takes_the_term():
    """module='ave' adds no term to its score: a place AVE had trained with its term's weights at 0, unsaid."""
    with pytest.raises(InputError, match="positions='place' adds the place term to the logit of an SGR or SAF head; "
                                         "module='ave' has none"):
        ModelConfig(vocab_size=10, positions="place", module="ave")
    for module in ("sgr", "saf", "joint"):
        assert ModelConfig(vocab_size=10, positions="place", module=module).positions == "place"
    assert ModelConfig(vocab_size=10, positions="box", module="ave").positions == "box"
