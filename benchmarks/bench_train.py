"""Seconds per training step and peak memory at the paper's size: ours vs the authors' algorithm.

One optimisation step = train-mode scores of a batch of 128 pairs, the hinge loss with hardest
negatives, backward, clipping at 2.0, Adam (2048-d features of 36 regions, embed 1024, sim 256,
word 300, vocabulary 8,500, caption lengths like Flickr30K's). "authors" is the authors'
algorithm as they run it (`sgraf.model.oracle.authors_forward`): both encoders once over the
batch (the GRU on packed sequences), then each caption scored against all images on its own,
in float32; "ours" is `sgraf.training.train_step` (vectorised over captions,
scored in length-sorted caption chunks whose intermediates are recomputed in backward;
`--chunk N` fixes the captions per chunk, `--no-checkpoint` keeps every chunk's intermediates;
for SGR the backward pass runs through the pairs the loss reads, `sgraf.training.pairs`, and
`--matrix` adds "matrix", ours with the backward through the whole score matrix).
Dropout is off so both compute the same first loss (printed: a correctness check).

The times come from one process per configuration (started together), the processes taking one
step each in turn per round (A/B interleaved, so that a change of the machine's load hits all of
them, and neither's memory or allocator settings reach the other): medians over --steps rounds
after one warm-up step each, and each round's ratio. The peak memory of each configuration
comes from a fresh process of its own running two steps (ru_maxrss: the interpreter, torch, the
model, Adam's moments and the step), so it is clean.
The authors' stand-in was calibrated against their own `train_emb` in the same process
(benchmarks/results/calibration-*; on another machine: benchmarks/calibrate_authors.py).
`train_step` on the CPU sets glibc to keep freed memory for its whole process
(`sgraf.kernels.memory`); the authors' stand-in, in a process of its own, runs with glibc's
defaults, as their code does.

    python benchmarks/bench_train.py                     # SGR and SAF, authors fp32 vs ours fp32/bf16
    python benchmarks/bench_train.py --batch 32 --steps 2   # quicker
    python benchmarks/bench_train.py --batch 6 --steps 1 --scale 16 --no-memory   # a check that it runs

`--against DIR` adds "before": `train_step` of another checkout of the project (DIR/src, for
example `git worktree add /tmp/base <commit>`), stepping in turn with the others, so that a
change is timed against the code before it in one run (the ratio per round is printed).
`--compiled` adds "compiled": ours under `SGRAF_COMPILE=train` (`sgraf.kernels.compiled`: SGR's
selected pairs compiled, SAF taking no pairs' backward; in bf16 also the word nodes' elementwise
passes fused, SGR and SAF); its steps against ours per round. "ours" is the default setting
(`SGRAF_COMPILE=auto`: on the CPU in bf16 the word nodes' passes fused, compiled in the first
step); `--eager` adds "eager", ours with nothing compiled, and its steps against ours per round.
Every row prints its warm-up step (the untimed first step: where the compilations happen).
`--theirs DIR` adds "theirs": the authors' own `train_emb`, imported from a checkout of their
repository in DIR (`authors_code.py`: their model.py with its loss's mask on the scores' device,
our weights loaded), in a process of its own as they run it (glibc's allocator
defaults: `calibrate_authors.py` steps it in the process where `train_step` has set glibc to
keep freed memory, which speeds their step too), and prints every row's ratio against it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def add_step_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """--rounds, --batch, --threads and --scale, as the in-process harnesses beside this one take
    them (`ab_train_method.py`, `calibrate_authors.py`)."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="feature sizes divided by this (a quick check)")


