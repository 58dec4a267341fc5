"""`sgraf.score_record`: a saved score matrix's record of the split it scored, and the refusal of
matrices of another split (same shape) by `sgraf evaluate --sims` (tests/data/e2e)."""

import hashlib
import json
import logging
import pathlib
import shutil

import numpy as np
import pytest

from sgraf import score_record
from sgraf.data.precomp import data_fingerprint
from sgraf.cli import main

E2E = pathlib.Path(__file__).parent / "data" / "e2e"
DATA = E2E / "data" / "toy_precomp"
VOCAB = E2E / "data" / "toy_vocab.json"
CKPT = {"sgr": E2E / "sgr.pth.tar", "saf": E2E / "saf.pth.tar"}


def run(capsys, *args):
    assert main(["evaluate", *map(str, args), "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *args):
    assert main(["evaluate", *map(str, args), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def save(capsys, name, data, out):
    return run(capsys, "--checkpoint", CKPT[name], "--data", data, "--vocab", VOCAB, "--save-sims", out)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A split of the toy split's shape whose captions come in another order: Flickr30K's dev and
    test are alike in shape (1,000 x 5,000) the same way."""
    out = tmp_path_factory.mktemp("twin") / "toy_precomp"
    shutil.copytree(DATA, out)
    captions = (DATA / "test_caps.txt").read_text().splitlines()
    blocks = [captions[i:i + 5] for i in range(0, len(captions), 5)]
    (out / "test_caps.txt").write_text("\n".join(line for block in blocks[::-1] for line in block) + "\n")
    np.save(out / "test_ims.npy", np.load(DATA / "test_ims.npy")[::-1].copy())
    return out


def test_a_saved_matrix_records_its_split_and_makers(capsys, tmp_path):
    out = tmp_path / "sgr.npy"
    save(capsys, "sgr", DATA, out)
    record = json.loads((tmp_path / "sgr.npy.json").read_text())
    sims = np.load(out)
    assert record["format"] == score_record.FORMAT and record["shape"] == [6, 30]
    assert record["matrix_fingerprint"] == score_record.fingerprint(sims)
    assert record["split"] == {
        "data": str(DATA.resolve()), "split": "test", "captions": "test_caps.txt", "features": "test_ims.npy",
        "n_images": 6, "n_captions": 30, "fingerprint": data_fingerprint(DATA, ["test"])}
    assert record["split"]["fingerprint"]["test_caps.txt"] == hashlib.sha256(
        (DATA / "test_caps.txt").read_bytes()).hexdigest()
    assert record["checkpoints"] == [str(CKPT["sgr"].resolve())] and record["precision"] == "fp32"
    assert record["vocab"] == str(pathlib.Path(VOCAB).resolve())       # it decides every score of the authors' file
    assert score_record.read_record(out, np.load(out, mmap_mode="r")) == record


def test_a_matrix_of_another_split_of_the_same_shape_is_refused(capsys, tmp_path, twin):
    ours, theirs = tmp_path / "sgr.npy", tmp_path / "saf_twin.npy"
    save(capsys, "sgr", DATA, ours)
    save(capsys, "saf", twin, theirs)
    err = refused(capsys, "--sims", theirs, "--data", DATA)
    assert f"saf_twin.npy scored the captions of {twin.resolve() / 'test_caps.txt'}" in err
    assert "(its record saf_twin.npy.json)" in err and f"--data's split, {DATA.resolve() / 'test_caps.txt'}" in err
    err = refused(capsys, "--sims", ours, theirs)                  # no --data: the records against each other
    assert "saf_twin.npy scored the captions of" in err and f"{ours} those of {DATA.resolve()}" in err
    assert "must score one split" in err
    refused(capsys, "--sims", theirs, ours, "--data", DATA)
    assert run(capsys, "--sims", theirs, "--data", twin)["n_images"] == 6     # on its own split it is fine
    # the average records the split its matrices agree on, and is checked in turn
    save(capsys, "saf", DATA, tmp_path / "saf.npy")
    run(capsys, "--sims", ours, tmp_path / "saf.npy", "--save-sims", tmp_path / "avg.npy")
    average = json.loads((tmp_path / "avg.npy.json").read_text())
    assert average["split"] == json.loads((tmp_path / "sgr.npy.json").read_text())["split"]
    assert average["averaged"] == [str(ours.resolve()), str((tmp_path / "saf.npy").resolve())]
    assert "avg.npy scored the captions of" in refused(capsys, "--sims", tmp_path / "avg.npy", "--data", twin)


def test_captions_changed_since_the_scoring_are_named(capsys, tmp_path):
    data = tmp_path / "toy_precomp"
    shutil.copytree(DATA, data)
    save(capsys, "sgr", data, tmp_path / "sgr.npy")
    captions = (data / "test_caps.txt").read_text().splitlines()
    (data / "test_caps.txt").write_text("\n".join([captions[1], captions[0], *captions[2:]]) + "\n")
    err = refused(capsys, "--sims", tmp_path / "sgr.npy", "--data", data)
    assert f"scored {data.resolve() / 'test_caps.txt'} before that file changed" in err


def test_a_matrix_without_a_record_or_with_a_stale_one_is_checked_by_its_shape(capsys, caplog, tmp_path, twin):
    save(capsys, "sgr", DATA, tmp_path / "sgr.npy")
    save(capsys, "saf", twin, tmp_path / "saf_twin.npy")
    bare = tmp_path / "bare.npy"
    np.save(bare, np.load(tmp_path / "saf_twin.npy"))          # the authors' way: no record
    with caplog.at_level(logging.INFO, logger="sgraf.score_record"):
        assert run(capsys, "--sims", tmp_path / "sgr.npy", bare, "--data", DATA)["n_captions"] == 30
    assert [r.getMessage() for r in caplog.records] == [
        f"{bare} has no record beside it (bare.npy.json): it is checked by its shape only"]
    caplog.clear()
    # a record left beside a matrix written since by other means describes another matrix
    np.save(tmp_path / "sgr.npy", np.load(bare))
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "sgr.npy", "--data", DATA)
    assert "sgr.npy.json describes another matrix than" in caplog.text
    caplog.clear()
    (tmp_path / "bare.npy.json").write_text('{"format": ')
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", bare, "--data", DATA)
    assert "bare.npy.json: not a readable score matrix record" in caplog.text


def test_the_record_is_an_output_too(capsys, tmp_path):
    vocab = tmp_path / "sims.npy.json"
    shutil.copy(VOCAB, vocab)
    err = refused(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", vocab, "--save-sims",
                  tmp_path / "sims.npy")
    assert "--save-sims's record" in err and "is the input --vocab" in err
    assert vocab.read_bytes() == VOCAB.read_bytes()


def test_the_fingerprint_tells_matrices_apart_and_reads_few_rows(tmp_path):
    rng = np.random.default_rng(0)
    sims = rng.standard_normal((1000, 50)).astype(np.float32)
    other = sims.copy()
    other[0, 0] += 1e-3
    assert score_record.fingerprint(sims) != score_record.fingerprint(other)
    assert score_record.fingerprint(sims) != score_record.fingerprint(sims[:, :49])
    np.save(tmp_path / "m.npy", sims)
    assert score_record.fingerprint(np.load(tmp_path / "m.npy", mmap_mode="r")) == score_record.fingerprint(sims)
    assert score_record.fingerprint(np.zeros((0, 5), np.float32))
    # an ensemble's float64 matrix and its float32 rounding are other matrices (ties rank otherwise)
    wide = sims.astype(np.float64) + rng.random(sims.shape) * 1e-9
    assert score_record.fingerprint(wide) != score_record.fingerprint(wide.astype(np.float32))
    assert score_record.fingerprint(wide) != score_record.fingerprint(wide + 1e-15)
    assert score_record.fingerprint(sims.astype(np.float16)) == score_record.fingerprint(sims.astype(np.float16)
                                                                                       .astype(np.float32))


def test_diagnose_refuses_a_matrix_of_another_split_too(capsys, tmp_path):
    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.precomp import PrecompSplit

    for seed in (0, 1):
        generate_benchmark(tmp_path / f"seed{seed}", seed=seed, n_train=12, n_dev=4, n_test=16, save_images=False)
    sims = np.random.default_rng(0).standard_normal((16, 80)).astype(np.float32)
    np.save(tmp_path / "sims.npy", sims)
    score_record.write_record(tmp_path / "sims.npy", sims,
                              score_record.split_identity(PrecompSplit(tmp_path / "seed1", "test")))
    assert main(["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(tmp_path / "seed1"), "--json"]) == 0
    capsys.readouterr()
    assert main(["diagnose", "--sims", str(tmp_path / "sims.npy"), "--data", str(tmp_path / "seed0")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "sims.npy scored the captions of" in err and "seed1" in err, err


def test_a_record_that_cannot_be_written_stops_the_command_before_it_scores(capsys, tmp_path, monkeypatch):
    (tmp_path / "sims.npy.json").mkdir()
    scored = []
    monkeypatch.setattr("sgraf.evaluate.evaluate_split", lambda *args, **kwargs: scored.append(1))
    err = refused(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--save-sims",
                  tmp_path / "sims.npy")
    assert f"cannot write {tmp_path / 'sims.npy.json'}" in err and not scored
    assert not (tmp_path / "sims.npy").exists()


def test_other_features_of_the_same_captions_are_evaluated_with_a_warning(capsys, caplog, tmp_path):
    data = tmp_path / "toy_precomp"
    shutil.copytree(DATA, data)
    np.save(data / "test_ims.npy", np.load(DATA / "test_ims.npy") * 1.5)      # say, features extracted again
    save(capsys, "sgr", DATA, tmp_path / "sgr.npy")
    save(capsys, "saf", data, tmp_path / "saf.npy")
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "sgr.npy", tmp_path / "saf.npy")
    assert (f"saf.npy scored other features ({data.resolve() / 'test_ims.npy'}, by its record) than "
            f"{tmp_path / 'sgr.npy'} ({DATA.resolve() / 'test_ims.npy'}); the captions are the same") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "saf.npy", "--data", DATA)
    assert "than --data's split" in caplog.text


def test_other_region_boxes_of_the_same_captions_are_evaluated_with_a_warning(capsys, caplog, tmp_path):
    """A position model's scores read the boxes: a matrix of a split whose boxes changed since is
    named as the features are (records hold the boxes' digests from session 39 on)."""
    from sgraf.data.boxes import grid_boxes, write_boxes

    n_images = np.load(DATA / "test_ims.npy", mmap_mode="r").shape[0]
    folders = {}
    for name, width in (("a", 60), ("b", 90)):
        folders[name] = tmp_path / name
        shutil.copytree(DATA, folders[name])
        write_boxes(folders[name], "test", *grid_boxes(n_images, 2, 3, width, 40))
    save(capsys, "sgr", folders["b"], tmp_path / "plain.npy")     # a model without positions reads no boxes
    assert not any("boxes" in name for name in json.loads((tmp_path / "plain.npy.json").read_text())["split"]
                   ["fingerprint"])
    from sgraf.data.precomp import PrecompSplit
    from sgraf.score_record import split_identity, write_record

    sims = np.load(tmp_path / "plain.npy")
    np.save(tmp_path / "a.npy", sims)                          # as a position model's matrix of folder a
    write_record(tmp_path / "a.npy", sims, split_identity(PrecompSplit(folders["a"], "test")))
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "a.npy", "--data", folders["a"])
    assert "scored other" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "a.npy", "--data", folders["b"])
    assert (f"a.npy scored other region boxes and picture sizes ({folders['a'].resolve() / 'test_boxes.npy'}, "
            f"{folders['a'].resolve() / 'test_image_sizes.npy'}, by its record) than --data's split") in caplog.text
    caplog.clear()            # a split without the boxes it scored: said too (it had been evaluated unsaid)
    bare = tmp_path / "bare"
    shutil.copytree(DATA, bare)
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "a.npy", "--data", bare)
    assert (f"a.npy scored other region boxes and picture sizes ({folders['a'].resolve() / 'test_boxes.npy'}, "
            f"{folders['a'].resolve() / 'test_image_sizes.npy'}, by its record) than --data's split (no "
            "test_boxes.npy, no test_image_sizes.npy)") in caplog.text
    caplog.clear()            # the matrix of a model that read no boxes, on a split with boxes: nothing to say
    with caplog.at_level(logging.WARNING, logger="sgraf.score_record"):
        run(capsys, "--sims", tmp_path / "plain.npy", "--data", folders["b"])
    assert "scored other" not in caplog.text


def test_naming_the_record_imports_no_numpy_before_evaluate_starts_tokenising():
    """`sgraf evaluate` checks its outputs (the record's path too) before it starts tokenising the
    captions in another process and imports PyTorch: nothing heavy may come in before that."""
    import subprocess
    import sys

    code = ("import sys\nfrom sgraf.cli import build_parser\nfrom sgraf.cli.arguments import check_score_outputs\n"
            "args = build_parser().parse_args(['evaluate', '--checkpoint', 'x.pt', '--data', 'd', '--save-sims', "
            "'s.npy'])\ncheck_score_outputs(args)\nprint(sorted({'numpy', 'torch'} & set(sys.modules)))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"
