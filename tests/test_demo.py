"""`sgraf demo --quick`: the whole pipeline runs and its report holds what it claims."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sgraf.checkpoint import load_model
from sgraf.cli import main
from sgraf.data.precomp import PrecompSplit
from sgraf.devices import available_cores
from sgraf.metrics import evaluate_sims
from sgraf.significance import compare, p_text
from sgraf.training.pool import plan_workers

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    return out, main(["demo", "--quick", "--out", str(out)])   # positions=place by default


def test_quick_demo_prints_the_table_and_writes_the_report(demo, capsys):
    out, code = demo
    assert code == 0
    record = json.loads((out / "results.json").read_text())
    assert set(record["results"]) == {"global-only", "SAF", "SGR", "SGRAF", "SAF+pos", "SGR+pos", "SGRAF+pos"}
    table = record["table"].splitlines()
    assert [line.split("|")[0].strip() for line in table[4:]] == ["global-only", "Ours(SAF)", "Ours(SGR)",
                                                                 "Ours(SGRAF)", "Ours(SAF+pos)", "Ours(SGR+pos)",
                                                                 "Ours(SGRAF+pos)"]
    assert [line.split("|")[0].strip() for line in record["diagnosis_table"].splitlines()[4:]] == table_labels(table)
    report = (out / "report.md").read_text()
    workers, threads = plan_workers(5, cores=available_cores())   # five models, one per core
    assert record["training_workers"] == {"workers": workers, "threads": threads if workers > 1 else None}
    assert ("trained one after the other" if workers == 1 else f"trained {workers} at a time") in report
    assert set(record["timings_s"]) >= {"training", "train SGR", "train SGR+pos", "train global-only"}
    assert record["table"] in report
    assert ("trained SAF+pos with `batches=families family_share=0.5 place_sharpness=2 place_penalty=true`, "
            "SGR+pos with `batches=families family_share=0.5 place_sharpness=2 place_penalty=true "
            "global_loss_weight=1`") in report
    for run in ("saf-pos", "sgr-pos"):   # the checkpoints score with the places read at 2 x lambda, as a penalty
        config = load_model(out / "runs" / run / "best.pt").config
        assert config.place_sharpness == 2.0 and config.place_penalty is True
    assert record["diagnosis_table"] in report
    for name in ("curves.png", "diagnose.png", "retrieval_t2i.png", "retrieval_i2t.png", "explain_positive.png",
                 "explain_negative.png"):
        assert f"({name})" in report
        with Image.open(out / name) as picture:
            assert picture.format == "PNG" and min(picture.size) > 200


def table_labels(table: list[str]) -> list[str]:
    return [line.split("|")[0].strip() for line in table[4:]]


def test_quick_demo_numbers_are_the_checkpoints_numbers(demo):
    out, _ = demo
    record = json.loads((out / "results.json").read_text())
    test = PrecompSplit(out / "data", "test")
    sims = {}
    boxes = torch.from_numpy(test.boxes)
    for label in ("SGR", "SAF", "global-only", "SGR+pos", "SAF+pos"):
        model = load_model(out / "runs" / label.lower().replace("+", "-") / "best.pt")
        assert model.config.positions == ("place" if label.endswith("+pos") else "none")
        run_config = (out / "runs" / label.lower().replace("+", "-") / "config.yaml").read_text()
        if label.endswith("+pos"):   # the place term's recipe: half the families drawn whole
            assert "batches: families" in run_config and "family_share: 0.5" in run_config
        else:
            assert "batches: random" in run_config
        # SGR + place also ranks the global vectors; every other model trains with the authors' loss
        assert f"global_loss_weight: {1.0 if label == 'SGR+pos' else 0.0}" in run_config
        ids = [model.vocab.encode(c) for c in test.captions]
        lengths = torch.tensor([len(i) for i in ids])
        padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.int64)
        for row, caption in enumerate(ids):
            padded[row, :len(caption)] = torch.tensor(caption)
        sims[label] = model.score(torch.from_numpy(np.array(test.images)), padded, lengths, boxes=boxes).numpy()
    sims["SGRAF"] = (sims["SGR"] + sims["SAF"]) / 2
    sims["SGRAF+pos"] = (sims["SGR+pos"] + sims["SAF+pos"]) / 2
    for label, matrix in sims.items():
        expected = evaluate_sims(matrix)
        assert record["results"][label]["rsum"] == pytest.approx(expected["rsum"], abs=1e-6), label
    baseline = load_model(out / "runs" / "global-only" / "best.pt").config
    assert (baseline.alignments, baseline.module) == ("global", "ave")
    rsum = {k: v["rsum"] for k, v in record["results"].items()}
    assert record["story"]["sgraf_ge_best_single"] == (rsum["SGRAF"] >= max(rsum["SGR"], rsum["SAF"]))
    # the story's claims, paired on the test images as `sgraf compare` makes them, on these matrices
    best = "SGR" if rsum["SGR"] >= rsum["SAF"] else "SAF"
    tests = record["story"]["tests"]
    assert [(t["a"], t["b"]) for t in tests] == [("SGRAF", best), (best, "global-only"), ("SGRAF+pos", "SGRAF")]
    for test in tests:
        expected = compare(sims[test["a"]], sims[test["b"]], resamples=10000)
        assert test["difference"] == pytest.approx(rsum[test["a"]] - rsum[test["b"]], abs=1e-6)
        assert test["interval"] == pytest.approx(expected["interval"]["rsum"], abs=1e-6)
        assert test["p"] == pytest.approx(expected["p"]["rsum"], abs=0.02)    # matrices equal to float32 rounding
        report = (out / "report.md").read_text()
        assert f"  - {test['a']} - {test['b']}: {test['difference']:+.1f} [" in report


def test_quick_demo_index_is_searchable_from_the_command_line(demo, capsys):
    out, _ = demo
    # the index (and its pictures) serve the place models' ensemble, with the test split's boxes
    record = json.loads((out / "results.json").read_text())
    assert record["served"] == {"ensemble": "SGRAF+pos", "models": ["SGR+pos", "SAF+pos"]}
    manifest = json.loads((out / "index" / "manifest.json").read_text())
    assert [Path(model["source"]).parent.name for model in manifest["models"]] == ["sgr-pos", "saf-pos"]
    assert "image_boxes.npy" in manifest["files"]
    assert "re-ranked by the SGRAF+pos ensemble (SGR+pos + SAF+pos;" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["search", "--index", str(out / "index"), "--image-id", "0", "--top-k", "3", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 3 and all(0 <= h["id"] < 32 * 5 for h in hits)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_the_demo_serves_the_place_ensemble_only_where_its_models_read_places():
    from sgraf.demo import ENSEMBLES, served_ensemble

    assert served_ensemble("place") == "SGRAF+pos" and ENSEMBLES["SGRAF+pos"] == ("SGR+pos", "SAF+pos")
    assert [served_ensemble(positions) for positions in ("none", "box", "relation")] == ["SGRAF"] * 3


def test_demo_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("keep me")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert "is not empty and holds no earlier demo" in capsys.readouterr().err
    assert (tmp_path / "thesis.tex").read_text() == "keep me"


def test_demo_ends_by_printing_the_serve_command(demo, capsys, monkeypatch):
    out, _ = demo
    record = json.loads((out / "results.json").read_text())
    monkeypatch.setattr("sgraf.demo.run_demo", lambda *args, **kwargs: record)   # the run above, reported again
    capsys.readouterr()
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = lines[-1]
    assert last.endswith(f"sgraf serve --index {out / 'index'}")
    # the verdict line says each claim's p as the report does, "within noise" where p >= 0.05
    verdict = next(line for line in lines if line.startswith("SGRAF >= better of SGR/SAF: "))
    report = (out / "report.md").read_text()
    for test in record["story"]["tests"][:2]:
        words = f"p {p_text(test['p'], 10000)}" + ("" if test["p"] < 0.05 else ", within noise")
        assert f"(paired {words})" in verdict and f"], {words}\n" in report, (verdict, words)
    # the chance level: the report says which models random scores match, the console when all do
    chance = record["story"]["chance"]
    low = [label for label, value in record["story"]["rsum"].items() if value <= chance["high"]]
    assert f"Random scores give rsum {chance['mean']:.1f} on this split" in report
    assert (len(low) == len(record["story"]["rsum"])) == ("Every model here is within that" in report)
    assert (len(low) == len(record["story"]["rsum"])) == any("every model is at chance level" in line
                                                            for line in lines)
    # models above chance: neither says so
    from sgraf.demo_report import at_chance, chance_text

    above = {**record["story"], "rsum": dict.fromkeys(record["story"]["rsum"], chance["high"] + 1)}
    assert at_chance(above) == [] and chance_text(above).endswith("Every model is above it.")
    monkeypatch.setattr("sgraf.demo.run_demo", lambda *args, **kwargs: {**record, "story": above})
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    assert "at chance level" not in capsys.readouterr().out
    some = {**above, "rsum": {**above["rsum"], "SGR": chance["high"] - 1}}
    assert at_chance(some) == ["SGR"] and "Not above it: SGR; comparisons with it say little." in chance_text(some)
    from sgraf.cli import build_parser

    args = build_parser().parse_args(last.split("search it in a browser: ")[1].split()[1:])
    assert args.command == "serve" and (out / "index" / "manifest.json") == Path(args.index) / "manifest.json"


def test_quick_demo_data_diagnoses_with_the_demo_numbers(demo, capsys):
    out, _ = demo
    capsys.readouterr()
    assert main(["diagnose", "--checkpoint", str(out / "runs" / "sgr" / "best.pt"), "--checkpoint",
                 str(out / "runs" / "saf" / "best.pt"), "--data", str(out / "data"), "--split", "test",
                 "--json", "--quiet", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    record = json.loads((out / "results.json").read_text())
    assert result["all"]["pairs"] > 0
    for direction in ("i2t", "t2i"):
        for k in ("r1", "r5", "r10"):
            assert result["recall"]["standard"][direction][k] == pytest.approx(
                record["results"]["SGRAF"][direction][k], abs=1e-6)
            assert result["recall"]["truth"][direction][k] >= result["recall"]["standard"][direction][k]


def test_quick_demo_reports_what_each_model_tells_apart(demo):
    out, _ = demo
    record = json.loads((out / "results.json").read_text())
    from sgraf.data.benchmark import load_scenes
    from sgraf.diagnose import diagnose_sims

    test = PrecompSplit(out / "data", "test")
    sgr = load_model(out / "runs" / "sgr" / "best.pt")
    from sgraf.scoring import encode_split, score_matrix

    sims = score_matrix([sgr], [encode_split(sgr, test, sgr.vocab)])
    expected = diagnose_sims(sims, load_scenes(out / "data", "test"))
    assert record["diagnose"]["SGR"]["all"] == expected["all"]
    for direction in ("i2t", "t2i"):
        assert record["diagnose"]["SGR"]["recall"]["truth"][direction] == pytest.approx(
            expected["recall"]["truth"][direction])
    row = next(line for line in record["diagnosis_table"].splitlines() if line.startswith("Ours(SGR)"))
    cells = row.replace("|", " ").split()[1:]
    assert cells == [f"{100 * expected[k]['group']:.1f}" for k in ("binding", "attribute", "relation", "count", "all")] \
        + [f"{expected['recall']['truth'][d]['r1']:.1f}" for d in ("i2t", "t2i")]
    assert record["seeds"] == [0] and len(record["per_seed"]) == 1
    assert record["summary"]["results"]["SGR"]["rsum"] == {"mean": record["results"]["SGR"]["rsum"], "sd": None}


def test_demo_with_several_seeds_reports_mean_and_sd(tmp_path, capsys):
    out = tmp_path / "seeds"
    assert main(["demo", "--quick", "--out", str(out), "--seed", "4", "--seeds", "2", "--set", "sgr_step=1",
                 "--positions", "none"]) == 0   # seeds, not positions: the paper's models only
    printed = capsys.readouterr().out
    record = json.loads((out / "results.json").read_text())
    assert record["seeds"] == [4, 5] and [entry["seed"] for entry in record["per_seed"]] == [4, 5]
    assert "sgr_step=1" in record["settings"]["train_overrides"] and "sgr_step=2" not in record["settings"]["train_overrides"]
    for label, run in (("SGR", out / "runs" / "sgr"), ("SAF", out / "runs" / "seed-5" / "saf")):
        assert (run / "best.pt").is_file()
    assert load_model(out / "runs" / "seed-5" / "sgr" / "best.pt").config.sgr_step == 1
    first, second = (entry["results"]["SGR"]["rsum"] for entry in record["per_seed"])
    assert first != second                                   # the seeds train different models
    assert record["results"]["SGR"]["rsum"] == first         # runs/ holds the first seed's models
    summary = record["summary"]["results"]["SGR"]["rsum"]
    assert summary["mean"] == pytest.approx((first + second) / 2)
    assert summary["sd"] == pytest.approx(abs(first - second) / np.sqrt(2))
    groups = [entry["diagnose"]["SAF"]["count"]["group"] for entry in record["per_seed"]]
    assert record["summary"]["diagnose"]["SAF"]["count"]["group"]["mean"] == pytest.approx(np.mean(groups))
    assert "mean \u00b1 sd over 2 training seeds (4, 5)" in record["table"]
    sgr_row = next(line for line in record["table"].splitlines() if line.startswith("Ours(SGR)"))
    assert sgr_row.rstrip().endswith(f"{summary['mean']:.1f}\u00b1{summary['sd']:.1f}")
    assert record["table"] in printed and record["diagnosis_table"] in printed
    assert "\u00b1" in record["diagnosis_table"]
    assert "2 seeds (4, 5)" in (out / "report.md").read_text()
    with Image.open(out / "diagnose.png") as picture:
        assert picture.format == "PNG"


@pytest.mark.parametrize("extra, message", [
    (["--set", "seed=3"], "--set seed=3: the demo sets seed itself"),
    (["--set", "module=saf"], "--set module=saf: the demo sets module itself"),
    (["--set", "epochs"], "--set epochs: expected KEY=VALUE"),
    (["--set", "warmup_epochs=1"], "'warmup_epochs' .* needs max_violation=true"),
    # the valid keys it lists are those a user may set: not module, alignments, seed or positions
    (["--set", "epochz=3"], r"unknown training config key 'epochz' \(did you mean 'epochs'\?\); valid keys: "
                            r"img_dim, num_regions, word_dim, embed_size, sim_dim, num_layers, bi_gru, img_norm, "
                            r"txt_norm, sgr_step, similarity,"),
    (["--seeds", "0"], "argument --seeds: expected a positive integer, got 0"),
    (["--set", "positions=box"], "--set positions=box: the demo sets positions itself"),
    (["--positions", "grid"], "argument --positions: invalid choice: 'grid'"),
    (["--jobs", "0"], "argument --jobs: expected a positive integer, got 0"),
    (["--positions", "none", "--set", "place_sharpness=3"],
     r"--set place_sharpness=3: a setting of the place term, and this demo trains no place model \(--positions none\)"),
    (["--set", "place_sharpness=0.5"], r"place_sharpness.* \(the demo's SAF\+pos model\)"),
    (["--set", "epochs=2", "epochs=3"], r"--set epochs is given twice \(2, then 3\): give it once"),
])
def test_demo_refuses_bad_settings_before_it_writes(tmp_path, capsys, extra, message):
    import re

    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_mean_sd_of_nested_results():
    from sgraf.demo_report import mean_sd

    summary = mean_sd([{"a": 1.0, "b": {"c": 2, "d": None}, "e": "x"}, {"a": 3.0, "b": {"c": 4, "d": None}, "e": "x"}])
    assert summary == {"a": {"mean": 2.0, "sd": pytest.approx(np.sqrt(2))}, "b": {"c": {"mean": 3.0,
                       "sd": pytest.approx(np.sqrt(2))}, "d": None}, "e": "x"}
    assert mean_sd([{"a": 5.0}]) == {"a": {"mean": 5.0, "sd": None}}


def test_demo_plans_its_workers_for_the_device_the_training_resolves_to():
    from sgraf.demo import _on_gpu
    from sgraf.errors import InputError

    assert _on_gpu("cpu") is False
    assert _on_gpu("auto") is torch.cuda.is_available()
    with pytest.raises(InputError, match="not a device name"):
        _on_gpu("gpu:zero")


def test_the_users_set_wins_over_the_position_models_recipes():
    """`--set` changes every model that takes the key, the position-aware models' recipes included
    (they had kept their recipe's value while the report said the user's), and the place term's
    keys reach the place models only; the report's recipe shows what they trained with."""
    from sgraf.demo import demo_settings, methods, model_overrides, recipe_text
    from sgraf.training import resolve_config

    user = ("place_penalty=false", "batches=random", "global_loss_weight=0.5", "place_sharpness=3", "epochs=2")
    settings = demo_settings(True, "place", user)
    configs = {label: resolve_config("demo", overrides=model_overrides(settings, label, changes))[0]
               for label, changes in methods("place")}
    for label, config in configs.items():
        assert config.batches == "random" and config.global_loss_weight == 0.5 and config.epochs == 2, label
    assert configs["SGR+pos"].place_penalty is False and configs["SAF+pos"].place_sharpness == 3.0
    assert configs["SGR"].place_sharpness == 1.0 and configs["SGR"].positions == "none"
    assert "place_sharpness" not in " ".join(settings.train_overrides)
    text = recipe_text("place", settings.user_overrides)
    assert "family_share" not in " ".join(model_overrides(settings, "SAF+pos", dict(methods("place"))["SAF+pos"]))
    assert "SGR+pos with `batches=random place_sharpness=3 place_penalty=false " \
           "global_loss_weight=0.5`" in text, text
    assert demo_settings(True, "place").user_overrides == () and "place_penalty=true" in recipe_text("place")


