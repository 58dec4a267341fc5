"""The hinge ranking loss against a direct loop over the definition."""

from __future__ import annotations

import pytest
import torch

from numerics import REORDERED, approx
from sgraf.model.loss import ranking_loss

pytestmark = pytest.mark.numeric


def _loop_loss(scores, margin, max_violation, positives):
    n = scores.size(0)
    total = 0.0
    for i in range(n):           # image i: its caption i against negative captions j
        costs = [max(0.0, margin + scores[i, j].item() - scores[i, i].item()) for j in range(n) if not positives[i, j]]
        total += (max(costs, default=0.0) if max_violation else sum(costs))
    for j in range(n):           # caption j: its image j against negative images i
        costs = [max(0.0, margin + scores[i, j].item() - scores[j, j].item()) for i in range(n) if not positives[i, j]]
        total += (max(costs, default=0.0) if max_violation else sum(costs))
    return total


@pytest.mark.parametrize("max_violation", [True, False])
@pytest.mark.parametrize("margin", [0.2, 0.5])
def test_matches_definition(max_violation, margin):
    scores = torch.rand(6, 6, generator=torch.Generator().manual_seed(0))
    eye = torch.eye(6, dtype=torch.bool)
    expected = _loop_loss(scores, margin, max_violation, eye)
    assert ranking_loss(scores, margin, max_violation).item() == approx(expected, REORDERED)


def test_positives_mask_excludes_other_captions_of_the_same_image():
    scores = torch.tensor([[0.5, 0.9, 0.1, 0.2], [0.8, 0.6, 0.3, 0.1], [0.2, 0.1, 0.7, 0.4], [0.3, 0.2, 0.5, 0.9]])
    positives = torch.eye(4, dtype=torch.bool)
    positives[0, 1] = positives[1, 0] = True     # images 0 and 1 are duplicates
    expected = _loop_loss(scores, 0.2, True, positives)
    # scale 1: the hinge terms (margin + scores) are of order 1 even where they cancel to ~0
    assert ranking_loss(scores, positives=positives).item() == approx(expected, REORDERED, scale=1.0)
    assert ranking_loss(scores, positives=positives).item() != pytest.approx(ranking_loss(scores).item())


def test_gradient_flows_only_through_the_hardest_negatives():
    scores = torch.tensor([[0.5, 0.1, 0.6], [0.2, 0.8, 0.3], [0.4, 0.55, 0.7]], requires_grad=True)
    ranking_loss(scores).backward()
    # violating hardest negatives: image 0 -> caption 2, image 2 -> caption 1, caption 0 -> image 2,
    # caption 2 -> image 0; image 1 and caption 1 have none (each hinge adds +1 there, -1 on the diagonal)
    expected = torch.tensor([[-2.0, 0.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, -2.0]])
    assert torch.equal(scores.grad, expected)          # sums of +-1: exact


def test_rejects_non_square_scores():
    with pytest.raises(ValueError, match=r"square \(n, n\) score matrix, got shape \(2, 3\)"):
        ranking_loss(torch.zeros(2, 3))
