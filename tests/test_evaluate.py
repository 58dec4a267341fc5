"""`sgraf evaluate` end to end on the authors' checkpoints and toy data (tests/data/e2e)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from numerics import AUTHORS, BFLOAT16, REORDERED, assert_close
from sgraf import metrics
from sgraf.cli import main

pytestmark = pytest.mark.numeric

E2E = pathlib.Path(__file__).parent / "data" / "e2e"
DATA = E2E / "data" / "toy_precomp"
VOCAB = E2E / "data" / "toy_vocab.json"
CKPT = {"sgr": E2E / "sgr.pth.tar", "saf": E2E / "saf.pth.tar"}
KEYS = ["r1", "r5", "r10", "medr", "meanr"]


@pytest.fixture(scope="module")
def expected():
    return torch.load(E2E / "expected.pt", weights_only=True)


def evaluate_json(capsys, *args):
    assert main(["evaluate", *map(str, args), "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def checkpoint_args(names):
    return [a for name in names for a in ("--checkpoint", CKPT[name])]


@pytest.mark.parametrize("names,key", [(["sgr"], "sgr"), (["saf"], "saf"), (["sgr", "saf"], "ensemble")])
def test_reproduces_the_authors_matrices_and_recalls(capsys, tmp_path, expected, names, key):
    out = tmp_path / "sims.npy"
    result = evaluate_json(capsys, *checkpoint_args(names), "--data", DATA, "--split", "test", "--vocab", VOCAB,
                           "--save-sims", out)
    assert list(result) == ["n_images", "n_captions", "i2t", "t2i", "rsum"]
    assert (result["n_images"], result["n_captions"]) == (6, 30)
    assert list(result["i2t"]) == KEYS and list(result["t2i"]) == KEYS
    assert [result["i2t"][k] for k in KEYS] == expected[f"{key}_i2t"]
    assert [result["t2i"][k] for k in KEYS] == expected[f"{key}_t2i"]
    assert result["rsum"] == expected[f"{key}_rsum"]
    sims = np.load(out)
    # one model's scores in float32; an ensemble's mean in float64, as the authors' arrays hold it
    assert sims.dtype == (np.float64 if len(names) > 1 else np.float32) and sims.shape == (6, 30)
    assert_close(sims, expected[f"sims_{key}"], AUTHORS)


def test_folds_are_the_protocol_on_consecutive_blocks(capsys, expected, monkeypatch, tmp_path):
    from sgraf import scoring

    scored, score_matrix = [], scoring.score_matrix

    def counted(models, encoded, *args, **kwargs):
        scored.append((encoded[0].n_images, encoded[0].n_captions))
        return score_matrix(models, encoded, *args, **kwargs)

    monkeypatch.setattr(scoring, "score_matrix", counted)
    result = evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--folds", "3")
    assert scored == [(2, 10)] * 3      # each fold's images against its own captions, not the whole matrix
    saved = evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--folds", "3",
                          "--save-sims", tmp_path / "whole.npy")
    assert scored[3:] == [(6, 30)] and saved == result  # a matrix saved is the whole one; the same figures
    assert list(result) == ["n_images", "n_captions", "i2t", "t2i", "rsum", "folds"]
    assert len(result["folds"]) == 3
    sims = expected["sims_sgr"].numpy()
    for k, fold in enumerate(result["folds"]):
        alone = metrics.evaluate_sims(sims[2 * k:2 * k + 2, 10 * k:10 * k + 10])
        assert fold == alone
    for direction in ("i2t", "t2i"):
        for key in KEYS:
            values = [fold[direction][key] for fold in result["folds"]]
            assert result[direction][key] == pytest.approx(sum(values) / 3, abs=1e-12)
    assert result["rsum"] == pytest.approx(sum(f["rsum"] for f in result["folds"]) / 3, abs=1e-12)


def test_saved_matrices_evaluate_and_ensemble(capsys, tmp_path, expected):
    paths = {}
    for name in ("sgr", "saf"):
        paths[name] = tmp_path / f"{name}.npy"
        evaluate_json(capsys, "--checkpoint", CKPT[name], "--data", DATA, "--vocab", VOCAB, "--save-sims", paths[name])
    both = evaluate_json(capsys, "--sims", paths["sgr"], paths["saf"], "--data", DATA, "--save-sims",
                         tmp_path / "avg.npy")
    assert [both["i2t"][k] for k in KEYS] == expected["ensemble_i2t"]
    assert [both["t2i"][k] for k in KEYS] == expected["ensemble_t2i"]
    assert both["rsum"] == expected["ensemble_rsum"]
    averaged = np.load(tmp_path / "avg.npy")
    assert_close(averaged, expected["sims_ensemble"], AUTHORS)
    # the exact mean of the two float32 matrices, in float64: the bits the checkpoints' ensemble gives
    assert averaged.dtype == np.float64
    assert np.array_equal(averaged, (np.load(paths["sgr"]).astype(np.float64) + np.load(paths["saf"])) / 2)
    evaluate_json(capsys, *checkpoint_args(["sgr", "saf"]), "--data", DATA, "--vocab", VOCAB, "--save-sims",
                  tmp_path / "ensemble.npy")
    assert (tmp_path / "ensemble.npy").read_bytes() == (tmp_path / "avg.npy").read_bytes()
    alone = evaluate_json(capsys, "--sims", paths["saf"])  # no --data: shape taken as it is
    assert alone["rsum"] == expected["saf_rsum"]


def test_an_ensembles_mean_is_ranked_unrounded_as_the_authors_rank_it(capsys, tmp_path):
    """Two means closer than half a float32 step: rounded to float32 they tie and the tie-break
    orders them; the authors' float64 mean ranks the larger first, and so does ours."""
    step = np.float32(2.0 ** -24)                 # a float32 step in [0.5, 1)
    first = np.full((2, 10), 0.25, dtype=np.float32)
    second = first.copy()
    for image in (0, 1):
        others = [c for c in range(10) if c // 5 != image]
        first[image, others[0]] = second[image, others[0]] = 0.75      # a wrong caption at 0.75
        truth = 5 * image + (4 if image == 0 else 0)                     # before or after it
        first[image, truth], second[image, truth] = 0.75, np.float32(0.75) + step   # mean 0.75 + step / 2
    assert np.float32((first.astype(np.float64) + second) / 2)[0, 4] == np.float32(0.75)   # ties in float32
    np.save(tmp_path / "a.npy", first)
    np.save(tmp_path / "b.npy", second)
    result = evaluate_json(capsys, "--sims", tmp_path / "a.npy", tmp_path / "b.npy")
    exact = metrics.evaluate_sims((first.astype(np.float64) + second) / 2)
    rounded = metrics.evaluate_sims(((first.astype(np.float64) + second) / 2).astype(np.float32))
    assert result["i2t"]["r1"] == exact["i2t"]["r1"] == 100.0 and rounded["i2t"]["r1"] < 100.0


@pytest.mark.parametrize("batch_size", ["1", "7"])
def test_batch_size_does_not_change_results(capsys, tmp_path, expected, batch_size):
    out = tmp_path / "sims.npy"
    result = evaluate_json(capsys, *checkpoint_args(["sgr", "saf"]), "--data", DATA, "--vocab", VOCAB,
                           "--batch-size", batch_size, "--save-sims", out)
    assert result["rsum"] == expected["ensemble_rsum"]
    assert_close(np.load(out), expected["sims_ensemble"], AUTHORS)


def test_bf16_stays_close(capsys, caplog, tmp_path, expected):
    from sgraf.kernels.cpu import onednn_runs
    from sgraf.precision import slow_on_this_cpu

    out = tmp_path / "sims.npy"
    slow_on_this_cpu.cache_clear()
    evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--precision", "bf16",
                  "--save-sims", out)
    assert_close(np.load(out), expected["sims_sgr"], BFLOAT16, scale=1.0)
    assert not np.array_equal(np.load(out), expected["sims_sgr"].numpy())   # bf16 really ran
    # a CPU without bf16 kernels (AVX2 only) is named once; one with them, not at all
    slow = [r for r in caplog.records if r.getMessage().startswith("bf16 on this CPU is several times slower")]
    assert len(slow) == (0 if onednn_runs(torch.bfloat16) else 1)


