"""The GPU benchmark runs end to end (its --smoke sizes, on the CPU here): every row, no failure."""

from __future__ import annotations

import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_bench_gpu_smoke_runs_every_row_beside_the_authors(tmp_path):
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "bench_gpu.py"), "--smoke", "--device", "cpu"],
                               capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    out = completed.stdout
    assert out.count("=== ") == 5
    assert out.count("speed-up vs the authors' algorithm (bf16)") == 2          # both evaluate rows
    assert out.count("speed-up vs the authors' algorithm (fp32)") == 2
    assert "sgr ours fp32:" in out and "saf ours bf16:" in out                   # train rows vs the authors
    assert "SGRAF.score" in out and "x" in out.split("SGRAF.score", 1)[1]
    assert "train step, batch 16, sgr fp32:" in out and "scoring block 8 x 32, sgr fp32:" in out   # launches
    assert "bf16 vs fp32 top-1: the same for" in out
