"""Family batches (`batches=families`): whole families of hard negatives per batch, and a truth mask
so that a caption is no negative of a family picture it is true of (issue 21)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from sgraf.data.benchmark import FAMILY_SIZE, generate_benchmark, load_scenes
from sgraf.data.families import read_families
from sgraf.errors import InputError
from sgraf.model.loss import ranking_loss
from sgraf.training.config import TrainConfig
from sgraf.training.families import FamilyBatchSampler, TruthCollate, truth_mask
from sgraf.training.loop import fit

CAPS = 5


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("families") / "data"
    # 30 training pictures: 7 whole families and one cut to 2 pictures by the split's end
    generate_benchmark(out, seed=3, features="synthetic", n_train=30, n_dev=8, n_test=8, save_images=False,
                       synthetic_dim=16, min_count=1)
    return out


def test_families_and_truth_follow_the_scenes(bench):
    families = read_families(bench, "train", 30, CAPS)
    scenes = load_scenes(bench, "train")
    assert [len(g) for g in families.groups] == [FAMILY_SIZE] * 7 + [2]
    assert np.concatenate(families.groups).tolist() == list(range(30))
    assert families.true_of.shape == (150, FAMILY_SIZE)
    true_of_twin = 0
    for group in families.groups:
        for image in group:
            for j, wrong in enumerate(scenes[image]["false_for"]):
                row = families.true_of[image * CAPS + j]
                truth = set(row[row >= 0].tolist())
                assert row[0] == image                                    # its own picture first
                assert truth | set(wrong) == set(group.tolist()) and not truth & set(wrong)
                true_of_twin += len(truth) > 1
    assert 0 < true_of_twin < 150   # some captions (lists, counts) are true of a twin, others not


def test_the_sampler_takes_every_caption_once_in_whole_families(bench):
    families = read_families(bench, "train", 30, CAPS)
    family_of = {int(i): f for f, g in enumerate(families.groups) for i in g}
    sampler = FamilyBatchSampler(families.groups, CAPS, batch_size=10, seed=1, epoch=0)
    batches = list(sampler)
    taken = [k for batch in batches for k in batch]
    assert sorted(taken) == list(range(150))                              # each caption once an epoch
    for batch in batches:
        assert len(batch) <= 10
        pictures = [k // CAPS for k in batch]
        for f in {family_of[p] for p in pictures}:                        # whole units: each picture of a family
            members = [p for p in pictures if family_of[p] == f]
            assert sorted(set(members)) == sorted(families.groups[f].tolist())
            assert len(members) % len(families.groups[f]) == 0
    again = FamilyBatchSampler(families.groups, CAPS, batch_size=10, seed=1, epoch=0)
    assert [list(b) for b in again] == batches                            # (seed, epoch) decide the order
    assert [list(b) for b in FamilyBatchSampler(families.groups, CAPS, 10, seed=1, epoch=1)] != batches
    resumed = FamilyBatchSampler(families.groups, CAPS, batch_size=10, seed=1, epoch=0, start_batch=3)
    assert list(resumed) == batches[3:] and len(resumed) == len(batches) - 3
    shares = [list(FamilyBatchSampler(families.groups, CAPS, 10, 1, 0, rank=r, world_size=2)) for r in (0, 1)]
    assert [a + b for a, b in zip(*shares)] == batches                    # rank shares make the global batch
    with pytest.raises(InputError, match="batch_size=3 is smaller than a family .4 pictures.; "
                                         "batches=families needs batch_size >= 4"):
        FamilyBatchSampler(families.groups, CAPS, batch_size=3, seed=0, epoch=0)


def test_a_family_share_mixes_whole_families_with_single_captions(bench):
    families = read_families(bench, "train", 30, CAPS)
    family_of = {int(i): f for f, g in enumerate(families.groups) for i in g}
    whole_share = []
    for epoch in range(4):
        batches = list(FamilyBatchSampler(families.groups, CAPS, 10, seed=1, epoch=epoch, family_share=0.5))
        assert sorted(k for batch in batches for k in batch) == list(range(150))   # each caption once
        assert [list(b) for b in FamilyBatchSampler(families.groups, CAPS, 10, seed=1, epoch=epoch,
                                                    family_share=0.5)] == batches
        # a family is drawn whole (every batch holding one of its captions holds all its pictures) or not
        whole = set()
        for f, group in enumerate(families.groups):
            holding = [b for b in batches if any(family_of[k // CAPS] == f for k in b)]
            if all(sorted({k // CAPS for k in b if family_of[k // CAPS] == f}) == sorted(group.tolist())
                   for b in holding):
                whole.add(f)
        whole_share.append(len(whole) / len(families.groups))
    assert 0 < min(whole_share) and max(whole_share) < 1          # some families whole, others scattered
    with pytest.raises(InputError, match="'family_share' must be in \\(0, 1\\], got 0.0"):
        TrainConfig(batches="families", family_share=0.0)
    with pytest.raises(InputError, match="'family_share' .0.5. is the share of families drawn whole: it needs "
                                         "batches=families, got batches='random'"):
        TrainConfig(family_share=0.5)


def test_the_truth_mask_spares_pairs_whose_caption_is_true_of_the_picture():
    image_ids = torch.tensor([0, 1, 2, 0])
    true_of = torch.tensor([[0, 1, -1], [1, -1, -1], [2, 0, 1], [0, -1, -1]])
    mask = truth_mask(image_ids, true_of)
    # rows: each caption's picture; columns: captions. Caption 0 is true of pictures 0 and 1.
    expected = torch.tensor([[1, 0, 1, 1],
                             [1, 1, 1, 0],
                             [0, 0, 1, 0],
                             [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    scores = torch.tensor([[0.9, 0.1, 0.95, 0.2],
                           [0.8, 0.7, 0.6, 0.6],
                           [0.1, 0.2, 0.4, 0.3],
                           [0.85, 0.1, 0.9, 0.9]])
    # the hinge only over the pairs the mask leaves, by hand
    diagonal = scores.diag()
    by_hand = 0.0
    for i in range(4):
        by_hand += max([max(0.0, 0.2 + float(scores[i, j] - diagonal[i])) for j in range(4) if not expected[i, j]],
                       default=0.0)
    for j in range(4):
        by_hand += max([max(0.0, 0.2 + float(scores[i, j] - diagonal[j])) for i in range(4) if not expected[i, j]],
                       default=0.0)
    assert by_hand > 0.15
    assert math.isclose(float(ranking_loss(scores, 0.2, True, mask)), by_hand, rel_tol=1e-5)
    assert float(ranking_loss(scores, 0.2, True)) > by_hand   # unmasked, a true caption counts as a violation


def test_truth_collate_carries_each_captions_row(bench):
    from sgraf.data.precomp import PrecompDataset, PrecompSplit
    from sgraf.data.vocab import load_vocab

    families = read_families(bench, "train", 30, CAPS)
    dataset = PrecompDataset(PrecompSplit(bench, "train"), load_vocab(bench / "vocab.json"))
    batch = TruthCollate(families.true_of)([dataset[k] for k in (7, 0, 149)])
    assert batch.true_of.tolist() == families.true_of[[7, 0, 149]].tolist()
    assert batch.to("cpu").true_of is not None


def test_training_with_family_batches(bench, tmp_path):
    config = TrainConfig(module="sgr", word_dim=8, embed_size=16, sim_dim=8, sgr_step=1, epochs=1, batch_size=8,
                         lr=1e-3, batches="families", checkpoint_every=0, progress=False, val_max_captions=None,
                         img_dim=None, num_regions=None)
    summary = fit(config, bench, tmp_path / "run")
    assert summary["status"] == "finished"
    families = read_families(bench, "train", 30, CAPS)
    assert summary["global_step"] == len(FamilyBatchSampler(families.groups, CAPS, 8, seed=0, epoch=0)) >= 150 // 8
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["batches"] == "families"
    assert math.isfinite(summary["last_loss"])


def test_family_batches_refuse_data_without_scenes(bench, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(bench, plain)
    (plain / "train_scenes.jsonl").unlink()
    config = TrainConfig(module="sgr", word_dim=8, embed_size=16, sim_dim=8, sgr_step=1, epochs=1, batch_size=8,
                         batches="families", progress=False, img_dim=None, num_regions=None)
    with pytest.raises(InputError, match=r"train_scenes.jsonl: missing file; batches=families draws whole "
                                         r"families of hard negatives"):
        fit(config, plain, tmp_path / "run")
    with pytest.raises(InputError, match="'batches' must be one of random, families, got 'twins'"):
        TrainConfig(batches="twins")


def test_each_epoch_of_family_batches_validates_at_its_own_steps(bench, tmp_path):
    """Family batches pack each epoch anew (20, then 22 steps here): the first epoch's count had
    served every epoch, so a validation due at step 20 of the second epoch was skipped (and one due
    at the last step of a shorter epoch made twice)."""
    config = TrainConfig(module="sgr", word_dim=8, embed_size=16, sim_dim=8, sgr_step=1, epochs=2, batch_size=8,
                         lr=1e-3, batches="families", family_share=0.5, checkpoint_every=0, progress=False,
                         val_every=2, val_max_captions=None, img_dim=None, num_regions=None)
    families = read_families(bench, "train", 30, CAPS)
    lengths = [len(FamilyBatchSampler(families.groups, CAPS, 8, seed=0, epoch=e, family_share=0.5)) for e in (0, 1)]
    assert lengths == [20, 22]
    fit(config, bench, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
    assert steps == list(range(2, 43, 2)), steps
    assert [r["step"] for r in records if r["end_of_epoch"]] == [20, 42]