def test_our_checkpoints_carry_their_vocabulary(capsys, tmp_path, expected):
    from sgraf.checkpoint import convert_official

    ours = tmp_path / "sgr.pt"
    convert_official(CKPT["sgr"], ours, vocab=str(VOCAB))
    result = evaluate_json(capsys, "--checkpoint", ours, "--data", DATA)  # no --vocab needed
    assert result["rsum"] == expected["sgr_rsum"]


def test_python_callers_may_name_one_checkpoint_by_a_string(expected):
    """One path is one checkpoint (not its characters); an empty list is a one-line error."""
    from sgraf import evaluate
    from sgraf.errors import InputError

    for one in (str(CKPT["sgr"]), CKPT["sgr"], [CKPT["sgr"]]):
        assert evaluate.evaluate_checkpoints(one, DATA, "test", vocab=VOCAB)["rsum"] == expected["sgr_rsum"]
    models, _ = evaluate.load_ensemble(str(CKPT["saf"]), vocab=str(VOCAB), device="auto")
    assert len(models) == 1 and models[0].config.module == "saf"
    for bad, message in (([], "got an empty list"), ([CKPT["sgr"], 3], "expected paths, got int 3")):
        with pytest.raises(InputError, match=message):
            evaluate.evaluate_checkpoints(bad, DATA, "test", vocab=VOCAB)


