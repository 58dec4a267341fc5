"""Benchmark the whole `sgraf evaluate` command on a generated Flickr30K-sized test split.

Generates a precomp split (default 1,000 images x 36 regions x 2048-d, 5,000 captions whose
lengths follow Flickr30K's: about 12 words, 14 tokens with <start>/<end>, a long tail) and a
paper-size model (embed 1024, sim 256, word 300, vocabulary 8,481) with random weights. Then, in
the same run:

- `sgraf evaluate` as a subprocess, fp32 and bf16 (`--precisions tf32`: fp32 with `--tf32`):
  wall time (the whole command, imports and loading included), peak resident memory and the
  command's own breakdown of its time (`--timings`: startup, checkpoint, tokenise, encode,
  score, metrics, save);
- the authors' algorithm as they run it (see `Authors`: five copies of each image encoded, then
  shards of 100 images x 100 captions, each shard's captions scored one at a time against its
  images) on a random slice of captions, extrapolated to the split; its image shards timed in
  parts, one before sgraf's first timed run and one after each, and each run's speed-up taken
  against the parts around it (interleaved, so that a change of the machine's load hits both);
- the agreement of bf16 with fp32 (recalls, largest score difference) and of the authors'
  slice with the fp32 matrix.

With random weights the scores carry no meaning and lie close together (a spread of about
1e-2), so recalls are at chance level and bf16 rounding (about 1e-3) reorders many near-ties:
the bf16 line reports the recall difference together with the score error, which is the
figure that transfers to a trained model.

    python benchmarks/bench_eval.py                 # 1,000 x 5,000, fp32 and bf16
    python benchmarks/bench_eval.py --images 100    # a quick smaller run
    git worktree add /tmp/before HEAD~3 && python benchmarks/bench_eval.py --baseline /tmp/before --repeats 3
                                                    # this checkout against an earlier commit

Each run tokenises the captions (`--token-cache cold`, the default, as a first evaluation of a
split does); `--token-cache both` also times runs that read the ids an earlier run kept
(`sgraf.data.token_cache`), interleaved with the cold ones.

Timings depend on the machine's load: the figures printed are medians over `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# the authors' `shard_attn_scores` scores shards of 100 images x 100 captions
AUTHORS_SHARD = 100
VOCAB_WORDS = 8481 - 4  # the Flickr30K vocabulary's size, special tokens aside
CAPS_PER_IMAGE = 5
TUNING_DIR: Path | None = None   # --tuning


def caption_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Words per caption like Flickr30K's (mean ~12.3, sd ~5.3, a tail to ~80)."""
    words = np.rint(rng.gamma(shape=5.4, scale=2.3, size=n))
    return np.clip(words, 3, 78).astype(int)


def build(out: Path, n_images: int, module: str, seed: int) -> None:
    """Write `out/data/test_{ims.npy,caps.txt}` and `out/model.pt` (random paper-size weights)."""
    from sgraf.checkpoint import save_model
    from sgraf.config import ModelConfig
    from sgraf.data.vocab import Vocabulary
    from sgraf.model.sgraf import SGRAF

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    words = [f"w{k}" for k in range(VOCAB_WORDS)]
    vocab = Vocabulary.from_words(words)
    n_cap = n_images * CAPS_PER_IMAGE
    captions = [" ".join(rng.choice(words, size=length)) for length in caption_lengths(rng, n_cap)]
    config = ModelConfig(vocab_size=len(vocab), module=module)
    # Non-negative region features, like pooled CNN activations.
    images = rng.random((n_images, config.num_regions, config.img_dim), dtype=np.float32)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    np.save(data / "test_ims.npy", images)
    (data / "test_caps.txt").write_text("\n".join(captions) + "\n", encoding="utf-8")
    save_model(SGRAF(config).eval(), out / "model.pt", vocab=vocab)