def setup(module: str, batch_size: int, threads: int, device: str = "cpu", scale: int = 1):
    """The paper-size model (dropout off; its feature sizes divided by `scale`, `launch_counts`'s
    model) and one Flickr30K-like batch, the same for every run."""
    import torch
    from types import SimpleNamespace

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from launch_counts import caption_lengths, scaled_model

    torch.set_num_threads(threads)
    model = scaled_model(module, scale).to(device)
    gen = torch.Generator().manual_seed(1)
    lengths = caption_lengths(batch_size, seed=1)
    vocab, regions, img_dim = model.config.vocab_size, model.config.num_regions, model.config.img_dim
    captions = torch.randint(4, vocab, (batch_size, int(lengths.max())), generator=gen)
    for i, n in enumerate(lengths.tolist()):
        captions[i, n:] = 0
        captions[i, 0], captions[i, n - 1] = 1, 2
    batch = SimpleNamespace(images=torch.randn(batch_size, regions, img_dim, generator=gen).to(device),
                            captions=captions.to(device), lengths=lengths, image_ids=torch.arange(batch_size))
    return model, batch


def make_step(model, batch, module: str, impl: str, precision: str, chunk: int | None = None,
              checkpoint: bool = True, device: str = "cpu", theirs: str | None = None):
    """A function running one optimisation step of `impl` ('authors', 'ours', or 'theirs': the
    authors' own code from the checkout `theirs`) on its own copy of the model and its own Adam;
    returns the loss."""
    import torch

    if impl == "theirs":
        from authors_code import authors_module, authors_step

        return authors_step(authors_module(Path(theirs)), model, batch, module)

    from sgraf.model.blocks import copied
    from sgraf.model.oracle import authors_forward
    from sgraf.precision import autocast
    from sgraf.training.config import preset
    from sgraf.training.step import batch_loss, build_optimizer, train_step

    model = copied(model)
    model.train_chunk, model.train_checkpoint = chunk, checkpoint
    config = preset(f"f30k-{module}").replace(precision=precision, pair_backward=impl != "matrix")
    optimizer = build_optimizer(model, config)

    def authors_step() -> float:
        # The authors' train_emb: encoders on the batch, per-caption similarity, loss, backward,
        # clip, Adam step.
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision, device):
            scores = authors_forward(model, batch.images, batch.captions, batch.lengths)[module]
        loss = batch_loss(scores, config)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        return loss.item()

    def ours_step() -> float:
        return train_step(model, optimizer, batch, config, device=device).loss

    return authors_step if impl == "authors" else ours_step


def stepper(module: str, impl: str, precision: str, batch_size: int, threads: int, chunk: int | None = None,
            checkpoint: bool = True, device: str = "cpu", scale: int = 1, theirs: str | None = None) -> None:
    """A child process holding one configuration: after 'ready', one timed step per 'step' line
    read from stdin, each answered with a JSON line {"seconds", "loss"}."""
    import torch

    model, batch = setup(module, batch_size, threads, device, scale)
    step = make_step(model, batch, module, impl, precision, chunk, checkpoint, device, theirs)
    del model
    cuda = torch.device(device).type == "cuda"
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        if cuda:
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        print(json.dumps({"seconds": time.perf_counter() - tic, "loss": loss}), flush=True)


def child_command(impl: str, against: str | None) -> tuple[str, dict[str, str] | None]:
    """The implementation a child runs and its environment: "before" is "ours" with the `sgraf`
    package of the checkout `against` (its src/ first on the path); "compiled" is "ours" with its
    pairs compiled; "eager" is "ours" with nothing compiled (not even the bf16 word nodes' passes
    that the default fuses on the CPU)."""
    if impl in ("compiled", "eager"):
        return "ours", {**os.environ, "SGRAF_COMPILE": "train" if impl == "compiled" else "off"}
    if impl != "before":
        return impl, None
    # the caller's path after it, if any (an empty entry would put the working folder on the path)
    path = os.pathsep.join(filter(None, [os.path.join(against, "src"), os.environ.get("PYTHONPATH")]))
    return "ours", {**os.environ, "PYTHONPATH": path}


