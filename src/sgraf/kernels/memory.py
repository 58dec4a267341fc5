"""Keeping freed memory in the process during CPU training.

A training step at the paper's size allocates and frees tensors of tens of megabytes many times
(a chunk's (images x words x 1,024) blocks are about 60 MiB). glibc's malloc serves blocks above
its mmap threshold (at most 32 MiB by default) with fresh `mmap` pages and gives them back on
free, and each OpenMP worker thread may get an arena of its own whose memory is also given back.
Every such block is then faulted in again, page by page, at its next use: on a 2-core AMD EPYC
virtual machine a step of SGR at batch 128 took 700-900 thousand page faults and about 10 %
of its time (`benchmarks/bench_train.py`). `keep_freed_memory()` tells glibc to keep freed
memory for reuse instead: one arena, no `mmap` for single blocks, no trimming of the heap (a
step then took under 20 faults; glibc may still give a block back now and then). The
process's peak memory is what it was (ru_maxrss rose by 3 % in that measurement); its memory
is not handed back to the system until it exits, so only training calls it, on the CPU.

`SGRAF_KEEP_FREED_MEMORY=off` leaves glibc's defaults. Elsewhere than glibc (macOS, musl,
Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

from sgraf.user_cache import switched_on

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Make glibc keep memory freed by this process for its own reuse (see the module).

    Called by CPU training before its first step; idempotent and cheap after the first call.

    Returns:
        whether glibc's settings were changed (False elsewhere than glibc, or when
        `SGRAF_KEEP_FREED_MEMORY=off`).

    Raises:
        InputError: `SGRAF_KEEP_FREED_MEMORY` is neither on nor off (`user_cache.switched_on`).
    """
    return switched_on("SGRAF_KEEP_FREED_MEMORY") and _apply()


@functools.cache
def _apply() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # one arena: worker threads' blocks come back to the same heap; no mmap'd single blocks;
    # never trim the heap's top (the largest int: about 2 GiB of free top before a trim)
    return all([mallopt(M_ARENA_MAX, 1) == 1, mallopt(M_MMAP_MAX, 0) == 1,
                mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1])