def test_the_demos_own_settings_without_effect_in_a_model_are_left_out_not_warned(caplog):
    """`--quick` sets sgr_step=2 for every model: the global-only and SAF models had each warned
    '--set: sgr_step=2 has no effect', as if the user had set it."""
    from sgraf.demo import demo_settings, methods, model_overrides
    from sgraf.training import resolve_config

    caplog.set_level("WARNING", logger="sgraf.training.config")
    for user in ((), ("epochs=2",)):
        settings = demo_settings(True, "place", user)
        overrides = {label: model_overrides(settings, label, changes) for label, changes in methods("place")}
        for label, pairs in overrides.items():
            resolve_config("demo", overrides=pairs)
            assert ("sgr_step=2" in pairs) == (label in ("SGR", "SGR+pos")), (label, pairs)
    assert "has no effect" not in caplog.text
    settings = demo_settings(True, "none", ("sgr_step=4",))               # the user's own: kept, and said
    saf = model_overrides(settings, "SAF", dict(methods())["SAF"])
    assert "sgr_step=4" in saf
    resolve_config("demo", overrides=saf)
    assert "sgr_step=4 has no effect: module=saf has no SGR head" in caplog.text


def test_the_demo_reuses_its_benchmark_only_while_its_files_are_as_generated(tmp_path, caplog):
    """An edited caption file in DEMO/data had been reused, and the report's Winoground figures
    came from scenes that no longer described the captions."""
    from sgraf.demo import QUICK, _data

    caplog.set_level("INFO", logger="sgraf.demo")
    _data(tmp_path, QUICK, "synthetic", 0)
    captions = (tmp_path / "data" / "test_caps.txt").read_bytes()
    caplog.clear()
    _data(tmp_path, QUICK, "synthetic", 0)
    assert "reusing the benchmark" in caplog.text
    (tmp_path / "data" / "test_caps.txt").write_bytes(b"a red square\n" + captions.split(b"\n", 1)[1])
    caplog.clear()
    _data(tmp_path, QUICK, "synthetic", 0)
    assert "changed since it was generated (test_caps.txt): generating it again" in caplog.text
    assert (tmp_path / "data" / "test_caps.txt").read_bytes() == captions
    boxes = np.load(tmp_path / "data" / "test_boxes.npy")
    boxes[0, 0, 2] -= 1
    np.save(tmp_path / "data" / "test_boxes.npy", boxes)                  # the place models read them
    caplog.clear()
    _data(tmp_path, QUICK, "synthetic", 0)
    assert "changed since it was generated (test_boxes.npy)" in caplog.text


