"""`sgraf.significance`: bootstrap intervals of the recalls and the paired comparison of two models
(`sgraf evaluate --bootstrap`, `sgraf compare`), held to the recalls `sgraf evaluate` counts, to
the binomial spread of a recall, and to an exact randomization test enumerated by hand."""

import itertools
import json
import pathlib
import shutil

import numpy as np
import pytest

from sgraf import metrics, significance
from sgraf.cli import main
from sgraf.errors import InputError

E2E = pathlib.Path(__file__).parent / "data" / "e2e"
DATA = E2E / "data" / "toy_precomp"
VOCAB = E2E / "data" / "toy_vocab.json"
CKPT = {"sgr": E2E / "sgr.pth.tar", "saf": E2E / "saf.pth.tar"}


def matrix(n_img: int, seed: int, signal: float = 1.0, cpi: int = 5, base: np.ndarray | None = None,
           noise: float = 1.0) -> np.ndarray:
    """Scores of `n_img` images x `cpi` captions each: noise, the true pairs raised by `signal`;
    with `base`, that matrix plus `noise` times fresh noise (a model like another)."""
    rng = np.random.default_rng(seed)
    sims = rng.standard_normal((n_img, n_img * cpi)) * noise
    if base is not None:
        return (base + sims).astype(np.float32)
    sims[np.repeat(np.arange(n_img), cpi), np.arange(n_img * cpi)] += signal
    return sims.astype(np.float32)


@pytest.mark.parametrize("folds", [1, 5])
def test_the_per_image_table_gives_evaluates_recalls(folds):
    sims = matrix(100, 0, signal=2.0)
    table = significance.query_hits(sims, folds=folds)
    result = metrics.evaluate_sims(sims, folds=folds)
    means = 100 * table.mean(axis=0)
    expected = [result[d][k] for d in ("i2t", "t2i") for k in ("r1", "r5", "r10")]
    np.testing.assert_allclose(means, expected, atol=1e-9)
    assert table.shape == (100, 6) and set(np.unique(table[:, :3])) <= {0.0, 1.0}


@pytest.mark.parametrize("folds", [1, 5])
def test_compare_reports_evaluates_figures_to_the_bit(folds):
    a, b = matrix(100, 9, signal=2.0), matrix(100, 10, signal=1.5)
    result = significance.compare(a, b, folds=folds, resamples=40)
    for name, sims in (("a", a), ("b", b)):
        figures = metrics.evaluate_sims(sims, folds=folds)
        assert result[name] == {"i2t": {k: figures["i2t"][k] for k in ("r1", "r5", "r10")},
                                "t2i": {k: figures["t2i"][k] for k in ("r1", "r5", "r10")},
                                "rsum": figures["rsum"]}


