"""On a CUDA device: the kernels a training step and a scoring block really launch, beside the count
that `launch_counts.py` makes on a CPU (issue 20: does the CPU's count match a profiler's?).

For SGR and SAF, fp32 and bf16, a paper-size model with random weights:

- a training step at batch 128 (after two warm-up steps): the ATen operations `LaunchCounter`
  counts and the host reads it sees, the CUDA kernels and copies `torch.profiler` records, the
  step's median seconds over `--steps` steps (synchronised) and the allocator's peak memory;
- a scoring block of 256 images x 128 and x 1,024 captions of one length bucket (the middle of 8,
  as `sgraf evaluate` sorts a split's captions by length): the same counts, and its GPU time by
  place in sgraf's code (the function and the operation it called); for SGR once per
  edge route (`sgraf.kernels.edges`: two batched matmuls and a softmax, or PyTorch's fused
  attention), and for both modules once more with the word nodes from one Triton kernel
  (`sgraf.kernels.words`, where it can run), and for SGR once more with its reasoning steps in
  one kernel too (`sgraf.kernels.graph_steps`), for both once more with the attention in one
  kernel as well (`sgraf.kernels.attention`), and for SAF once more with its filtration in one
  kernel too (`sgraf.kernels.filtration`): routes `sgraf evaluate` chooses between by probes on
  the device.

    python benchmarks/gpu_profile.py                    # needs CUDA
    python benchmarks/gpu_profile.py --modules sgr --precisions bf16 --steps 3
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from launch_counts import batch_of, scaled_model
from sgraf.kernels import edges, words
from sgraf.kernels.launches import LaunchCounter
from sgraf.model import blocks
from sgraf.training.config import preset
from sgraf.training.step import build_optimizer, train_step


# length buckets a scoring block's captions are drawn from (its bucket is the middle one)
BUCKETS = 8


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernels(work, device: torch.device) -> tuple[int, int, float, str]:
    """(kernels, copies and fills, GPU busy milliseconds, the kernels that took the most time) of `work()`."""
    if device.type != "cuda":   # the dry run on a CPU (--device cpu): nothing to record
        return 0, 0, 0.0, "-"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if e.name.startswith(("Memcpy", "Memset"))]
    busy = sum(e.device_time for e in events) / 1000.0
    names: collections.Counter = collections.Counter()
    times: collections.Counter = collections.Counter()
    for e in events:
        names[e.name[:60]] += 1
        times[e.name[:60]] += e.device_time / 1000.0
    top = ", ".join(f"{name} x{names[name]} {ms:.1f} ms" for name, ms in times.most_common(12))
    return len(events) - len(copies), len(copies), busy, top


def by_place(work, device: torch.device, top: int = 10) -> str:
    """Where `work()`'s time goes in sgraf's code: each operation's own GPU time (CPU time on a
    CPU), charged to the sgraf function that called it and the operation it called there, the
    `top` that took the most: "similarity.py fast_forward aten::baddbmm 12.3 ms, ...".

    The caller is the innermost sgraf frame of the operation's Python stack. PyTorch 2.13's
    profiler records the frames as events, the operations' parents; 2.11's (the device image's)
    records none, and gives each operation its stack as a list of frames when its profile is
    verbose: both are read."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities, with_stack=True, experimental_config=_verbose()) as prof:
        work()
        sync(device)
    places: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("aten::"):
            continue
        own = ((getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0))
               if device.type == "cuda" else event.self_cpu_time_total)
        if not own:
            continue
        called, parent, stack = event.name, event.cpu_parent, list(event.stack or ())
        while parent is not None and not _sgraf_frame(parent.name):   # up to the innermost sgraf frame
            if parent.name.startswith("aten::"):
                called = parent.name                # the operation sgraf's code called
                stack = stack or list(parent.stack or ())
            parent = parent.cpu_parent
        frame = parent.name if parent is not None else next((f for f in stack if _sgraf_frame(f)), None)
        if frame is not None:
            # "sgraf/model/similarity.py(400): fast_forward" -> "similarity.py fast_forward"
            path, _, function = frame.partition(": ")
            places[f"{path.rsplit('/', 1)[-1].split('(')[0]} {function} {called}"] += own / 1000.0
    return ", ".join(f"{place} {ms:.1f} ms" for place, ms in places.most_common(top)) or "-"