def test_a_demo_run_again_resumes_every_run_it_left_the_position_models_too(demo, tmp_path):
    """The demo compares each run's data as `fit` recorded it: a position model's run records its
    boxes, picture sizes and scenes (`loop.run_fingerprint`), and the demo had compared the features
    and captions alone, so its SAF + pos and SGR + pos never resumed: they were removed and trained anew."""
    import shutil

    from sgraf.demo import _resume_or_remove
    from sgraf.training import run_dir as rd
    from sgraf.training.pool import TrainJob

    out = tmp_path / "demo"
    shutil.copytree(demo[0], out)
    runs = sorted(path for path in (out / "runs").iterdir() if (path / "last.pt").is_file())
    jobs = [TrainJob(name=run.name, config=rd.load_run_config(run)[0], data=out / "data", run=run, preset="demo")
            for run in runs]
    assert any(job.config.positions == "place" and job.config.batches == "families" for job in jobs)
    kept, resumed = _resume_or_remove(out, {0: jobs})
    assert sorted(resumed) == sorted(run.name for run in runs) and all(job.resume for job in kept[0])
    assert all((run / "last.pt").is_file() for run in runs)


def test_the_story_says_a_p_at_its_floor_as_compare_does():
    from sgraf.demo_report import p_verdict

    assert p_verdict({"p": 1 / 10001, "resamples": 10000}) == "p <=1.0e-04"
    assert p_verdict({"p": 0.0312}) == "p 0.031"
    assert p_verdict({"p": 0.2}) == "p 0.200, within noise"
