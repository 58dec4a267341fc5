"""`sgraf evaluate --folds K`: each fold's block scored alone, against the whole matrix scored.

MSCOCO 1K is `testall` in 5 folds. `sgraf evaluate --folds 5` encodes the split once and scores
each fold's images against its own captions only; with `--save-sims` it scores the whole matrix
(which it keeps), the work of every fold before this change. This writes a split of `--images`
random images (36 regions) with five captions each from a small vocabulary, a random tiny SGR
model, and runs both whole commands in fresh processes, in turns; it prints the medians, their
ratio and whether the two give the same metrics (they can differ only where scores tie within
rounding, which random captions do not).

    python benchmarks/bench_folds.py                        # 500 images, 5 folds, 3 rounds
    python benchmarks/bench_folds.py --images 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
WORDS = [f"w{i}" for i in range(60)]


def write_split(folder: Path, n_images: int, dim: int) -> Path:
    """A `test` split of random features and random captions, and a tiny SGR checkpoint for it."""
    sys.path.insert(0, str(SRC))
    import torch

    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    np.save(folder / "test_ims.npy", rng.standard_normal((n_images, 36, dim)).astype(np.float32))
    captions = [" ".join(rng.choice(WORDS, size=rng.integers(6, 14))) for _ in range(5 * n_images)]
    (folder / "test_caps.txt").write_text("".join(caption + "\n" for caption in captions))
    vocab = Vocabulary.from_words(WORDS)
    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=len(vocab), img_dim=dim, word_dim=32, embed_size=64, sim_dim=32,
                              num_regions=36, sgr_step=2))
    save_model(model, folder / "sgr.pt", vocab=vocab)
    return folder / "sgr.pt"


def run(checkpoint: Path, data: Path, folds: int, save: Path | None) -> tuple[float, dict]:
    """One whole `sgraf evaluate --folds K` (with `--save-sims` when `save`): wall seconds, metrics."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "sgraf", "evaluate", "--checkpoint", str(checkpoint), "--data", str(data),
            "--split", "test", "--folds", str(folds), "--device", "cpu", "--json", "--quiet"]
    if save is not None:
        argv += ["--save-sims", str(save)]
    start = time.perf_counter()
    completed = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed:\n{completed.stderr[-3000:]}")
    if save is not None:
        for path in (save, Path(f"{save}.json")):
            path.unlink()
    return wall, json.loads(completed.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=128, help="feature size of each region")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data"
        checkpoint = write_split(data, args.images, args.dim)
        folded, whole, results = [], [], []
        for _ in range(args.repeats):        # in turns, so that a change of load meets both
            seconds, result = run(checkpoint, data, args.folds, None)
            folded.append(seconds)
            results.append(result)
            seconds, result = run(checkpoint, data, args.folds, Path(work) / "whole.npy")
            whole.append(seconds)
            results.append(result)
    same = all(result == results[0] for result in results)
    print(f"{args.images} images x {5 * args.images} captions, {args.folds} folds, {args.repeats} rounds")
    print(f"folds scored alone: {statistics.median(folded):.2f} s (median; {', '.join(f'{s:.2f}' for s in folded)})")
    print(f"whole matrix (--save-sims): {statistics.median(whole):.2f} s "
          f"(median; {', '.join(f'{s:.2f}' for s in whole)})")
    print(f"folds alone: {statistics.median(whole) / statistics.median(folded):.2f}x the whole matrix's speed; "
          f"same metrics: {same}")


if __name__ == "__main__":
    main()