def test_an_interval_has_the_binomial_spread_of_a_recall_and_holds_the_figure():
    """i2t R@1 is a mean of one hit per image: its bootstrap interval is about 2 x 1.96 binomial
    standard deviations wide (an interval from captions drawn apart from their images, or
    weights that do not sum to the images, would not be)."""
    n = 2000
    sims = matrix(n, 1, signal=3.0)
    intervals = significance.recall_intervals(sims, resamples=4000, seed=3)
    figures = metrics.evaluate_sims(sims)
    p = figures["i2t"]["r1"] / 100
    low, high = intervals["i2t"]["r1"]
    assert low < figures["i2t"]["r1"] < high
    assert (high - low) == pytest.approx(2 * 1.96 * 100 * np.sqrt(p * (1 - p) / n), rel=0.12)
    assert intervals["rsum"][0] < figures["rsum"] < intervals["rsum"][1]
    assert intervals == significance.recall_intervals(sims, resamples=4000, seed=3)          # same seed
    quarter = significance.recall_intervals(matrix(n // 4, 1, signal=3.0), resamples=4000, seed=3)
    assert np.diff(quarter["i2t"]["r1"])[0] == pytest.approx(2 * (high - low), rel=0.3)     # 1 / sqrt(n)


def test_a_model_against_itself_and_against_a_clearly_worse_one():
    a = matrix(300, 2, signal=2.5)
    same = significance.compare(a, a.copy(), resamples=500)
    assert same["difference"]["rsum"] == 0 and same["p"]["rsum"] == 1.0 and same["interval"]["rsum"] == [0, 0]
    worse = matrix(300, 4, base=a, noise=2.0)
    result = significance.compare(a, worse, resamples=999)
    assert result["a"] == {"i2t": {k: metrics.evaluate_sims(a)["i2t"][k] for k in ("r1", "r5", "r10")},
                           "t2i": {k: metrics.evaluate_sims(a)["t2i"][k] for k in ("r1", "r5", "r10")},
                           "rsum": metrics.evaluate_sims(a)["rsum"]}
    assert result["difference"]["rsum"] > 50 and result["interval"]["rsum"][0] > 0
    assert result["p"]["rsum"] == pytest.approx(1 / 1000)        # no flip reaches it: the smallest p
    text = significance.format_comparison(result, ("a.npy", "worse.npy"))
    assert "A: a.npy" in text and "<=0.001" in text


def test_pairing_narrows_the_interval_of_a_difference():
    """Two models that share most of their errors: the difference's interval is far narrower than
    either model's own (an unpaired resampling would add their spreads)."""
    a = matrix(500, 5, signal=2.0)
    b = matrix(500, 6, base=a, noise=0.3)
    own = significance.recall_intervals(a, resamples=2000)["rsum"]
    paired = significance.compare(a, b, resamples=2000)["interval"]["rsum"]
    assert (paired[1] - paired[0]) < 0.5 * (own[1] - own[0])


def test_the_randomization_p_value_matches_the_exact_test():
    """Six images: every one of the 2^6 sign patterns enumerated gives the exact p-value, which the
    sampled flips must approach."""
    a = matrix(6, 7, signal=1.5, cpi=2)
    b = matrix(6, 8, signal=0.5, cpi=2)
    difference = significance.query_hits(a) - significance.query_hits(b)
    per_image = 100 * difference.sum(axis=1) / 6
    observed = abs(per_image.sum())
    patterns = [abs(np.dot(signs, per_image)) for signs in itertools.product((-1, 1), repeat=6)]
    exact = np.mean([value >= observed - 1e-9 for value in patterns])
    p = significance.compare(a, b, resamples=40000, seed=1)["p"]["rsum"]
    assert 0 < exact < 1 and p == pytest.approx(exact, abs=0.01)


def test_p_values_of_exchangeable_models_are_not_small():
    """Null calibration: A and B drawn alike, 40 times: p < 0.05 about 5 % of the time."""
    ps = []
    for seed in range(40):
        base = matrix(60, 100 + seed, signal=1.5)
        ps.append(significance.compare(matrix(60, 200 + seed, base=base, noise=0.7),
                                       matrix(60, 300 + seed, base=base, noise=0.7),
                                       resamples=400, seed=seed)["p"]["rsum"])
    assert np.mean(np.array(ps) < 0.05) <= 0.15 and 0.35 < np.mean(ps) < 0.65


def test_bad_arguments_are_one_line_errors():
    a = matrix(10, 0)
    with pytest.raises(InputError, match=r"shapes \(10, 50\) and \(5, 25\)"):
        significance.compare(a, matrix(5, 0))
    with pytest.raises(InputError, match="level must be a number between 0 and 1"):
        significance.recall_intervals(a, level=95)
    with pytest.raises(InputError, match="resamples must be a positive integer"):
        significance.compare(a, a, resamples=0)
    with pytest.raises(InputError, match="10 images do not split into 3 equal folds"):
        significance.recall_intervals(a, folds=3)


# ----------------------------------------------------------------------------------------- CLI
def evaluate_json(capsys, *args):
    assert main(["evaluate", *map(str, args), "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The toy split scored by SGR and SAF (with their records), and SGR on a twin split of the
    same shape whose captions come in another order."""
    out = tmp_path_factory.mktemp("sims")
    twin = out / "twin"
    shutil.copytree(DATA, twin)
    captions = (DATA / "test_caps.txt").read_text().splitlines()
    (twin / "test_caps.txt").write_text("\n".join(captions[5:] + captions[:5]) + "\n")
    for name, data in (("sgr", DATA), ("saf", DATA), ("twin", twin)):
        model = "sgr" if name == "twin" else name
        assert main(["evaluate", "--checkpoint", str(CKPT[model]), "--data", str(data), "--vocab", str(VOCAB),
                     "--save-sims", str(out / f"{name}.npy"), "--quiet"]) == 0
    return out


def test_evaluate_bootstrap_adds_intervals(saved, capsys):
    result = evaluate_json(capsys, "--sims", saved / "sgr.npy", "--bootstrap", 200)
    plain = evaluate_json(capsys, "--sims", saved / "sgr.npy")
    assert {k: v for k, v in result.items() if k != "intervals"} == plain
    assert result["intervals"] == significance.recall_intervals(np.load(saved / "sgr.npy"), resamples=200)
    assert main(["evaluate", "--checkpoint", str(CKPT["saf"]), "--data", str(DATA), "--vocab", str(VOCAB),
                 "--bootstrap", "100", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "95 % bootstrap intervals (100 resamples of the images, seed 0):" in out and "rsum    [" in out


def test_compare_prints_the_paired_table_and_refuses_another_split(saved, capsys):
    sgr, saf, twin = (str(saved / f"{name}.npy") for name in ("sgr", "saf", "twin"))
    assert main(["compare", "--sims", sgr, saf, "--against", saf, "--data", str(DATA), "--resamples", "300"]) == 0
    out = capsys.readouterr().out
    assert f"A: {sgr} + {saf}" in out and "rsum" in out and "randomization-test p over 300 resamples" in out
    assert main(["compare", "--sims", sgr, "--against", saf, "--json", "--resamples", "300"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["a"]["rsum"] == evaluate_json(capsys, "--sims", sgr)["rsum"] and result["against"] == [saf]
    for argv, message in (
            (["--sims", sgr, "--against", twin], "twin.npy scored the captions of"),
            (["--sims", sgr, "--against", sgr.replace("/sgr.npy", "/./sgr.npy")],
             "--sims and --against name the same matrix"),
            (["--sims", sgr, "--against", saf, "--level", "95"], "argument --level: expected a number between"),
            (["--sims", sgr, "--against", saf, "--split", "dev"], "--split applies with --data")):
        assert main(["compare", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err



def test_compare_scores_checkpoints_as_evaluate_saves_them(saved, capsys, caplog):
    sgr, saf = (str(saved / f"{name}.npy") for name in ("sgr", "saf"))
    common = ["--data", str(DATA), "--resamples", "300", "--json"]
    from_matrices = compare_json(capsys, "--sims", sgr, saf, "--against", saf, *common)
    scored = ["--vocab", str(VOCAB), "--quiet"]
    from_checkpoints = compare_json(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", CKPT["saf"],
                                    "--against", CKPT["saf"], *common, *scored)
    mixed = compare_json(capsys, "--sims", sgr, saf, "--against", CKPT["saf"], *common, *scored)
    for result in (from_checkpoints, mixed):
        assert {k: result[k] for k in ("a", "b", "difference", "p")} == \
            {k: from_matrices[k] for k in ("a", "b", "difference", "p")}
    assert from_checkpoints["checkpoint"] == [str(CKPT["sgr"]), str(CKPT["saf"])] and "sims" not in from_checkpoints
    for argv, message in (
            (["--checkpoint", CKPT["sgr"], "--against", CKPT["saf"]], "--checkpoint names checkpoints: --data DIR"),
            (["--sims", sgr, "--against", saf, CKPT["sgr"], "--data", DATA],
             f"--against: {saf} is a score matrix (.npy) and {CKPT['sgr']} is not"),
            (["--sims", sgr, "--against", saf, "--vocab", VOCAB], "--vocab applies to checkpoints"),
            (["--checkpoint", CKPT["sgr"], "--against", CKPT["sgr"], "--data", DATA],
             "--checkpoint and --against name the same model"),

            (["--sims", sgr, "--against", CKPT["saf"], CKPT["saf"], "--data", DATA],
             "saf.pth.tar is given twice"),
            (["--checkpoint", CKPT["sgr"], "--against", saved / "absent.npy", "--data", DATA, "--vocab", VOCAB],
             "absent.npy"),
            (["--checkpoint", CKPT["sgr"], "--against", saved / "absent.pt", "--data", DATA, "--vocab", VOCAB],
             "absent.pt: no such checkpoint file")):
        caplog.clear()
        caplog.set_level("INFO", logger="sgraf.evaluate")
        assert main(["compare", *map(str, argv)]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert "evaluating" not in caplog.text          # refused before side A was scored
    # a matrix against a copy of itself (a p of 1.000 over a table of zeros had been printed); a checkpoint
    # against its own saved matrix is refused alike where it scores to the same bits (the CPU's measured matmul
    # route may differ between the two scorings, so that case is not held here)
    copy = saved / "sgr-copy.npy"
    shutil.copyfile(sgr, copy)
    shutil.copyfile(sgr + ".json", str(copy) + ".json")
    assert main(["compare", "--sims", sgr, "--against", str(copy), "--data", str(DATA), "--quiet"]) == 2
    assert "A and B score every pair alike, to the bit" in capsys.readouterr().err


def test_compare_takes_ours_with_its_own_vocabulary_against_the_authors_with_theirs(tmp_path, capsys):
    """A run of ours builds its vocabulary from the data: against the authors' .pth.tar and their
    vocabulary file, --vocab had been refused for ours and left out for theirs."""
    from sgraf.checkpoint import load_model, save_model
    from sgraf.data.vocab import Vocabulary, load_vocab

    theirs = load_vocab(VOCAB)
    words = [theirs.idx2word[i] for i in range(len(theirs))]
    ours_vocab = Vocabulary.from_dict({"word2idx": {w: i for i, w in enumerate(words[:4] + words[4:][::-1])},
                                       "idx2word": {str(i): w for i, w in enumerate(words[:4] + words[4:][::-1])},
                                       "idx": len(words)})
    model = load_model(CKPT["saf"], vocab=VOCAB)
    model.vocab = ours_vocab
    save_model(model, tmp_path / "ours.pt")
    result = compare_json(capsys, "--checkpoint", tmp_path / "ours.pt", "--against", CKPT["sgr"], "--vocab", VOCAB,
                          "--data", DATA, "--resamples", "50", "--json", "--quiet")
    alone = evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--vocab", VOCAB, "--data", DATA)
    assert result["b"]["rsum"] == pytest.approx(alone["rsum"])            # theirs read with their vocabulary


def compare_json(capsys, *argv) -> dict:
    assert main(["compare", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------ clusters (sgraf diagnose)
def test_ratio_intervals_widen_with_the_items_a_cluster_shares():
    """200 clusters of 5 items: items alike within their cluster make the share's interval about
    sqrt(5) times as wide as independent items (resampling the items apart would miss it)."""
    rng = np.random.default_rng(0)
    alike = np.repeat(rng.random(200) < 0.4, 5).reshape(200, 5).sum(axis=1)
    apart = (rng.random((200, 5)) < 0.4).sum(axis=1)
    numerators = np.stack([alike, apart], axis=1)
    (low_a, high_a), (low_b, high_b) = significance.ratio_intervals(numerators, np.full((200, 2), 5), 4000)
    assert low_a < alike.sum() / 1000 < high_a and low_b < apart.sum() / 1000 < high_b
    assert (high_a - low_a) / (high_b - low_b) == pytest.approx(np.sqrt(5), rel=0.25)
    assert (high_b - low_b) == pytest.approx(2 * 1.96 * np.sqrt(0.4 * 0.6 / 1000), rel=0.15)
    assert significance.ratio_intervals(np.zeros((3, 1)), np.zeros((3, 1)), 40) == [None]   # no items
    with pytest.raises(InputError, match=r"of one shape, got \(3, 1\) and \(3, 2\)"):
        significance.ratio_intervals(np.zeros((3, 1)), np.zeros((3, 2)))


def test_diagnose_bootstrap_gives_an_interval_around_every_score(tmp_path, capsys):
    from sgraf import diagnose
    from sgraf.data.benchmark import VARIANTS, generate_benchmark, load_scenes

    generate_benchmark(tmp_path, features="synthetic", n_train=4, n_dev=4, n_test=60, synthetic_dim=8,
                       save_images=False)
    scenes = load_scenes(tmp_path, "test")
    sims = matrix(60, 11, signal=1.0)
    result = diagnose.diagnose_sims(sims, scenes, bootstrap=300)
    assert result == diagnose.diagnose_sims(sims, scenes, bootstrap=300)                  # seed 0
    assert {k: v for k, v in result.items() if k != "intervals"} == diagnose.diagnose_sims(sims, scenes)
    intervals = result["intervals"]
    assert intervals["unit"] == "family" and intervals["resamples"] == 300
    for kind in (*VARIANTS, "all"):
        for score in ("text", "image", "group"):
            value, bounds = result[kind][score], intervals[kind][score]
            assert (value is None) == (bounds is None), (kind, score)
            if value is not None:
                assert bounds[0] <= value <= bounds[1] and bounds[0] < bounds[1], (kind, score, value, bounds)
    for direction in ("i2t", "t2i"):
        for k in ("r1", "r5", "r10"):
            low, high = intervals["truth"][direction][k]
            assert low <= result["recall"]["truth"][direction][k] <= high
    np.save(tmp_path / "sims.npy", sims)
    assert main(["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(tmp_path), "--bootstrap",
                 "300"]) == 0
    out = capsys.readouterr().out
    assert "95 % intervals (300 resamples of the families, seed 0):" in out and "truth t2i  R@1 [" in out


def test_paired_ratio_p_matches_the_exact_test_and_ratio_intervals_take_differences():
    rng = np.random.default_rng(4)
    differences = rng.integers(-3, 6, size=(7, 1)).astype(float)
    denominators = np.full((7, 1), 8.0)
    observed = abs(differences.sum())
    exact = np.mean([abs(np.dot(signs, differences[:, 0])) >= observed - 1e-9
                     for signs in itertools.product((-1, 1), repeat=7)])
    (p,) = significance.paired_ratio_p(differences, denominators, resamples=40000, seed=2)
    assert 0 < exact < 1 and p == pytest.approx(exact, abs=0.01)
    assert significance.paired_ratio_p(np.zeros((3, 1)), np.zeros((3, 1)), 10) == [None]


def test_compare_families_pairs_diagnoses_scores_by_family(tmp_path, capsys):
    from sgraf import diagnose
    from sgraf.data.benchmark import VARIANTS, generate_benchmark, load_scenes

    generate_benchmark(tmp_path, features="synthetic", n_train=4, n_dev=4, n_test=60, synthetic_dim=8,
                       save_images=False)
    scenes = load_scenes(tmp_path, "test")
    a, b = matrix(60, 12, signal=1.5), matrix(60, 13, signal=0.5)
    result = diagnose.compare_families(a, b, scenes, resamples=500)
    figures = {name: diagnose.diagnose_sims(sims, scenes) for name, sims in (("a", a), ("b", b))}
    for kind in (*VARIANTS, "all"):
        for score in ("text", "image", "group"):
            row = result[kind][score]
            assert (row is None) == (figures["a"][kind][score] is None)
            if row is not None:
                assert row["a"] == pytest.approx(figures["a"][kind][score])
                assert row["b"] == pytest.approx(figures["b"][kind][score])
                assert row["interval"][0] <= row["difference"] <= row["interval"][1] and 0 < row["p"] <= 1
    assert result["truth"]["t2i"]["r5"]["a"] == pytest.approx(figures["a"]["recall"]["truth"]["t2i"]["r5"])
    same = diagnose.compare_families(a, a.copy(), scenes, resamples=100)
    assert same["all"]["group"]["difference"] == 0 and same["all"]["group"]["p"] == 1.0
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = ["compare", "--sims", str(tmp_path / "a.npy"), "--against", str(tmp_path / "b.npy"), "--resamples", "200"]
    assert main([*argv, "--data", str(tmp_path), "--diagnose"]) == 0
    out = capsys.readouterr().out
    assert "paired by family (200 resamples, seed 0):" in out and "relation group" in out
    assert main([*argv, "--data", str(tmp_path), "--diagnose", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["diagnose"]["unit"] == "family"
    for extra, message in ((["--diagnose"], "--diagnose needs --data"),
                           (["--data", str(tmp_path), "--diagnose", "--folds", "2"], "leave out --folds"),
                           (["--data", str(tmp_path), "--split", "dev", "--diagnose"], "score matrix of shape")):
        assert main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_few_resamples_are_named_in_one_warning(caplog):
    """Rough figures, not refused: the warning says so once per count."""
    sims = np.random.default_rng(3).standard_normal((20, 100)).astype(np.float32)
    with caplog.at_level("WARNING", logger="sgraf.significance"):
        significance.recall_intervals(sims, resamples=41)
        significance.recall_intervals(sims, resamples=41)
        significance.recall_intervals(sims, resamples=significance.FEW_RESAMPLES)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["41 resamples: the intervals' ends (and a comparison's p-value, at least 1/42) move from "
                        "one seed to another; 1000 or more is usual"]


@pytest.mark.parametrize("level,fewest", [(0.95, 40), (0.9, 20), (0.99, 200), (0.5, 4)])
def test_fewer_resamples_than_an_interval_has_tails_for_are_refused(level, fewest):
    """Each tail of a percentile interval should hold a resample: N (1 - level) / 2 >= 1."""
    sims = np.random.default_rng(3).standard_normal((20, 100)).astype(np.float32)
    assert significance.min_resamples(level) == fewest
    with pytest.raises(InputError, match=f"^{fewest - 1} resamples are too few for a {100 * level:g} % interval.*"
                                         f"at least {fewest} "):
        significance.recall_intervals(sims, resamples=fewest - 1, level=level)
    assert significance.recall_intervals(sims, resamples=fewest, level=level)["resamples"] == fewest


@pytest.mark.parametrize("argv", [["evaluate", "--checkpoint", "CKPT", "--data", "DATA", "--vocab", "VOCAB",
                                   "--bootstrap", "1"],
                                  ["diagnose", "--sims", "SIMS", "--data", "DATA", "--bootstrap", "39"],
                                  ["compare", "--sims", "A.npy", "--against", "B.npy", "--resamples", "100",
                                   "--level", "0.99"]])
def test_too_few_resamples_are_refused_in_one_line_before_any_work(capsys, monkeypatch, argv):
    from sgraf import evaluate

    monkeypatch.setattr(evaluate, "load_ensemble", lambda *a, **k: pytest.fail("a checkpoint was loaded"))
    monkeypatch.setattr(evaluate, "load_matrices", lambda *a, **k: pytest.fail("a matrix was read"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "resamples are too few for a" in err and len(err.strip().splitlines()) == 1, err


def test_chance_rsum_is_what_random_score_matrices_give():
    # two images of five captions, by hand: i2t R@1 5/10, R@5 1 - C(5,5)/C(10,5), R@10 1; t2i 1/2, 1, 1
    assert significance.chance_rsum(2, 5)["mean"] == pytest.approx(100 * (0.5 + (1 - 1 / 252) + 1 + 0.5 + 1 + 1))
    assert significance.chance_rsum(1, 1) == {"mean": 600.0, "high": 600.0, "level": 0.95, "draws": 2000}
    # against whole random matrices ranked by sgraf.metrics: the mean, and the quantiles (the draws
    # keep the link between the two directions through the true pairs' scores)
    rng = np.random.default_rng(3)
    for n_img in (6, 20):
        full = np.array([metrics.evaluate_sims(rng.random((n_img, 5 * n_img)))["rsum"] for _ in range(1500)])
        chance = significance.chance_rsum(n_img, draws=20000, level=0.9, seed=1)
        spread = full.std()
        assert abs(full.mean() - chance["mean"]) < 0.1 * spread, (n_img, full.mean(), chance)
        assert abs(np.quantile(full, 0.9) - chance["high"]) < 0.15 * spread, (n_img, np.quantile(full, 0.9), chance)
    # the same seed, the same figure; a model that learnt is far above
    assert significance.chance_rsum(32, seed=4) == significance.chance_rsum(32, seed=4)
    assert metrics.evaluate_sims(matrix(32, 0, signal=3.0))["rsum"] > significance.chance_rsum(32)["high"]


@pytest.mark.parametrize("kwargs, message", [
    ({"n_images": 0}, "at least one image"), ({"n_images": 5, "caps_per_image": 0}, "at least one image"),
    ({"n_images": 5, "draws": 0}, "draws must be a positive integer"),
    ({"n_images": 5, "level": 1.5}, "level must be a number between 0 and 1")])
def test_chance_rsum_refuses_odd_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        significance.chance_rsum(**kwargs)