def write_older_checkpoint(out: Path) -> None:
    """`out/model-v1.pt`: `out/model.pt` in checkpoint version 1 (the vocabulary as a dict), with
    only the config entries that differ from their defaults, so that a checkout from before
    version 2 or before a config key was added (`--baseline`) reads the same weights."""
    import dataclasses

    from sgraf.checkpoint import load_checkpoint
    from sgraf.config import ModelConfig

    checkpoint = load_checkpoint(out / "model.pt")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    config = {key: value for key, value in checkpoint["config"].items()
              if key not in defaults or value != defaults[key]}
    torch.save({"format": checkpoint["format"], "version": 1, "config": config,
                "state_dict": checkpoint["state_dict"], "vocab": checkpoint["vocab"], "extra": {}},
               out / "model-v1.pt")


def cache_dir(out: Path) -> Path:
    """The runs' `SGRAF_CACHE_DIR` (measured choices and kept token ids): --tuning, or in `out`."""
    return TUNING_DIR or out / "tuning"


def set_token_cache(out: Path, state: str) -> None:
    """Empty the runs' token cache (`cold`: the next run tokenises, as a first evaluation of a
    split does) or fill it (`warm`: the next run reads kept ids, as a later evaluation does)."""
    tokens = cache_dir(out) / "tokens"
    if state == "cold":
        shutil.rmtree(tokens, ignore_errors=True)
        return
    if tokens.is_dir() and any(tokens.iterdir()):
        return
    from sgraf.data.precomp import read_captions
    from sgraf.evaluate import load_ensemble
    from sgraf.scoring import tokenize_captions

    saved = os.environ.get("SGRAF_CACHE_DIR")
    os.environ["SGRAF_CACHE_DIR"] = str(cache_dir(out))
    try:
        _, vocab = load_ensemble([out / "model.pt"])
        tokenize_captions(read_captions(out / "data" / "test_caps.txt"), vocab)
    finally:
        if saved is None:
            os.environ.pop("SGRAF_CACHE_DIR")
        else:
            os.environ["SGRAF_CACHE_DIR"] = saved


def precision_options(precision: str) -> list[str]:
    """`sgraf evaluate`'s options for a benchmark precision: 'fp32', 'bf16', or 'tf32' (fp32 with
    CUDA's matmuls and cuDNN in TF32, `--tf32`)."""
    return ["--precision", "fp32", "--tf32"] if precision == "tf32" else ["--precision", precision]


def run_command(out: Path, precision: str, batch_size: int, source: str | None = None,
                device: str = "cpu", token_cache: str = "cold") -> dict:
    """`sgraf evaluate` in a fresh process: this checkout's code, or the `src` folder of `source`;
    with the token cache `cold` or `warm` (`set_token_cache`)."""
    set_token_cache(out, token_cache)
    tag = "baseline" if source else "ours"
    sims = out / f"sims_{precision}_{tag}.npy"
    report = out / f"report_{precision}_{tag}.json"
    # an earlier checkout may read checkpoint version 1 only (write_older_checkpoint)
    checkpoint = out / ("model-v1.pt" if source else "model.pt")
    argv = ["evaluate", "--checkpoint", str(checkpoint), "--data", str(out / "data"), "--split", "test",
            *precision_options(precision), "--batch-size", str(batch_size), "--json", "--quiet",
            "--save-sims", str(sims),
            "--device", device]
    if not source or (Path(source) / "src" / "sgraf" / "stopwatch.py").exists():   # added with --timings
        argv.append("--timings")
    # measured choices (sgraf.kernels.tuning) are stored in the work folder (or --tuning): the
    # first run of a fresh machine pays for the probes, like a user's first run
    env = dict(os.environ, SGRAF_CACHE_DIR=str(cache_dir(out)))
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(source) / "src"), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, str(Path(__file__).with_name("command_child.py")), str(report),
                                "--", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"sgraf evaluate failed:\n{completed.stderr[-3000:]}")
    info = json.loads(report.read_text())
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "peak_mb": info["peak_mb"], "result": result, "timings": result.pop("timings", None),
            "sims": np.load(sims)}