def test_readable_table(capsys, expected):
    assert main(["evaluate", "--checkpoint", str(CKPT["saf"]), "--data", str(DATA), "--vocab", str(VOCAB),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "6 images x 30 captions" in out
    assert "R@1" in out and "meanr" in out
    assert f"rsum {expected['saf_rsum']:.1f}" in out


def error_of(capsys, *args):
    assert main(["evaluate", *map(str, args), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def test_missing_split_lists_the_existing_ones(capsys):
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--split", "testall")
    assert "'testall' does not exist" in err and "splits there: test" in err


@pytest.mark.parametrize("asked, meant", [("Test", "test"), ("tset", "test"), ("TEST", "test")])
def test_a_split_named_in_other_letters_or_misspelt_is_pointed_at_the_one_meant(capsys, asked, meant):
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--split", asked)
    assert err.rstrip().endswith(f"splits there: test; did you mean {meant!r}?"), err


def test_vocabulary_size_must_match_the_embedding(capsys, tmp_path):
    content = json.loads(VOCAB.read_text())
    content["word2idx"]["zebra"] = content["idx"]
    content["idx2word"][str(content["idx"])] = "zebra"
    content["idx"] += 1
    bigger = tmp_path / "vocab.json"
    bigger.write_text(json.dumps(content))
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", bigger)
    assert "182 words" in err and "181 rows" in err


def test_a_vocabulary_other_than_the_checkpoints_own_is_refused(capsys, tmp_path):
    """Same size, two words' ids swapped: the scores would be wrong with exit 0."""
    from sgraf.checkpoint import convert_official

    ours = tmp_path / "sgr.pt"
    convert_official(CKPT["sgr"], ours, vocab=str(VOCAB))
    content = json.loads(VOCAB.read_text())
    words = sorted(content["word2idx"], key=content["word2idx"].get)
    first, second = words[5], words[6]
    content["word2idx"][first], content["word2idx"][second] = content["word2idx"][second], content["word2idx"][first]
    content["idx2word"] = {str(i): w for w, i in content["word2idx"].items()}
    swapped = tmp_path / "swapped.json"
    swapped.write_text(json.dumps(content))
    err = error_of(capsys, "--checkpoint", ours, "--data", DATA, "--vocab", swapped)
    assert f"{ours} carries its own vocabulary, which differs from {swapped}" in err
    assert evaluate_json(capsys, "--checkpoint", ours, "--data", DATA, "--vocab", VOCAB)["rsum"] > 0   # its own


def test_save_sims_never_lands_among_another_data_sets_or_indexs_files(capsys, tmp_path):
    """Not an input of this command, but another command's files: a data set's features (its
    data check would then fail) or a file in an index folder (its manifest would not match)."""
    import shutil

    other = tmp_path / "other-data"
    shutil.copytree(DATA, other)
    index = tmp_path / "index"
    index.mkdir()
    (index / "manifest.json").write_text("{}")
    (index / "image_keys.npy").write_bytes(b"keys")
    before = {path: path.read_bytes() for path in [*other.iterdir(), *index.iterdir()]}
    for out, what in ((other / "test_ims.npy", f"is a file name of the precomp data set in {other}"),
                      (other / "dev_ims.npy", f"is a file name of the precomp data set in {other}"),
                      (index / "image_keys.npy", f"is in the folder of the sgraf index {index}"),
                      (index / "sims.npy", f"is in the folder of the sgraf index {index}")):
        err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB, "--save-sims", out)
        assert f"--save-sims {out} {what}" in err
    assert {path: path.read_bytes() for path in [*other.iterdir(), *index.iterdir()]} == before
    assert evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA, "--vocab", VOCAB,
                         "--save-sims", tmp_path / "sims.npy")["rsum"] > 0     # beside them is fine


def test_authors_checkpoint_without_vocab_is_refused(capsys):
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--data", DATA)
    assert "--vocab" in err


def test_ensemble_with_different_vocabularies_is_refused(capsys, tmp_path):
    from sgraf.checkpoint import convert_official
    from sgraf.data.vocab import Vocabulary, load_vocab

    vocab = load_vocab(VOCAB)
    swapped = dict(vocab.word2idx)
    swapped["horses"], swapped["kitchen"] = vocab.word2idx["kitchen"], vocab.word2idx["horses"]
    convert_official(CKPT["sgr"], tmp_path / "a.pt", vocab=vocab)
    convert_official(CKPT["saf"], tmp_path / "b.pt", vocab=Vocabulary(swapped))
    err = error_of(capsys, "--checkpoint", tmp_path / "a.pt", "--checkpoint", tmp_path / "b.pt", "--data", DATA)
    assert "different vocabularies" in err
    # an authors' checkpoint (no vocabulary) beside b.pt: --vocab is needed for the one and refused by the
    # other, so the error says the two cannot share one (it had said to leave out --vocab)
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", tmp_path / "b.pt", "--data", DATA,
                   "--vocab", VOCAB)
    assert f"differs from --vocab {VOCAB} that {CKPT['sgr']} (no vocabulary of its own)" in err
    assert "an ensemble needs one vocabulary" in err and "leave out --vocab" not in err
    assert evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", tmp_path / "a.pt", "--data", DATA,
                         "--vocab", VOCAB)["rsum"] > 0      # the same word ids: one vocabulary for both
    # a vocabulary of another size: the same error (the size check had come first and blamed the one or the
    # other), and without --vocab the error says what the one --vocab must be
    from model_helpers import random_model
    from sgraf.checkpoint import save_model

    small = Vocabulary.from_words([f"w{i}" for i in range(30)])
    save_model(random_model(0, vocab_size=len(small)), tmp_path / "small.pt", vocab=small)
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", tmp_path / "small.pt", "--data", DATA,
                   "--vocab", VOCAB)
    assert f"{tmp_path / 'small.pt'} carries its own vocabulary, which differs from --vocab {VOCAB}" in err
    err = error_of(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", tmp_path / "small.pt", "--data", DATA)
    assert (f"checkpoint {CKPT['sgr']} carries no vocabulary (the authors' checkpoints do not) and "
            f"{tmp_path / 'small.pt'} carries its own: pass the vocabulary {CKPT['sgr']} was trained with") in err


def test_an_ensemble_member_that_scores_every_pair_alike_is_named(capsys, caplog, tmp_path):
    """Averaged, a model whose scores barely vary adds a near-constant: the ensemble ranks as the
    others do, silently (a collapsed place model beside an SGR had given the SGR's figures)."""
    import logging

    from sgraf.checkpoint import load_model, save_model

    model = load_model(CKPT["sgr"], vocab=VOCAB)
    with torch.no_grad():
        model.sim_enc.sim_eval_w.weight.zero_()              # one logit for every pair: one score
    save_model(model, tmp_path / "flat.pt")
    with caplog.at_level(logging.WARNING, logger="sgraf.evaluate"):
        alone = evaluate_json(capsys, "--checkpoint", CKPT["saf"], "--data", DATA, "--vocab", VOCAB)
        both = evaluate_json(capsys, "--checkpoint", CKPT["saf"], "--checkpoint", tmp_path / "flat.pt", "--data",
                             DATA, "--vocab", VOCAB)
    assert both["rsum"] == pytest.approx(alone["rsum"])      # what the warning is about
    assert f"{tmp_path / 'flat.pt'} scores every pair almost alike (sd 0 over 6 x 6 pairs" in caplog.text
    assert str(CKPT["saf"]) not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgraf.evaluate"):
        evaluate_json(capsys, "--checkpoint", CKPT["sgr"], "--checkpoint", CKPT["saf"], "--data", DATA, "--vocab",
                      VOCAB)
    assert "almost alike" not in caplog.text


def test_saved_matrices_under_torchrun_are_evaluated_by_the_first_process_alone(capsys, tmp_path, monkeypatch):
    """Saved matrices have no shares to score: every process had printed the table (and written
    --save-sims)."""
    np.save(tmp_path / "a.npy", np.random.default_rng(0).random((6, 30), dtype=np.float32))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["evaluate", "--sims", str(tmp_path / "a.npy"), "--save-sims", str(tmp_path / "b.npy")]) == 0
    assert capsys.readouterr().out == "" and not (tmp_path / "b.npy").exists()
    monkeypatch.setenv("RANK", "0")
    assert main(["evaluate", "--sims", str(tmp_path / "a.npy"), "--save-sims", str(tmp_path / "b.npy")]) == 0
    assert "rsum" in capsys.readouterr().out and (tmp_path / "b.npy").is_file()


