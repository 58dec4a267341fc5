"""Every figure of the GPU table in one run, each beside the authors' algorithm on the same device.

The rows (issue 11), each printed by the benchmark that owns it, run here one after another:

1. an MSCOCO-5K-size `sgraf evaluate` (5,000 images x 25,000 captions), SGR, bf16 and fp32, the
   whole command, against the authors' evaluation loop on the same device (`bench_eval.py`,
   extrapolated from a slice of captions);
2. a Flickr30K-size one (1,000 x 5,000), the same way;
3. a training step at batch 128, SGR and SAF, fp32 and bf16: seconds and peak memory (the GPU
   allocator's) against the authors' step (`bench_train.py`);
4. `SGRAF.score` on an 80 x 160 block of raw inputs in fp32 against the authors' algorithm, on
   the CPU (`bench_score.py`);
5. kernel launches under the GPU plan, counted on the CPU (`launch_counts.py`, any machine): per
   training step at batch 128 and per scoring block (256 images x 128 and x 1,024 captions),
   SGR and SAF, fp32 and bf16, and the reads of device values inside them.

The evaluate rows also print the bf16 against fp32 agreement: recalls, the largest score
difference, and the queries whose top-1 changed outside near-ties.

    python benchmarks/bench_gpu.py                  # on CUDA when there is one (else the CPU: hours)
    python benchmarks/bench_gpu.py --smoke          # tiny sizes on any device: checks that it runs

The smoke run is what CI runs (tests/test_benchmarks.py): every row but the MSCOCO-size one (the
Flickr30K-size row's command with more images), its training row with the model's feature sizes
/ 16 and SGR in fp32 alone; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def rows(device: str, smoke: bool) -> list[tuple[str, list[str]]]:
    """(title, command) of each row."""
    if smoke:
        f30k, batch, steps, call, captions, launch_batch = 6, 6, 1, 6, 12, 16
    else:
        f30k, batch, steps, call, captions, launch_batch = 1000, 128, 5, 80, 160, 128
    # tf32: fp32 with CUDA's matmuls in TF32 (`sgraf evaluate --tf32`), beside the exact fp32 target
    evaluate = [sys.executable, str(HERE / "bench_eval.py"), "--device", device, "--precisions", "bf16", "fp32",
                "tf32", "--authors-captions", "1" if smoke else "100"]
    # the smoke run takes the Flickr30K-size row alone: the MSCOCO-size row is its command with more images
    evaluate_rows = [] if smoke else [("MSCOCO-5K-size evaluate (5000 images), SGR", [*evaluate, "--images", "5000"])]
    evaluate_rows.append((f"Flickr30K-size evaluate ({f30k} images), SGR", [*evaluate, "--images", str(f30k)]))
    return evaluate_rows + [
        (f"train step, batch {batch}, SGR and SAF", [sys.executable, str(HERE / "bench_train.py"), "--device", device,
                                                     "--batch", str(batch), "--steps", str(steps)]
         # the smoke run: SGR in fp32 beside the authors (tests/test_benchmarks.py runs bench_train.py whole)
         + (["--no-memory", "--scale", "16", "--modules", "sgr", "--precisions", "fp32"] if smoke else [])),
        (f"CPU: SGRAF.score on {call} x {captions} raw inputs, fp32",
         [sys.executable, str(HERE / "bench_score.py"), "--modules", "sgr", "--call-images", str(call),
          "--call-captions", str(captions), "--images", "0", "--repeats", "1" if smoke else "3"]),
        (f"kernel launches under the GPU plan, counted on the CPU (train step at batch {launch_batch}, "
         "scoring blocks)", [sys.executable, str(HERE / "launch_counts.py"), "--batch", str(launch_batch)]
         + (["--modules", "sgr", "--precisions", "fp32", "--scale", "256", "--images", "8", "--captions", "8", "32"]
            if smoke else [])),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that every row runs")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    failed = []
    for title, command in rows(device, args.smoke):
        print(f"\n=== {title} on {device}\n$ {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        completed = subprocess.run(command, text=True, capture_output=True)
        print(completed.stdout.rstrip())
        if completed.returncode != 0:
            print(completed.stderr[-3000:].rstrip())
            failed.append(title)
        print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