def timing(module: str, runs: list[tuple[str, str]], common: list[str], steps: int, batch_size: int,
           threads: int, device: str, against: str | None = None) -> list[dict]:
    """Seconds per step of every (impl, precision) in `runs`, each in a process of its own (so
    that one's memory and allocator settings do not reach the other), the processes stepping in
    turn: one warm-up step each, then `steps` rounds of one step of each (so that a change of the
    machine's load hits all of them); medians and every round's time.
    `common` holds the children's arguments (the batch size, threads and device given here too)."""
    children = []
    try:
        for impl, precision in runs:
            impl, env = child_command(impl, against)
            child = subprocess.Popen([sys.executable, __file__, *common, "--child", "stepper", module, impl, precision],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
            children.append(child)
        for child in children:   # started together, each answers once it is set up
            _answer(child, "ready")
        times: list[list[float]] = [[] for _ in runs]
        losses: list[list[float]] = [[] for _ in runs]
        warmups = [0.0 for _ in runs]
        for k in range(steps + 1):
            for index, child in enumerate(children):
                child.stdin.write("step\n")
                child.stdin.flush()
                answer = json.loads(_answer(child))
                losses[index].append(answer["loss"])
                if k:
                    times[index].append(answer["seconds"])
                else:
                    warmups[index] = answer["seconds"]
    finally:
        for child in children:   # 'quit' by closing stdin, all at once; a child that hangs is killed
            if child.poll() is None:
                child.stdin.close()
        for child in children:
            if child.poll() is None:
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
    return [{"module": module, "impl": impl, "precision": precision, "seconds_per_step": statistics.median(t),
             "times": t, "first_loss": loss[0],
             "warmup_seconds": warmup, "threads": threads, "batch_size": batch_size, "device": device}
            for (impl, precision), t, loss, warmup in zip(runs, times, losses, warmups)]


def _answer(child: subprocess.Popen, expected: str | None = None) -> str:
    """The child's next line (`expected` when given); its last error line if it died."""
    line = child.stdout.readline().strip()
    if not line or (expected is not None and line != expected):
        child.kill()
        error = child.stderr.read().strip().splitlines()
        raise RuntimeError(error[-1] if error else f"the child stopped with {child.wait()}")
    return line


def memory(module: str, impl: str, precision: str, batch_size: int, threads: int, chunk: int | None = None,
           checkpoint: bool = True, device: str = "cpu", scale: int = 1, theirs: str | None = None) -> dict:
    """Peak memory of two steps of one configuration, alone in this (fresh) process: the
    interpreter, torch, the model, Adam's moments and the step (ru_maxrss; on a GPU its
    allocator's peak)."""
    import torch

    model, batch = setup(module, batch_size, threads, device, scale)
    step = make_step(model, batch, module, impl, precision, chunk, checkpoint, device, theirs)
    del model
    for _ in range(2):
        step()
    cuda = torch.device(device).type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"module": module, "impl": impl, "precision": precision, "peak_gib": peak}


def float32_routes(threads: int) -> str:
    """The float32 matmul routes sgraf's steps took (`sgraf.kernels.cpu`: forced, or the choices
    the stepping processes measured and stored for `threads` threads): they move a step by 5-10 %."""
    import torch

    from sgraf.kernels import cpu, tuning

    forced = os.environ.get("SGRAF_CPU_MATMUL", "").strip()
    if forced or not cpu.ONEDNN:   # no probe then: the route is the one forced, or the only one
        return f"{cpu.float32_route()} ({f'SGRAF_CPU_MATMUL={forced}' if forced else 'no oneDNN route here'})"
    torch.set_num_threads(threads)
    tuning.forget()
    return (f"matmuls {cpu.stored_route('matmul')}, weight gradients {cpu.stored_route('weight gradient')} "
            "(aten: PyTorch's, MKL)")


