"""The demo's retrieval pictures: results framed by caption truth, queries picked by a stated rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from PIL import Image

from sgraf.demo_retrieval import (FALSE, OWN, TRUE, draw_image_to_text, draw_text_to_image, first_hit_rank,
                                  image_to_text_rows, pick_queries, result_kind, text_to_image_rows, truth_ranks)
from sgraf.diagnose import truth_matrix

# A hand-made split, 2 captions per picture: family 0 holds a base (picture 0) and its binding
# twin (picture 1); picture 2 is another family. Caption 0 ("the diamond is red and the square
# is orange") is true of the twin too; caption 1 is false of it; caption 2 is the twin's own
# caption, false of the base; caption 3 is true of both.
SCENES = [
    {"index": 0, "family": 0, "variant": "base", "false_for": [[], [1]]},
    {"index": 1, "family": 0, "variant": "binding", "false_for": [[0], []]},
    {"index": 2, "family": 1, "variant": "base", "false_for": [[], []]},
]
CAPTIONS = ["the diamond is red and the square is orange", "a red diamond is left of an orange square",
            "an orange diamond is left of a red square", "there are a diamond and a square",
            "a blue circle", "one blue circle"]
PER = 2


class FakeIndex:
    """Answers searches with fixed result orders (image ids per caption, caption ids per image)."""

    def __init__(self, t2i: dict[int, list[int]], i2t: dict[int, list[int]]):
        self.t2i, self.i2t = t2i, i2t

    def search_texts(self, queries, top_k, shortlist, allow_unknown):
        return [[SimpleNamespace(id=i, score=1.0 - 0.1 * r, text="") for r, i in enumerate(self.t2i[CAPTIONS.index(q)])]
                [:top_k] for q in queries]

    def search_image(self, image_id, top_k, shortlist):
        return [SimpleNamespace(id=c, score=1.0 - 0.1 * r, text=CAPTIONS[c])
                for r, c in enumerate(self.i2t[image_id])][:top_k]


def test_a_twin_the_caption_is_true_of_is_a_hit():
    truth = truth_matrix(SCENES, PER)
    assert result_kind(truth, 0, 0, PER) == OWN
    assert result_kind(truth, 1, 0, PER) == TRUE           # the twin fits "the diamond is red ..."
    assert result_kind(truth, 1, 1, PER) == FALSE          # caption 1 is false of the twin
    assert result_kind(truth, 0, 2, PER) == FALSE          # the twin's caption is false of the base
    assert result_kind(truth, 0, 3, PER) == TRUE
    assert result_kind(truth, 2, 0, PER) == FALSE          # another family: never a hit
    # the twin ranked first for caption 0 is the first hit, though the caption's own picture is second
    assert first_hit_rank([TRUE, OWN]) == 1 and first_hit_rank([FALSE, FALSE, OWN]) == 3
    assert first_hit_rank([FALSE, FALSE]) == float("inf")


def test_queries_at_evenly_spaced_quantiles_of_the_first_hit_rank():
    ranks = [1, 3, float("inf"), 1, 2, 1, float("inf"), 1]   # R@1 = 50 %
    chosen = pick_queries(ranks, 4)
    assert [ranks[q] for q in chosen] == [1, 1, 3, float("inf")]   # half the rows hit at #1, one misses
    assert chosen == [3, 7, 1, 6]                                   # ties by index
    assert pick_queries([2.0], 4) == [0]


def test_rows_frame_each_result_by_truth_and_draw(tmp_path):
    truth = truth_matrix(SCENES, PER)
    index = FakeIndex(t2i={0: [1, 0, 2], 1: [1, 0, 2], 2: [0, 2, 1], 3: [2, 1, 0], 4: [2, 0, 1], 5: [0, 1, 2]},
                      i2t={0: [2, 0, 1], 1: [0, 1, 2], 2: [4, 0, 5]})
    caption_ranks = [1, 2, 3, 2, 1, 1]
    rows = text_to_image_rows(index, CAPTIONS, truth, PER, caption_ranks, rows=6, top_k=3)
    by_query = {row.query: row for row in rows}
    twin_first = by_query[CAPTIONS[0]]
    assert [(image, kind) for image, _, kind, _ in twin_first.results] == [(1, TRUE), (0, OWN), (2, FALSE)]
    assert [kind for _, _, kind, _ in by_query[CAPTIONS[1]].results][0] == FALSE
    assert [row.query for row in rows] == [CAPTIONS[c] for c in (0, 4, 5, 1, 3, 2)]   # by rank, then index
    images = image_to_text_rows(index, truth, PER, [1, 1, 1], rows=3, top_k=3)
    first = {row.query: [kind for _, _, kind, _ in row.results] for row in images}
    assert first[1] == [TRUE, FALSE, OWN]                  # caption 0 is true of the twin
    assert first[0] == [FALSE, OWN, OWN]

    white = np.full((16, 16, 3), 255, np.uint8)
    path = draw_text_to_image(rows[:2], [white] * 6, tmp_path / "t2i.png", "t2i")
    assert Image.open(tmp_path / path).size[0] > 500
    path = draw_image_to_text(images, [white] * 3, tmp_path / "i2t.png", "i2t")
    assert Image.open(tmp_path / path).size[0] > 500


def test_truth_ranks_count_a_true_twin_as_the_first_hit():
    truth = truth_matrix(SCENES, PER)
    sims = np.zeros((3, 6), np.float32)
    sims[:, 0] = [0.5, 0.9, 0.7]     # caption 0: the twin (true) first, then picture 2 (false): rank 1
    sims[:, 1] = [0.5, 0.9, 0.7]     # caption 1 is false of the twin: its own picture is third
    sims[:, 4] = [0.1, 0.2, 0.3]
    caption_ranks, image_ranks = truth_ranks(sims, truth)
    assert caption_ranks[0] == 1 and caption_ranks[1] == 3 and caption_ranks[4] == 1
    sims[1] = [0.9, 0.95, 0.1, 0.2, 0.99, 0.3]   # picture 1: caption 4 (another family) first, then caption 1 (false)
    _, image_ranks = truth_ranks(sims, truth)
    assert image_ranks[1] == 3                   # caption 0, true of the twin, comes third