def _verbose() -> object | None:
    """A verbose profile's settings, under which PyTorch 2.11 keeps each operation's stack."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(verbose=True)
    except (ImportError, TypeError):
        return None


def _sgraf_frame(name: str) -> bool:
    """Whether a profiler event is a Python frame of sgraf's code ("sgraf/model/x.py(12): f"),
    other than the helpers every caller shares (`kernels.cpu`'s linear layers: their caller counts)."""
    path = name.partition("(")[0]
    return path.endswith(".py") and "sgraf/" in path and not path.endswith(("kernels/launches.py", "kernels/cpu.py"))


def sync_points(work, device: torch.device) -> str:
    """Where `work()` makes the host wait for the device: CUDA's sync debug mode warns at each
    synchronising call, and the sgraf frames of the call's stack name the place."""
    if device.type != "cuda":
        return "-"
    places: collections.Counter = collections.Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        if "debug mode is a prototype" in str(message):   # the mode's own notice, once a process (H100 run 1)
            return
        frames = [f"{pathlib.Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                  if "/sgraf/" in f.filename]
        places[" < ".join(reversed(frames[-3:])) or f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return f"{sum(places.values())} ({'; '.join(f'{n}x {p}' for p, n in places.most_common())})"


def counted(work, *host) -> LaunchCounter:
    with LaunchCounter() as counter:
        counter.host(*host)
        work()
    return counter


def timed(work, repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` calls of `work()`, the device synchronised around each; the
    allocator's peak is reset first (read it with `peak_gib`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def training(module: str, precision: str, batch_size: int, device: torch.device, scale: int):
    """(model, batch, optimizer, step): the paper's recipe on a model of the paper's sizes / `scale`,
    `step()` one `train_step` on the batch."""
    model = scaled_model(module, scale).to(device)
    config = preset(f"f30k-{module}").replace(precision=precision)
    batch = batch_of(model, batch_size)
    optimizer = build_optimizer(model, config)
    return model, batch, optimizer, lambda: train_step(model, optimizer, batch, config, device=device)


def step_figures(module: str, precision: str, batch_size: int, steps: int, device: torch.device, scale: int) -> str:
    _, batch, optimizer, step = training(module, precision, batch_size, device, scale)
    if device.type == "cuda":
        batch.images = batch.images.pin_memory()
    for _ in range(2):
        step()
    sync(device)
    adam_steps = [state["step"] for state in optimizer.state.values() if not state["step"].is_cuda]
    counter = counted(step, batch.lengths, *adam_steps)
    syncs = sync_points(step, device)
    n_kernels, n_copies, busy, top = kernels(step, device)
    times = timed(step, steps, device)
    peak = peak_gib(device)
    return (f"train step, batch {batch_size}, {module} {precision}: {statistics.median(times):.4f} s "
            f"(median of {steps}; min {min(times):.4f}), peak {peak:.2f} GiB; profiler: {n_kernels} kernels + "
            f"{n_copies} copies/fills, GPU busy {busy:.1f} ms; counted on the CPU side: {counter.summary()}; "
            f"host waits: {syncs}; most time: {top}")


def sweep_figures(module: str, precision: str, batch_size: int, steps: int, device: torch.device, scale: int,
                  keep_share: float, memory_share: float) -> str:
    """A training step's median seconds and peak memory with other shares of the free memory for
    the kept chunks (`TRAIN_GPU_KEEP_SHARE`) and the chunk size (`TRAIN_GPU_MEMORY_SHARE`, with no
    cap in (image, word) pairs: the sweep that set `TRAIN_GPU_CHUNK_PAIRS`)."""
    from sgraf.kernels import train_chunks

    names = ("TRAIN_GPU_KEEP_SHARE", "TRAIN_GPU_MEMORY_SHARE", "TRAIN_GPU_CHUNK_PAIRS")
    saved = [getattr(train_chunks, name) for name in names]
    for name, value in zip(names, (keep_share, memory_share, 2**62)):
        setattr(train_chunks, name, value)
    try:
        model, batch, _, step = training(module, precision, batch_size, device, scale)
        step()
        times = timed(step, steps, device)
        chunks = len(model.train_chunks(batch_size, batch.lengths))
    finally:
        for name, value in zip(names, saved):
            setattr(train_chunks, name, value)
    return (f"sweep keep {keep_share:.4f} chunk {memory_share:.4f} ({chunks} chunks), {module} {precision}: "
            f"{statistics.median(times):.4f} s, peak {peak_gib(device):.2f} GiB")


ROUTE_NAMES = {"SGRAF_EDGE_ROUTE": "edge route", "SGRAF_WORD_ROUTE": "word route", "SGRAF_STEP_ROUTE": "step route",
               "SGRAF_ATTENTION_ROUTE": "attention route", "SGRAF_FILTER_ROUTE": "filter route"}


def block_figures(module: str, precision: str, n_img: int, n_cap: int, device: torch.device, scale: int,
                  routes: dict[str, str] | None = None) -> str:
    """One scoring block's figures; `routes` forces routes for the call by their environment
    variables (`SGRAF_EDGE_ROUTE`: SGR's edge step; `SGRAF_WORD_ROUTE`: the word nodes)."""
    routes = routes or {}
    saved = {variable: os.environ.get(variable) for variable in routes}
    os.environ.update(routes)
    try:
        figures = _block_figures(module, precision, n_img, n_cap, device, scale)
        return figures + "".join(f"; {ROUTE_NAMES[variable]} {route}" for variable, route in routes.items())
    finally:
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def block_routes(module: str, edge_routes: list[str], word_routes: list[str]) -> list[dict[str, str]]:
    """The routes a module's blocks are profiled with: SGR once per edge route (the word nodes,
    the reasoning steps and the attention eager), then every module once per other word route (the
    edge route measured or default), SGR once more with its reasoning steps in one kernel as well,
    every module once more with the attention in one kernel too, and SAF once more with its
    filtration in one kernel as well."""
    own = "SGRAF_STEP_ROUTE" if module == "sgr" else "SGRAF_FILTER_ROUTE"   # the module's own head kernel
    eager_rest = {"SGRAF_WORD_ROUTE": "eager", own: "eager", "SGRAF_ATTENTION_ROUTE": "eager"}
    edge = [{"SGRAF_EDGE_ROUTE": route, **eager_rest} for route in edge_routes] if module == "sgr" else [eager_rest]
    fused = []
    for route in (r for r in word_routes if r != "eager"):
        fused.append({"SGRAF_WORD_ROUTE": route, own: "eager", "SGRAF_ATTENTION_ROUTE": "eager"})
        if module == "sgr":   # the reasoning steps in one kernel too (`sgraf.kernels.graph_steps`)
            fused.append({"SGRAF_WORD_ROUTE": route, own: route, "SGRAF_ATTENTION_ROUTE": "eager"})
        fused.append({"SGRAF_WORD_ROUTE": route, own: route if module == "sgr" else "eager",
                      "SGRAF_ATTENTION_ROUTE": route})
        if module != "sgr":   # and SAF's filtration (`sgraf.kernels.filtration`)
            fused.append({"SGRAF_WORD_ROUTE": route, own: route, "SGRAF_ATTENTION_ROUTE": route})
    return edge + fused


@functools.lru_cache(maxsize=1)
def encoded_split(module: str, precision: str, n_img: int, n_cap: int, device: torch.device, scale: int) -> tuple:
    """The model and its encoded images and captions, as `sgraf evaluate` cuts a split: captions
    sorted by length into buckets of `n_cap`. Kept for the next row (the routes change the
    scoring, not the encoders); only `n_img` images are drawn."""
    model = scaled_model(module, scale).to(device).eval()
    n_all = BUCKETS * n_cap
    batch = batch_of(model, n_all, images=n_img)
    with torch.no_grad():
        encoded = blocks.encode(model, batch.images, batch.captions, batch.lengths, batch_size=n_cap,
                                precision=precision)
    return model, encoded


def _block_figures(module: str, precision: str, n_img: int, n_cap: int, device: torch.device, scale: int) -> str:
    model, encoded = encoded_split(module, precision, n_img, n_cap, device, scale)
    with torch.no_grad():
        # the middle bucket of the split
        bucket_id = len(encoded.buckets) // 2
        bucket = encoded.buckets[bucket_id]
        grams = model.region_grams(encoded.img_embs)
        with model.frozen_weights():
            block = lambda: blocks._score_block([model], [encoded], slice(0, n_img), bucket_id,
                                                slice(0, len(bucket.index)), precision, None, [grams])
            block()
            sync(device)
            counter = counted(block, bucket.lengths)
            syncs = sync_points(block, device)
            n_kernels, n_copies, busy, top = kernels(block, device)
            by_code = by_place(block, device)
            times = timed(block, 5, device)
    pairs = n_img * len(bucket.index)
    seconds = statistics.median(times)
    width = int(bucket.lengths.max())
    return (f"scoring block {n_img} x {len(bucket.index)} (the middle of {BUCKETS} length buckets, {width} tokens), "
            f"{module} {precision}: "
            f"{seconds * 1000:.1f} ms, {pairs / seconds / 1e6:.2f} M pairs/s; profiler: {n_kernels} kernels + "
            f"{n_copies} copies/fills, GPU busy {busy:.1f} ms; counted on the CPU side: {counter.summary()}; "
            f"host waits: {syncs}; most time: {top}; by place: {by_code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=["sgr", "saf"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--images", type=int, default=blocks.GPU_IMAGE_BLOCK)
    parser.add_argument("--captions", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--sweep", action="store_true", help="only the training step's time and memory against the "
                        "shares of free memory in --keep-shares x --memory-shares")
    parser.add_argument("--keep-shares", type=float, nargs="+", default=[0.0, 1 / 64, 1 / 32, 1 / 16])
    parser.add_argument("--memory-shares", type=float, nargs="+", default=[1 / 32])
    parser.add_argument("--edge-routes", nargs="+", default=list(edges.ROUTES), choices=edges.ROUTES,
                        help="SGR's scoring blocks once per route (default: both)")
    parser.add_argument("--word-routes", nargs="+", default=None, choices=words.ROUTES,
                        help="the blocks once per word-node route (default: both where the fused kernel can run)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run that the script works (no profiler figures)")
    parser.add_argument("--scale", type=int, default=1, help="feature sizes divided by this (1: the paper's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA device here (--device cpu for a dry run)", file=sys.stderr)
        return 2
    word_routes = args.word_routes or (list(words.ROUTES) if words.fusable(device) else ["eager"])
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, models of the paper's sizes / {args.scale}, random weights", flush=True)
    failed = 0
    if args.sweep:
        for keep in args.keep_shares:
            for share in args.memory_shares:
                for module in args.modules:
                    for precision in args.precisions:
                        try:
                            print(sweep_figures(module, precision, args.batch, args.steps, device, args.scale,
                                                keep, share), flush=True)
                        except Exception as error:
                            failed += 1
                            print(f"sweep {keep} {share} {module} {precision}: FAILED {type(error).__name__}: {error}",
                                  flush=True)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
        return 1 if failed else 0
    for module in args.modules:
        for precision in args.precisions:
            work = [lambda: step_figures(module, precision, args.batch, args.steps, device, args.scale)]
            work += [lambda n=n, r=r: block_figures(module, precision, args.images, n, device, args.scale, r)
                     for n in args.captions for r in block_routes(module, args.edge_routes, word_routes)]
            for figure in work:
                try:
                    print(figure(), flush=True)
                except Exception as error:   # one failure must not hide the other rows
                    failed += 1
                    print(f"{module} {precision}: FAILED {type(error).__name__}: {error}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