def test_saved_matrix_of_the_wrong_shape_is_refused(capsys, tmp_path):
    np.save(tmp_path / "good.npy", np.zeros((6, 30), np.float32))
    np.save(tmp_path / "short.npy", np.zeros((6, 25), np.float32))
    err = error_of(capsys, "--sims", tmp_path / "short.npy", "--data", DATA)
    assert "(6, 25)" in err and "(6, 30)" in err
    err = error_of(capsys, "--sims", tmp_path / "good.npy", tmp_path / "short.npy")
    assert "short.npy" in err and "(6, 25)" in err
    np.save(tmp_path / "flat.npy", np.zeros(30, np.float32))
    assert "2-d" in error_of(capsys, "--sims", tmp_path / "flat.npy")
    np.save(tmp_path / "transposed.npy", np.zeros((30, 6), np.float32))      # without --data: the file named
    assert error_of(capsys, "--sims", tmp_path / "transposed.npy").strip() == (
        f"sgraf evaluate: error: {tmp_path / 'transposed.npy'}: score matrix of shape (30, 6); expected (n_images, "
        "n_captions) with a whole number of captions per image (the transpose of one?)")


def run_torchrun(nproc, out, timeout=240):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "sgraf", "evaluate", *map(str, checkpoint_args(["sgr", "saf"])), "--data", str(DATA),
               "--vocab", str(VOCAB), "--json", "--quiet", "--save-sims", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    return json.loads(lines[0]), np.load(out)