def speed_against(slow: dict, fast: dict) -> tuple[float, list[float]]:
    """How much faster `fast` ran than `slow`: the ratio of their medians, and of each round's times
    (the configurations step in turn, so a round holds one step of each)."""
    return slow["seconds_per_step"] / fast["seconds_per_step"], [s / f for s, f in zip(slow["times"], fast["times"])]


def torch_device_name(device: str) -> str:
    """The processor or GPU the benchmark runs on, for the printed figures."""
    import torch

    from sgraf.kernels.tuning import cpu_model

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"], choices=["sgr", "saf"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="ours (the authors' algorithm runs in fp32)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (after one warm-up step each)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-authors", action="store_true", help="skip the slow reference (the authors' algorithm)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--chunk", type=int, help="ours: captions per chunk (default: from a memory budget)")
    parser.add_argument("--no-checkpoint", action="store_true", help="ours: keep every chunk's intermediates")
    parser.add_argument("--matrix", action="store_true",
                        help="also ours with the backward through the whole score matrix (pair_backward=false)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (peak memory: the GPU allocator's there)")
    parser.add_argument("--scale", type=int, default=1,
                        help="the model's feature sizes divided by this (a quick check that every row runs)")
    parser.add_argument("--against", metavar="DIR",
                        help="also \"before\": train_step of the project checked out in DIR (its src/)")
    parser.add_argument("--compiled", action="store_true",
                        help="add ours under SGRAF_COMPILE=train (SGR's selected pairs; bf16's fused word nodes)")
    parser.add_argument("--eager", action="store_true",
                        help="add ours under SGRAF_COMPILE=off (bf16 without the word nodes' fused passes)")
    parser.add_argument("--theirs", metavar="DIR",
                        help="also \"theirs\": the authors' own train_emb from a checkout of Paranioar/SGRAF "
                             "(python3.6) in DIR, in a process of its own (CPU)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = (args.chunk, not args.no_checkpoint, args.device, args.scale, args.theirs)
    if args.child:
        kind, module, *rest = args.child
        if kind == "stepper":
            stepper(module, *rest, args.batch, args.threads, *options)
        else:
            print(json.dumps(memory(module, *rest, args.batch, args.threads, *options)))
        return

    import torch

    from sgraf.kernels.cpu import onednn_runs

    runs = ([("theirs", "fp32")] if args.theirs else []) \
        + ([] if args.no_authors else [("authors", "fp32")]) + [("ours", p) for p in args.precisions] \
        + ([("matrix", p) for p in args.precisions] if args.matrix else []) \
        + ([("before", p) for p in args.precisions] if args.against else []) \
        + ([("compiled", p) for p in args.precisions] if args.compiled else []) \
        + ([("eager", p) for p in args.precisions] if args.eager else [])
    if args.against and not os.path.isdir(os.path.join(args.against, "src", "sgraf")):
        parser.error(f"--against {args.against}: no src/sgraf there (a checkout of the project is expected)")
    if args.theirs:
        if args.device != "cpu":
            parser.error("--theirs runs the authors' code on the CPU only")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from authors_code import authors_module

        authors_module(Path(args.theirs))   # a folder that is no checkout of theirs: refused now, in one line
    where = torch_device_name(args.device)
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads),
              "--device", args.device, "--scale", str(args.scale)] \
        + (["--chunk", str(args.chunk)] if args.chunk else []) \
        + (["--no-checkpoint"] if args.no_checkpoint else []) \
        + (["--theirs", args.theirs] if args.theirs else [])
    size = "the paper's sizes" if args.scale == 1 else f"feature sizes / {args.scale}"
    print(f"{where}: {size}, batch {args.batch}, {args.steps} timed rounds, {args.threads} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + ("" if args.device != "cpu" else f"; bf16 matmuls in oneDNN on this CPU: {onednn_runs(torch.bfloat16)}"))
    print("the authors' algorithm: sgraf.model.oracle.authors_forward, their loop and memory layouts, "
          "calibrated against their own train_emb (benchmarks/results/calibration-*)")
    results = []
    for module in args.modules:
        # a process per configuration, stepping in turn; each memory figure has a fresh process
        try:
            timed = timing(module, runs, common, args.steps, args.batch, args.threads, args.device, args.against)
        except RuntimeError as error:
            print(f"{module}: FAILED: {error}")
            continue
        for r in timed:
            r["peak_gib"] = float("nan")
            if not args.no_memory:
                impl, env = child_command(r["impl"], args.against)
                proc = subprocess.run([sys.executable, __file__, *common, "--child", "memory", module, impl,
                                       r["precision"]], capture_output=True, text=True, env=env)
                if proc.returncode != 0:   # say so: a nan figure alone hides the cause
                    print(f"{module} {r['impl']} {r['precision']} memory: FAILED: {proc.stderr.strip().splitlines()[-1]}")
                else:
                    r["peak_gib"] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_gib"]
            results.append(r)
            print(f"{module:<4} {r['impl']:<7} {r['precision']:<5} {r['seconds_per_step']:8.3g} s/step "
                  f"(rounds {', '.join(f'{t:.3g}' for t in r['times'])}), peak {r['peak_gib']:.2f} GiB, "
                  f"first loss {r['first_loss']:.4f}; warm-up step {r['warmup_seconds']:.3g} s", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.device == "cpu":
        print(f"sgraf's CPU float32 routes in these steps: {float32_routes(args.threads)}")
    for module in args.modules:
        ref = next((r for r in results if r["module"] == module and r["impl"] == "authors"), None)
        if ref is None:
            continue
        for r in results:
            if r["module"] == module and r["impl"] not in ("authors", "theirs"):
                ratio, rounds = speed_against(ref, r)
                peak = "" if args.no_memory else f"{r['peak_gib'] / ref['peak_gib']:.2f}x the authors' peak memory "
                print(f"{module} {r['impl']} {r['precision']}: {ratio:.2f}x faster "
                      f"(ratio of the medians; per round {', '.join(f'{x:.2f}' for x in rounds)}), {peak}"
                      f"(first loss {r['first_loss']:.4f} vs {ref['first_loss']:.4f})")
    for module in args.modules:   # every row against the authors' own code
        own = next((r for r in results if r["module"] == module and r["impl"] == "theirs"), None)
        for r in results if own is not None else []:
            if r["module"] == module and r is not own:
                ratio, rounds = speed_against(own, r)
                what = "the stand-in" if r["impl"] == "authors" else f"{r['impl']} {r['precision']}"
                print(f"{module} {what} against their own train_emb: {ratio:.2f}x faster (ratio of the medians; per "
                      f"round {', '.join(f'{x:.2f}' for x in rounds)}; first loss {r['first_loss']:.4f} vs "
                      f"{own['first_loss']:.4f})")
    for r in results:
        ours = next((o for o in results if o["module"] == r["module"] and o["impl"] == "ours"
                     and o["precision"] == r["precision"]), None)
        if r["impl"] not in ("before", "compiled", "eager") or ours is None:
            continue
        if r["impl"] == "before":   # ours against the code before it
            slow, fast, name = r, ours, f"ours {r['precision']} against before ({args.against})"
        elif r["impl"] == "eager":  # the default against nothing compiled
            slow, fast, name = r, ours, f"ours {r['precision']} against eager"
        else:                       # the compiled pairs against ours
            slow, fast, name = ours, r, f"compiled {r['precision']} against ours"
        ratio, rounds = speed_against(slow, fast)
        print(f"{r['module']} {name}: {ratio:.3f}x faster (ratio of "
              f"the medians; per round {', '.join(f'{x:.3f}' for x in rounds)})"
              + (f"; its warm-up step (the compilations) {r['warmup_seconds']:.1f} s, ours "
                 f"{ours['warmup_seconds']:.1f} s" if r["impl"] == "compiled" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