def print_choices(path: Path) -> None:
    """The choices the runs measured (`sgraf.kernels.tuning`), with each candidate's probe time."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, entry in sorted(stored.items()):
        seconds = ", ".join(f"{json.loads(c)} {t * 1e3:.2f} ms" for c, t in entry.get("seconds", {}).items())
        print(f"measured {key}: {entry.get('choice')!r} ({seconds})", flush=True)


def shard_groups(n_img: int, parts: int) -> list[slice]:
    """The image rows of `parts` groups of whole image shards of `AUTHORS_SHARD` (as even as the
    shards allow; fewer groups when there are fewer shards), in order, covering every image."""
    shards = list(range(0, n_img, AUTHORS_SHARD))
    groups = np.array_split(np.arange(len(shards)), max(1, min(parts, len(shards))))
    return [slice(shards[g[0]], min(shards[g[-1]] + AUTHORS_SHARD, n_img)) for g in groups]


class Authors:
    """The authors' evaluation as they run it, timed on a slice of captions and extrapolated, in
    parts between sgraf's runs.

    Their `encode_data` runs the image encoder on every (image, caption) pair of the loader, five
    copies of each image (timed here on one copy, x5), and the text encoder on batches of 128
    captions sorted by length; their `shard_attn_scores` then scores shards of 100 images x 100
    captions, each caption against the shard's images one caption at a time
    (`sgraf.model.oracle.authors_shard_scores`). Here `n_slice` random captions, gathered into
    caption shards of up to 100 as the authors' loop holds them, are scored that way against
    every image shard; the per-caption time is extrapolated to the split. (Scoring the slice one
    caption per call instead recomputed the image shards' global vectors for every caption: 3.5x
    the authors' time per caption, see benchmarks/results/calibration-*.)

    The image shards are scored in `parts` groups (`time_part`), one before sgraf's first timed
    run and one after each, so that a change of the machine's load between the runs hits both:
    each group's time, scaled to all the images, is an estimate of the slice's time at that
    moment. All the groups together are the whole slice once, the authors' work of a single
    timing.
    """

    def __init__(self, out: Path, n_slice: int, seed: int, device: str = "cpu", parts: int = 1) -> None:
        from sgraf import scoring
        from sgraf.checkpoint import load_model
        from sgraf.data.precomp import PrecompSplit

        self.device = device
        self.model = load_model(out / "model.pt").to(device)
        split = PrecompSplit(out / "data", "test")
        self.n_captions = split.n_captions
        start = time.perf_counter()
        with torch.no_grad():
            self.img_embs = scoring.encode_images(self.model, split.images, batch_size=128)
        synchronize(device)
        self.encode_s = (time.perf_counter() - start) * CAPS_PER_IMAGE
        start = time.perf_counter()
        with torch.no_grad():
            token_ids = scoring.tokenize_captions(split.captions, self.model.vocab)
            buckets = scoring.encode_captions(self.model, token_ids, batch_size=128)
        synchronize(device)
        self.encode_s += time.perf_counter() - start
        self.chosen = np.sort(np.random.default_rng(seed).choice(split.n_captions,
                                                                 size=min(n_slice, split.n_captions), replace=False))
        lookup = {int(k): (b, row) for b in buckets for row, k in enumerate(b.index.tolist())}
        # the slice as the authors' caption shards: one padded (captions, words, d) block per shard
        # of AUTHORS_SHARD captions, scored against every image shard (their image global vectors are
        # computed once per pair of shards, so a shard of fewer captions pays that more per caption)
        width = max(int(lookup[int(k)][0].lengths[lookup[int(k)][1]]) for k in self.chosen)
        self.words = self.img_embs.new_zeros(len(self.chosen), width, self.img_embs.size(2))
        self.lengths = torch.zeros(len(self.chosen), dtype=torch.long)
        for column, k in enumerate(self.chosen):
            bucket, row = lookup[int(k)]
            self.lengths[column] = bucket.lengths[row]
            self.words[column, : int(self.lengths[column])] = bucket.embs[row, : int(self.lengths[column])]
        n_img = self.img_embs.size(0)
        self.rows = shard_groups(n_img, parts)
        self.columns = np.zeros((n_img, len(self.chosen)), dtype=np.float32)
        self.part_s: list[float] = []   # seconds of each group timed so far
        release(device)

    @property
    def parts(self) -> int:
        return len(self.rows)

    def time_part(self) -> None:
        """Score the slice against the next group of image shards, if any is left, and time it."""
        from sgraf.model.oracle import authors_shard_scores

        if len(self.part_s) == self.parts:
            return
        rows = self.rows[len(self.part_s)]
        seconds = 0.0
        with torch.no_grad():
            for start in range(0, len(self.chosen), AUTHORS_SHARD):
                stop = min(start + AUTHORS_SHARD, len(self.chosen))
                tic = time.perf_counter()
                scores = authors_shard_scores(self.model, self.img_embs[rows], self.words[start:stop],
                                              self.lengths[start:stop], shard=AUTHORS_SHARD)   # (images, shard)
                synchronize(self.device)
                seconds += time.perf_counter() - tic
                self.columns[rows, start:stop] = scores.float().cpu().numpy()
        self.part_s.append(seconds)
        release(self.device)

    @property
    def estimates(self) -> list[float]:
        """Each timed group's per-caption time, scaled to all the images."""
        return [seconds * self.img_embs.size(0) / (rows.stop - rows.start) / len(self.chosen)
                for seconds, rows in zip(self.part_s, self.rows)]

    def per_caption_s(self) -> float:
        """Seconds per caption of the whole slice (every group timed once)."""
        return sum(self.part_s) / len(self.chosen)

    def extrapolated_s(self, per_caption: float | None = None) -> float:
        """The authors' time for the split: their encoding and `per_caption` (default: the whole
        slice's) for every caption."""
        return self.encode_s + (self.per_caption_s() if per_caption is None else per_caption) * self.n_captions

    def around(self, run: int) -> float:
        """The estimate of the per-caption time while sgraf's `run`-th timed run (0-based) ran: the
        mean of the groups timed just before and just after it (the nearest ones if fewer)."""
        before = min(run, len(self.estimates) - 1)
        after = min(run + 1, len(self.estimates) - 1)
        return (self.estimates[before] + self.estimates[after]) / 2


def release(device: str) -> None:
    """Hand this process's cached, unused CUDA memory back to the device, so that the `sgraf
    evaluate` processes timed between the authors' parts size their blocks from the same free
    memory as without them (the authors' encoded images stay: about 0.15 GB per 1,000 images)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that timings are true."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarise(measured: list[dict]) -> dict:
    """Median wall time, memory and stage times (`sgraf evaluate --timings`) of repeated runs,
    with the last run's results."""
    timed = [m["timings"] for m in measured if m.get("timings")]
    stages = {name: statistics.median(t.get(name, 0.0) for t in timed) for name in (timed[0] if timed else {})}
    return {"wall_s": statistics.median(m["wall_s"] for m in measured), "walls": [m["wall_s"] for m in measured],
            "peak_mb": statistics.median(m["peak_mb"] for m in measured), "stages": stages,
            "result": measured[-1]["result"], "sims": measured[-1]["sims"]}


def print_stages(label: str, summary: dict) -> None:
    """The command's own breakdown (medians of its runs): where its wall time went."""
    if summary["stages"]:
        from sgraf.stopwatch import format_timings

        print(f"{label} stages (median s; startup: Python and the command line; imports: PyTorch): "
              f"{format_timings(summary['stages'])}", flush=True)


def recalls(result: dict) -> list[float]:
    return [result[d][k] for d in ("i2t", "t2i") for k in ("r1", "r5", "r10")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1000, help="images (x5 captions); Flickr30K test: 1000")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "tf32"],
                        help="tf32: fp32 with CUDA's matmuls in TF32 (sgraf evaluate --tf32)")
    parser.add_argument("--module", default="sgr", choices=["sgr", "saf"])
    parser.add_argument("--authors-captions", type=int, default=AUTHORS_SHARD,
                        help="captions timed with the authors' loop (extrapolated to the split); below "
                             f"{AUTHORS_SHARD}, one caption shard this small overstates their time per caption")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs per precision (median reported)")
    parser.add_argument("--probed", action="store_true",
                        help="first run each precision once untimed, so that the timed runs find the device's "
                             "measured choices stored (the probes, and the fused kernel's compilation, of a "
                             "first evaluation on a machine are then left out)")
    parser.add_argument("--tuning", metavar="DIR", help="keep the measured choices in DIR (default: the work "
                        "directory), e.g. shared by a Flickr30K-size run and an MSCOCO-size one after it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also time the command with another checkout's code (its src/ first on PYTHONPATH), "
                             "runs interleaved with ours, e.g. a `git worktree` of an earlier commit")
    parser.add_argument("--token-cache", choices=["cold", "warm", "both"], default="cold",
                        help="each run tokenises the captions (cold, as a first evaluation of a split), reads "
                             "the ids an earlier run kept (warm), or both, interleaved")
    parser.add_argument("--no-authors", action="store_true", help="skip the authors' algorithm")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the command and the authors' loop run")
    parser.add_argument("--out", help="work directory (default: a temporary one, removed after)")
    args = parser.parse_args()
    global TUNING_DIR
    TUNING_DIR = Path(args.tuning) if args.tuning else None

    from sgraf.kernels.tuning import cpu_model

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out or scratch)
        start = time.perf_counter()
        build(out, args.images, args.module, args.seed)
        if args.baseline:
            write_older_checkpoint(out)
        print(f"generated {args.images} images x {args.images * CAPS_PER_IMAGE} captions, paper-size "
              f"{args.module.upper()} model, in {time.perf_counter() - start:.0f} s; "
              f"{torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else cpu_model()}, "
              f"torch threads "
              f"{torch.get_num_threads()}, cpus {os.cpu_count()}", flush=True)
        runs, order = {}, []    # order: (precision, wall seconds) of the timed runs, as they ran
        states = ["cold", "warm"] if args.token_cache == "both" else [args.token_cache]
        reference = None
        if not args.no_authors:   # its encoding now, its slice in parts around sgraf's timed runs
            reference = Authors(out, args.authors_captions, args.seed, args.device,
                                parts=len(args.precisions) * args.repeats + 1)
        for precision in args.precisions:
            measured, baseline, warm = [], [], []
            if args.probed:
                first = run_command(out, precision, args.batch_size, device=args.device, token_cache=states[0])
                print(f"{precision}: an untimed first run ({first['wall_s']:.1f} s) stored the measured choices",
                      flush=True)
            for _ in range(args.repeats):     # interleaved, so that a change of load hits both
                if reference is not None and not order:
                    reference.time_part()
                measured.append(run_command(out, precision, args.batch_size, device=args.device,
                                            token_cache=states[0]))
                order.append((precision, measured[-1]["wall_s"]))
                if reference is not None:
                    reference.time_part()
                if args.baseline:
                    baseline.append(run_command(out, precision, args.batch_size, args.baseline, args.device,
                                                token_cache=states[0]))
                if len(states) > 1:
                    warm.append(run_command(out, precision, args.batch_size, device=args.device, token_cache="warm"))
            runs[precision] = summarise(measured)
            run = runs[precision]
            print(f"{precision}: runs {', '.join(f'{m:.1f}' for m in run['walls'])} s; median {run['wall_s']:.1f} s, "
                  f"peak RSS {run['peak_mb']:.0f} MiB, rsum {run['result']['rsum']:.1f}, "
                  f"recalls {[round(r, 1) for r in recalls(run['result'])]}; token cache {states[0]}", flush=True)
            print_stages(f"{precision}, token cache {states[0]},", run)
            if warm:
                kept = summarise(warm)
                print(f"{precision}, token cache warm (the captions' ids kept from an earlier run): runs "
                      f"{', '.join(f'{m:.1f}' for m in kept['walls'])} s; median {kept['wall_s']:.1f} s -> "
                      f"{run['wall_s'] / kept['wall_s']:.2f}x the cold run's speed; same matrix: "
                      f"{bool(np.array_equal(kept['sims'], run['sims']))}", flush=True)
                print_stages(f"{precision}, token cache warm,", kept)
            if baseline:
                base = summarise(baseline)
                error = np.abs(base["sims"] - run["sims"]).max()
                print(f"{precision} baseline ({args.baseline}): runs {', '.join(f'{m:.1f}' for m in base['walls'])} s; "
                      f"median {base['wall_s']:.1f} s, peak RSS {base['peak_mb']:.0f} MiB -> ours "
                      f"{base['wall_s'] / run['wall_s']:.2f}x its speed; max |diff| of the matrices {error:.2e}",
                      flush=True)
                print_stages(f"{precision} baseline, token cache {states[0]},", base)
        print_choices(cache_dir(out) / "tuning.json")
        if reference is None:
            return 0
        while len(reference.part_s) < reference.parts:   # a group left (no timed run to follow)
            reference.time_part()
        print(f"authors' algorithm (shards of 100 images x {min(args.authors_captions, AUTHORS_SHARD)} captions, "
              f"one caption at a time): {reference.per_caption_s():.3f} s "
              f"per caption over {len(reference.chosen)} captions + encoding {reference.encode_s:.1f} s "
              f"-> extrapolated {reference.extrapolated_s():.0f} s for the split; timed in {reference.parts} "
              f"part(s) around sgraf's runs, each scaled to the split: "
              f"{', '.join(f'{reference.extrapolated_s(e):.0f}' for e in reference.estimates)} s", flush=True)
        for precision in runs:
            ratios = [reference.extrapolated_s(reference.around(k)) / wall
                      for k, (timed, wall) in enumerate(order) if timed == precision]
            print(f"speed-up vs the authors' algorithm ({precision}): {statistics.median(ratios):.1f}x "
                  f"(each run against the authors' parts just before and after it: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)})")
        first = runs[args.precisions[0]]
        error = np.abs(first["sims"][:, reference.chosen] - reference.columns).max()
        print(f"authors' slice vs {args.precisions[0]} matrix: max |diff| {error:.2e}")
        for low in ("bf16", "tf32"):
            if "fp32" not in runs or low not in runs:
                continue
            difference = np.abs(np.subtract(recalls(runs[low]["result"]), recalls(runs["fp32"]["result"])))
            score_error = np.abs(runs[low]["sims"] - runs["fp32"]["sims"]).max()
            spread = float(runs["fp32"]["sims"].std())
            print(f"{low} vs fp32: largest recall difference {difference.max():.2f} (target <= 0.1), "
                  f"largest score difference {score_error:.2e} (fp32 scores: std {spread:.2e})")
            same, queries, far = top1_agreement(runs["fp32"]["sims"], runs[low]["sims"], 2 * score_error)
            print(f"{low} vs fp32 top-1: the same for {same} of {queries} queries (both directions); "
                  f"changed outside near-ties (fp32 margin above twice the largest {low} error): {far}")
    return 0


def top1_agreement(fp32: np.ndarray, bf16: np.ndarray, tie: float) -> tuple[int, int, int]:
    """(queries whose top-1 is the same, queries, changed ones whose fp32 scores of the two
    candidates differ by at least `tie`), over images (rows) and captions (columns)."""
    same = queries = far = 0
    for axis in (0, 1):
        best, chosen = fp32.argmax(axis), bf16.argmax(axis)
        margin = fp32.max(axis) - np.take_along_axis(fp32, np.expand_dims(chosen, axis), axis).squeeze(axis)
        same += int((best == chosen).sum())
        queries += best.size
        far += int(((best != chosen) & (margin >= tie)).sum())
    return same, queries, far


if __name__ == "__main__":
    sys.exit(main())
