"""Which plan of work a device gets: the CPU's (cache-sized chunks, measured thread modes,
oneDNN matmuls) or a GPU's (device-sized blocks, one chunk per block, PyTorch's own ops).

The model and the scorer ask `gpu_plan(device)` instead of testing the device type, and
`free_memory(device)` instead of asking CUDA, so that `emulate_gpu()` can run the GPU plan on
CPU tensors: the same block sizes, chunks and ops a CUDA device would get, which
`sgraf.kernels.launches` counts without a GPU. Outside `emulate_gpu` the plan is the device's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# The free memory `emulate_gpu` reports by default: an idle 80 GB H100 as CUDA reports it.
EMULATED_FREE_BYTES = 78 * 2**30

_state = threading.local()


def emulated_free_bytes() -> int | None:
    """The free memory of the emulated GPU on this thread, or None outside `emulate_gpu`."""
    return getattr(_state, "free", None)


def gpu_plan(device: torch.device | str) -> bool:
    """Whether work on `device` follows the GPU plan: a CUDA device, or the CPU inside `emulate_gpu`."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and emulated_free_bytes() is not None)


def free_memory(device: torch.device | str) -> int:
    """Free bytes of a GPU-plan device (the emulated amount inside `emulate_gpu`)."""
    emulated = emulated_free_bytes()
    if emulated is not None and torch.device(device).type == "cpu":
        return emulated
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


@contextlib.contextmanager
def emulate_gpu(free_bytes: int = EMULATED_FREE_BYTES) -> Iterator[None]:
    """On this thread, CPU tensors get the GPU plan, as if they were on a CUDA device with
    `free_bytes` of free memory (for counting its operations; slow on a CPU)."""
    outer = emulated_free_bytes()
    _state.free = int(free_bytes)
    try:
        yield
    finally:
        _state.free = outer


# The CPU plan runs the elementwise passes of a bf16 (or fp16) training chunk's word nodes over
# their (images x words x features) tensors image by image, in tiles of about this many float32
# bytes, so that a tile's several passes stay in a core's cache instead of each streaming the
# whole chunk through memory (`sgraf.kernels.nodes._LowPrecisionLocalNodes`: the same values;
# a SAF bf16 step 1.12x faster on a 2-core Intel Xeon with AMX).
TILE_BYTES = 2**20
# Float32's nodes run their whole pipeline tile by tile instead, the matmuls included (the
# contexts, the linear layer and its gradients: `sgraf.kernels.nodes._LocalNodes`), in tiles of
# about this many bytes of differences: their elementwise passes alone, which run in place, gained
# nothing from tiles. On a 2-core Intel Xeon with AMX the whole pipeline in tiles made a SAF
# float32 step 1.04x faster in `benchmarks/bench_train.py --against` (a process per
# configuration) and 1.06-1.08x stepping in turn in one process (tiles of 1 MiB: 1.0x, 2 MiB:
# 1.07x, 8 MiB: 1.06x); it also keeps two tile-sized buffers where backward kept three whole ones.
FLOAT32_TILE_BYTES = 4 * 2**20


def cache_tiles(n: int, bytes_per_item: int, device: torch.device | str, tile_bytes: int | None = None) -> list[slice]:
    """Slices of `range(n)` of about `tile_bytes` each (default `TILE_BYTES`; at least one item)
    under the CPU plan, for passes that run tile by tile; one slice, the whole, under the GPU plan
    (where each pass is a kernel launch and the device's memory is fast)."""
    if gpu_plan(device) or n <= 1:
        return [slice(0, n)]
    step = max(1, (TILE_BYTES if tile_bytes is None else tile_bytes) // max(int(bytes_per_item), 1))
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]
