"""`sgraf.diagnose` (Winoground scores, truth-aware recall) and the `sgraf diagnose` command."""

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from sgraf import diagnose
from sgraf.cli import main
from sgraf.data.benchmark import VARIANTS, generate_benchmark, load_scenes

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import random_model  # noqa: E402

# two families, two captions per picture: 0 base + 1 binding, 2 base + 3 relation
SCENES = [
    {"index": 0, "family": 0, "variant": "base", "false_for": [[1], []]},
    {"index": 1, "family": 0, "variant": "binding", "false_for": [[0], [0]]},
    {"index": 2, "family": 1, "variant": "base", "false_for": [[3], [3]]},
    {"index": 3, "family": 1, "variant": "relation", "false_for": [[2], []]},
]


def hand_matrix():
    sims = np.zeros((4, 8), dtype=np.float32)
    # family 0: C_b = {0}, C_n = {2, 3}
    sims[0, [0, 2, 3]] = 5, 1, 3
    sims[1, [0, 2, 3]] = 2, 4, 2.5   # (0, 2): text and image; (0, 3): text only (s(1,3) < s(0,3))
    # family 1: C_b = {4, 5}, C_n = {6}
    sims[2, [4, 5, 6]] = 0, 0, 1
    sims[3, [4, 5, 6]] = -1, 1, 2    # (4, 6): image only; (5, 6): neither
    return sims


def test_winoground_on_a_hand_made_matrix():
    result = diagnose.winoground(hand_matrix(), SCENES)
    assert result["binding"] == {"text": 1.0, "image": 0.5, "group": 0.5, "pairs": 2}
    assert result["relation"] == {"text": 0.0, "image": 0.5, "group": 0.0, "pairs": 2}
    assert result["attribute"] == result["count"] == {"text": None, "image": None, "group": None, "pairs": 0}
    assert result["all"] == {"text": 0.5, "image": 0.5, "group": 0.25, "pairs": 4}
    # ties are wrong: a constant matrix scores nothing
    flat = diagnose.winoground(np.ones((4, 8)), SCENES)["all"]
    assert (flat["text"], flat["image"], flat["group"]) == (0.0, 0.0, 0.0)


def test_truth_aware_recall_counts_a_true_twin():
    sims = np.zeros((4, 8), dtype=np.float32)
    sims[0, 3] = 1.0  # picture 0's best caption: picture 1's second, false for picture 0: wrong
    sims[1, 2] = 1.0  # picture 1's best caption is its own
    sims[2, 7] = 1.0  # picture 2's best caption: picture 3's second, true of it
    sims[3, 0] = 1.0  # picture 3's best caption belongs to another family: wrong
    recall = diagnose.truth_recall(sims, SCENES, ks=(1,))
    assert recall["i2t"] == {"r1": 50.0, "ties": 50.0}   # pictures 0 and 3: a wrong caption also scores 0
    standard = diagnose.diagnose_sims(sims, SCENES)["recall"]["standard"]
    assert standard["i2t"]["r1"] == 25.0