def test_two_gloo_processes_equal_one(tmp_path, expected):
    one, sims_one = run_torchrun(1, tmp_path / "one.npy")
    two, sims_two = run_torchrun(2, tmp_path / "two.npy")
    assert one == two
    np.testing.assert_array_equal(sims_one, sims_two)
    assert two["rsum"] == expected["ensemble_rsum"]
    assert_close(sims_two, expected["sims_ensemble"], AUTHORS)


def test_the_gpu_plan_emulated_on_the_cpu_gives_the_cpus_metrics_and_matrix(tmp_path, monkeypatch):
    """The whole evaluation under the plan a CUDA device gets (`plan.emulate_gpu`): images read
    ahead on threads, caption buckets of `GPU_CAPTION_BLOCK`, image blocks of `GPU_IMAGE_BLOCK`,
    the matrix kept where it was scored for the metrics and copied to the host band by band as
    each image block is scored (`HostCopy`), and not copied at all when nothing asks for it. A
    split large enough for two image blocks and two caption buckets scores as the CPU's plan does."""
    from sgraf import evaluate
    from sgraf.model.host_copy import HostCopy
    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.evaluate import evaluate_checkpoints_with_sims
    from sgraf.kernels import plan
    from sgraf.model import blocks
    from sgraf.model.sgraf import SGRAF

    n_img = blocks.GPU_IMAGE_BLOCK + 44                        # two image blocks
    assert 5 * n_img > blocks.GPU_CAPTION_BLOCK                # two caption buckets
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", rng.standard_normal((n_img, 5, 12)).astype(np.float32))
    (data / "test_caps.txt").write_text("".join(" ".join(rng.choice(words, size=2 + i % 9)) + "\n"
                                                for i in range(5 * n_img)))
    vocab = Vocabulary.from_words(words)
    checkpoints = []
    for module in ("sgr", "saf"):
        torch.manual_seed(1)
        model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=12, word_dim=4, embed_size=8, sim_dim=4,
                                  num_regions=5, sgr_step=1, module=module))
        checkpoints.append(tmp_path / f"{module}.pt")
        save_model(model, checkpoints[-1], vocab=vocab)
    bands, copies = [], []                                      # rows handed over, rows copied by the worker
    band, copy_band = HostCopy.band, HostCopy._copy
    monkeypatch.setattr(HostCopy, "band", lambda self, share, rows: (bands.append(rows), band(self, share, rows))[1])
    monkeypatch.setattr(HostCopy, "_copy", lambda self, share, rows, event: (copies.append(rows),
                                                                              copy_band(self, share, rows, event))[1])
    on_cpu, cpu_sims = evaluate_checkpoints_with_sims(checkpoints, data, "test", batch_size=128)
    assert bands == []                                          # the CPU's plan: the matrix is on the host
    with plan.emulate_gpu():
        on_plan, plan_sims = evaluate_checkpoints_with_sims(checkpoints, data, "test", batch_size=128)
    blocks_ = blocks.GPU_IMAGE_BLOCK
    assert bands == copies == [slice(0, blocks_), slice(blocks_, n_img)]
    assert isinstance(plan_sims, np.ndarray) and plan_sims.shape == (n_img, 5 * n_img)
    # other block and chunk sizes: the matmuls' sums taken in another order (MKL's SSE2 code, a
    # kernel of another processor, gave 1.01e-6 where a bare 1e-6 had been asked)
    assert_close(plan_sims, cpu_sims, REORDERED, what="GPU plan emulated against the CPU's")
    assert on_plan == metrics.evaluate_sims(plan_sims)
    assert on_plan["rsum"] == pytest.approx(on_cpu["rsum"], abs=1.0)   # a near-tie may flip one rank
    # without --save-sims nothing is copied to the host; with it, the bands are what is saved
    bands.clear()
    with plan.emulate_gpu():
        assert evaluate.evaluate_checkpoints(checkpoints, data, "test", batch_size=128) == on_plan
        assert bands == []
        assert evaluate.evaluate_checkpoints(checkpoints, data, "test", batch_size=128,
                                             save_sims=tmp_path / "sims.npy") == on_plan
    assert len(bands) == 2 and np.array_equal(np.load(tmp_path / "sims.npy"), plan_sims)
    np.save(tmp_path / "expected.npy", plan_sims)          # written by the bands: NumPy's own bytes
    assert (tmp_path / "sims.npy").read_bytes() == (tmp_path / "expected.npy").read_bytes()
    # a failure after the bands were written leaves the previous file and no temporary one
    monkeypatch.setattr(metrics, "evaluate_sims", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    before = sorted(tmp_path.iterdir())
    with plan.emulate_gpu(), pytest.raises(RuntimeError, match="stop"):
        evaluate.evaluate_checkpoints(checkpoints, data, "test", batch_size=128, save_sims=tmp_path / "sims.npy")
    assert sorted(tmp_path.iterdir()) == before
    assert (tmp_path / "sims.npy").read_bytes() == (tmp_path / "expected.npy").read_bytes()


def test_scores_at_the_sigmoids_ceiling_are_said_to_tie(tmp_path, caplog):
    """A model whose scores reach 1.0 exactly (its sigmoid saturated) ranks by the tie-break; the
    evaluation says so, naming the place term for a place model without its penalty, once per model."""
    from types import SimpleNamespace

    from sgraf.evaluate import warn_saturated

    class Place(torch.nn.Module):                          # a place model without its penalty, as far as seen
        config = SimpleNamespace(positions="place", place_penalty=False)

    sims = np.random.default_rng(0).random((4, 20), dtype=np.float32)
    caplog.set_level("WARNING", logger="sgraf.evaluate")
    assert warn_saturated(sims) == 0 and not caplog.records
    assert warn_saturated(sims * 30 + 1) == 0 and not caplog.records     # another tool's logits: none is 1.0
    assert warn_saturated(np.full((4, 20), 0.25, np.float32)) == 0          # a collapsed model: said
    assert "every score is 0.25: the model scores every pair alike (collapsed" in caplog.text
    caplog.clear()
    sims[:, :5] = 1.0
    np.save(tmp_path / "sims.npy", sims)
    assert main(["evaluate", "--sims", str(tmp_path / "sims.npy"), "--quiet"]) == 0
    assert "20 of the 80 scores (25.0 %) are exactly 1.0: the sigmoid saturated" in caplog.text
    place = Place()
    caplog.clear()
    assert warn_saturated(torch.from_numpy(sims), [place]) == 20
    assert "place_penalty=true lets it only lower scores" in caplog.text
    caplog.clear()
    warn_saturated(sims, [place])                         # said once for this model
    assert not caplog.records


def test_a_checkpoint_validated_in_another_precision_says_how_to_match_its_dev_rsum(tmp_path, capsys, caplog):
    from sgraf.checkpoint import load_model, save_model

    model = load_model(CKPT["saf"], vocab=VOCAB)
    save_model(model, tmp_path / "best.pt", vocab=model.vocab, extra={"train_config": {"precision": "bf16"}})
    caplog.set_level("INFO", logger="sgraf.evaluate")
    evaluate_json(capsys, "--checkpoint", tmp_path / "best.pt", "--data", DATA)
    assert ("best.pt was validated in bf16 while it trained: --precision bf16 scores as its validation did"
            in caplog.text)
    caplog.clear()
    evaluate_json(capsys, "--checkpoint", tmp_path / "best.pt", "--data", DATA, "--precision", "bf16")
    assert "validated in" not in caplog.text
    assert load_model(CKPT["saf"], vocab=VOCAB).train_config is None
    # an fp16 run validated in fp32: an fp32 evaluation is its validation's
    save_model(model, tmp_path / "fp16.pt", vocab=model.vocab, extra={"train_config": {"precision": "fp16"}})
    caplog.clear()
    evaluate_json(capsys, "--checkpoint", tmp_path / "fp16.pt", "--data", DATA)
    assert "validated in" not in caplog.text


def test_python_callers_get_the_argument_named(tmp_path):
    """`evaluate_split` from a notebook: a model alone is taken as a list of one, and each other
    slip is one InputError naming the argument (they had been TypeError / AttributeError)."""
    from sgraf.data.precomp import PrecompSplit
    from sgraf.data.vocab import load_vocab
    from sgraf.errors import InputError
    from sgraf.evaluate import evaluate_split
    from sgraf.checkpoint import load_model

    model, split, vocab = load_model(CKPT["sgr"]), PrecompSplit(DATA, "test"), load_vocab(VOCAB)
    assert evaluate_split(model, split, vocab, matrix=False)[0] == evaluate_split([model], split, vocab)[0]
    for arguments, message in (((model, "test", vocab), r"^split: a PrecompSplit .*got str"),
                               ((model, split, None), r"^vocab: a Vocabulary to tokenise the captions"),
                               (([str(CKPT["sgr"])], split, vocab), r"^models\[0\]: an SGRAF network .*got str"),
                               ((str(CKPT["sgr"]), split, vocab), r"^models: a list of SGRAF networks")):
        with pytest.raises(InputError, match=message):
            evaluate_split(*arguments)
    with pytest.raises(InputError, match=r"^folds: 6 images do not split into 4 equal folds"):
        evaluate_split(model, split, vocab, folds=4, matrix=False)
    saf = load_model(CKPT["saf"])                         # an ensemble as a ModuleList, as before
    assert evaluate_split(torch.nn.ModuleList([model, saf]), split, vocab)[0] == \
        evaluate_split([model, saf], split, vocab)[0]
    with pytest.raises(InputError, match="no folds given"):
        metrics.evaluate_fold_blocks([])


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_folds_scored_alone_are_the_whole_matrixs_blocks(tmp_path, module):
    """The split encoded once, each fold's block scored alone: the whole matrix's blocks within
    rounding (another product shape sums in another order), the same recalls on data without
    near-ties; a batch smaller than a fold, so that the encoders' batches cross the folds."""
    from model_helpers import random_model

    from sgraf.data.precomp import PrecompSplit
    from sgraf.data.vocab import build_vocab
    from sgraf.evaluate import evaluate_split, score_split
    from sgraf.scoring import encode_split, score_matrix
    from train_helpers import make_toy_precomp

    data = make_toy_precomp(tmp_path / "data", n_train=8, n_dev=24, regions=5, dim=20)
    words = np.random.default_rng(5).choice([f"w{i}" for i in range(40)], size=(120, 6))
    (data / "dev_caps.txt").write_text("".join(" ".join(row) + "\n" for row in words))   # no two alike: no ties
    split = PrecompSplit(data, "dev")
    vocab = build_vocab(split.captions, min_count=1)
    model = random_model(3, vocab_size=len(vocab), module=module).eval()
    whole = score_split([model], split, vocab, batch_size=7)
    encoded = encode_split(model, split, vocab, batch_size=7)
    for k in range(4):
        images, captions = slice(6 * k, 6 * k + 6), slice(30 * k, 30 * k + 30)
        alone = score_matrix([model], [encoded.fold(images, captions)])
        assert_close(alone, whole[images, captions], REORDERED)
    folded = evaluate_split([model], split, vocab, folds=4, batch_size=7, matrix=False)[0]
    assert folded == metrics.evaluate_sims(whole, folds=4)
    assert 0 < folded["rsum"] < 600


def test_an_averaged_matrix_and_its_record_are_written_both_or_neither(capsys, tmp_path, monkeypatch):
    """`evaluate --sims A --save-sims F` moved F.npy into place before writing its record: a full
    disk then left the matrix without a record, which a later evaluation scored as any split of its
    shape."""
    import pathlib

    np.save(tmp_path / "a.npy", np.random.default_rng(0).random((6, 30), dtype=np.float32))
    written = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if ".npy.json" in self.name:
            raise OSError(28, "No space left on device", str(self))
        return written(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    assert main(["evaluate", "--sims", str(tmp_path / "a.npy"), "--save-sims", str(tmp_path / "b.npy")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]            # nothing half-written, no temporary
    monkeypatch.undo()
    assert main(["evaluate", "--sims", str(tmp_path / "a.npy"), "--save-sims", str(tmp_path / "b.npy")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy", "b.npy.json"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--split", "dev"], "--split applies with --data (a saved matrix's record names the split it scored)"),
    (["--precision", "bf16"], "--precision applies to --checkpoint, not to --sims (the matrix is scored already)"),
    (["--batch-size", "64"], "--batch-size applies to --checkpoint, not to --sims"),
    (["--tf32"], "--tf32 applies to --checkpoint, not to --sims")])
def test_options_of_scoring_given_with_a_saved_matrix_are_refused(tmp_path, capsys, extra, message):
    """Each had been ignored unsaid: `--sims test.npy --split dev` evaluated the test matrix."""
    np.save(tmp_path / "sims.npy", np.random.default_rng(0).random((4, 20), dtype=np.float32))
    assert main(["evaluate", "--sims", str(tmp_path / "sims.npy"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_matrix_given_as_a_checkpoint_and_a_checkpoint_as_a_matrix_are_named(tmp_path, capsys):
    np.save(tmp_path / "sims.npy", np.zeros((6, 30), np.float32))
    e2e = pathlib.Path(__file__).parent / "data" / "e2e"
    assert main(["evaluate", "--checkpoint", str(tmp_path / "sims.npy"), "--data",
                 str(e2e / "data" / "toy_precomp")]) == 2
    assert "(a NumPy .npy array: a score matrix? give it with --sims)" in capsys.readouterr().err
    from sgraf.checkpoint import load_model, save_model

    save_model(load_model(e2e / "sgr.pth.tar", vocab=e2e / "data" / "toy_vocab.json"), tmp_path / "best.pt")
    assert main(["evaluate", "--sims", str(tmp_path / "best.pt")]) == 2
    assert "it is a PyTorch file (a checkpoint? give it with --checkpoint)" in capsys.readouterr().err
