"""The score matrix's copy to the host: after the scoring, or band by band beside it (`HostCopy`).

`sgraf evaluate` scores the (n_images, n_captions) matrix on the device and needs it on the host
to save it. This times the two ways on the same work, in turns, medians:

- `after`: every band scored, then the whole matrix copied (`.cpu()`) and saved (`np.save`,
  then synced: `sgraf evaluate --save-sims` before session 20);
- `bands`: each band handed to `sgraf.model.host_copy.HostCopy` as soon as it is scored, which
  copies it and writes it to the file, and `result()` waited for after the last, then the file
  synced (what `evaluate_split` now does on a GPU). `--no-save`: the copies alone.

The scoring is a stand-in of the same length per band as the real one (`--band-ms`, the MSCOCO
bf16 block rows predicted on an H100: 20 bands of 256 images in about 6 s): matmuls on a CUDA
device, or on the CPU (`--device cpu`, where the "device" matrix is a second host tensor and the
copy is the same memory copy into fresh pages). It prints each way's whole time and its time after
the last band (what stands on the command's path), and their ratio.

    python benchmarks/bench_host_copy.py                     # CUDA if there is one, MSCOCO 5K size
    python benchmarks/bench_host_copy.py --device cpu --images 5000 --band-ms 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sgraf.kernels.tuning import cpu_model
from sgraf.model.host_copy import HostCopy


def stand_in(device: torch.device, band_ms: float) -> tuple[torch.Tensor, int]:
    """A matmul and how many of them take about `band_ms` on `device` (measured)."""
    work = torch.randn(1024, 1024, device=device)
    reps = 1
    while True:
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            work = (work @ work).tanh_()
        sync(device)
        took = (time.perf_counter() - start) * 1e3
        if took >= band_ms / 4 or reps > 1 << 16:
            return work, max(1, round(reps * band_ms / max(took, 1e-3)))
        reps *= 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(way: str, device: torch.device, shape: tuple[int, int], band: int, work: torch.Tensor, reps: int,
        file: Path | None) -> tuple[float, float]:
    """(whole seconds, seconds after the last band was scored) of one way, saving to `file` if given."""
    if file is not None:
        file.unlink(missing_ok=True)
    sync(device)
    start = time.perf_counter()
    share = torch.empty(shape, device=device)
    copy = HostCopy(shape, file) if way == "bands" else None
    try:
        for row in range(0, shape[0], band):
            for _ in range(reps):
                work = (work @ work).tanh_()
            share[row:row + band] = work[0, 0]          # the band's scores, written after its work
            if copy is not None:
                copy.band(share, slice(row, min(row + band, shape[0])))
        sync(device)
        scored = time.perf_counter()
        host = copy.result(share) if copy is not None else (share.cpu() if device.type == "cuda"
                                                            else share.clone()).numpy()
    finally:
        if copy is not None:
            copy.close()
    if file is not None:
        if copy is None:
            with open(file, "wb") as handle:
                np.save(handle, host)
        handle = os.open(file, os.O_RDONLY)
        os.fsync(handle)                                # as `sgraf.atomic_write.atomic_path` does
        os.close(handle)
    end = time.perf_counter()
    assert host.shape == shape and float(host[-1, -1]) == float(share[-1, -1])
    return end - start, end - scored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=5000, help="rows; 5 captions per image are the columns")
    parser.add_argument("--band", type=int, default=256, help="rows per band (the GPU's image block)")
    parser.add_argument("--band-ms", type=float, default=300.0, help="the stand-in scoring's time per band")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-save", action="store_true", help="the copies alone, no file written")
    parser.add_argument("--threads", type=int, default=None,
                        help="PyTorch's threads for the stand-in (default on a CPU: one core left free, as a GPU's "
                             "host has cores beside the one that launches the kernels)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))
    shape = (args.images, 5 * args.images)
    work, reps = stand_in(device, args.band_ms)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    print(f"{where}, torch {torch.__version__}: a {shape[0]} x {shape[1]} float32 matrix "
          f"({shape[0] * shape[1] * 4 / 1e6:.0f} MB) in bands of {args.band} rows, {args.band_ms:.0f} ms of "
          f"stand-in scoring each (PyTorch threads: {torch.get_num_threads()}); {args.repeats} turns of each way, "
          f"medians", flush=True)
    times: dict[str, list[tuple[float, float]]] = {"after": [], "bands": []}
    with tempfile.TemporaryDirectory() as folder:
        file = None if args.no_save else Path(folder) / "sims.npy"
        print(f"saved to a file in {folder} and synced" if file else "not saved", flush=True)
        for turn in range(args.repeats + 1):           # the first turn warms up and is not counted
            for way in times:
                whole, tail = run(way, device, shape, args.band, work, reps, file)
                if turn:
                    times[way].append((whole, tail))
    medians = {way: (statistics.median(w for w, _ in rows), statistics.median(t for _, t in rows))
               for way, rows in times.items()}
    for way, (whole, tail) in medians.items():
        print(f"{way}: whole {whole:.3f} s, after the last band {tail:.3f} s")
    print(f"ratio after/bands: whole {medians['after'][0] / medians['bands'][0]:.2f}x, after the last band "
          f"{medians['after'][1] / max(medians['bands'][1], 1e-6):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