def _oracle(sims, scenes, per):
    """The definitions, one pair and one query at a time."""
    by_index = {r["index"]: r for r in scenes}
    base = {r["family"]: r["index"] for r in scenes if r["variant"] == "base"}
    tally = {k: [0, 0, 0, 0] for k in (*VARIANTS, "all")}
    for r in scenes:
        if r["variant"] == "base":
            continue
        n, b = r["index"], base[r["family"]]
        c_bs = [b * per + j for j, w in enumerate(by_index[b]["false_for"]) if n in w]
        c_ns = [n * per + j for j, w in enumerate(r["false_for"]) if b in w]
        for c_b, c_n in itertools.product(c_bs, c_ns):
            text = sims[b, c_b] > sims[b, c_n] and sims[n, c_n] > sims[n, c_b]
            image = sims[b, c_b] > sims[n, c_b] and sims[n, c_n] > sims[b, c_n]
            for key in (r["variant"], "all"):
                tally[key] = [tally[key][0] + text, tally[key][1] + image, tally[key][2] + (text and image),
                              tally[key][3] + 1]

    def true_of(c, i):
        owner = by_index[c // per]
        return i == owner["index"] or (by_index[i]["family"] == owner["family"]
                                       and i not in owner["false_for"][c % per])

    n_img, n_cap = sims.shape
    i2t = [sum(sims[i, c] > max(sims[i, d] for d in range(n_cap) if true_of(d, i)) for c in range(n_cap))
           for i in range(n_img)]
    t2i = [sum(sims[i, c] > max(sims[m, c] for m in range(n_img) if true_of(c, m)) for i in range(n_img))
           for c in range(n_cap)]
    return tally, i2t, t2i


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnose")
    generate_benchmark(out, n_train=12, n_dev=4, n_test=16, save_images=False)
    return out


def test_vectorised_scores_match_the_plain_loops(data):
    scenes = load_scenes(data, "test")
    sims = np.random.default_rng(0).standard_normal((16, 80)).astype(np.float32)
    result = diagnose.winoground(sims, scenes)
    tally, i2t, t2i = _oracle(sims, scenes, 5)
    assert result["all"]["pairs"] > 0
    for key, (text, image, group, pairs) in tally.items():
        assert result[key]["pairs"] == pairs
        if pairs:
            assert (result[key]["text"], result[key]["image"], result[key]["group"]) == pytest.approx(
                (text / pairs, image / pairs, group / pairs))
    recall = diagnose.truth_recall(sims, scenes)
    for direction, ranks in (("i2t", i2t), ("t2i", t2i)):
        for k in (1, 5, 10):
            assert recall[direction][f"r{k}"] == pytest.approx(100 * np.mean(np.array(ranks) < k))


@pytest.fixture(scope="module")
def checkpoint(data):
    from sgraf.checkpoint import save_model
    from sgraf.data.vocab import load_vocab

    vocab = load_vocab(data / "vocab.json")
    path = data / "model.pt"
    save_model(random_model(vocab_size=len(vocab), img_dim=128, num_regions=36), path, vocab=vocab)
    return path


def test_command_json_matches_evaluate_and_saved_matrices(data, checkpoint, tmp_path, capsys):
    sims_path = tmp_path / "sims.npy"
    assert main(["diagnose", "--checkpoint", str(checkpoint), "--data", str(data), "--split", "test", "--json",
                 "--quiet", "--device", "cpu", "--save-sims", str(sims_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {*VARIANTS, "all", "recall"}
    for key in (*VARIANTS, "all"):
        assert set(result[key]) == {"text", "image", "group", "pairs"}
        assert all(result[key][s] is None or 0 <= result[key][s] <= 1 for s in ("text", "image", "group"))
    assert result["all"]["pairs"] == sum(result[k]["pairs"] for k in VARIANTS) > 0
    assert result == diagnose.diagnose_sims(np.load(sims_path), load_scenes(data, "test"))
    assert main(["evaluate", "--sims", str(sims_path), "--data", str(data), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert result["recall"]["standard"]["t2i"]["r5"] == evaluated["t2i"]["r5"]
    assert main(["diagnose", "--sims", str(sims_path), "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == result
    assert main(["diagnose", "--sims", str(sims_path), "--data", str(data)]) == 0
    assert "binding" in capsys.readouterr().out


def _refused(capsys, argv, pattern):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and pattern in err, err


def test_bad_input_is_one_line_and_exit_2(data, tmp_path, capsys):
    import shutil

    sims = np.zeros((16, 80), dtype=np.float32)
    np.save(tmp_path / "sims.npy", sims)
    np.save(tmp_path / "wrong.npy", sims[:, :75])
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    _refused(capsys, ["diagnose", "--sims", str(tmp_path / "wrong.npy"), "--data", str(copy)], "score matrix of shape")
    scenes = (copy / "test_scenes.jsonl").read_text().splitlines()
    (copy / "test_scenes.jsonl").write_text("\n".join(scenes[:12]) + "\n")   # scenes that do not fit the split
    _refused(capsys, ["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(copy)],
             "the scenes hold 60 captions, the caption file 80 lines")   # compared before scoring
    old = [{k: v for k, v in json.loads(line).items() if k != "false_for"} for line in scenes]
    (copy / "test_scenes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    _refused(capsys, ["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(copy)],
             "sgraf generate --overwrite")
    (copy / "test_scenes.jsonl").unlink()
    _refused(capsys, ["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(copy)],
             "no test_scenes.jsonl; diagnose needs a data set written by sgraf generate (splits with scenes there: ")
