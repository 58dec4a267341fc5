"""Compiling a Triton kernel for an H100 (sm_90) without a GPU: its PTX, and the report of the
`ptxas -v` Triton itself runs for sm_90 (registers, spills)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any


HOPPER_SHARED_BYTES = 232_448     # shared memory a block may take on an H100 or H200 (227 KiB)


def _compiled(kernel: Any, values: dict[str, Any], pointers: dict[str, str], warps: int, stages: int) -> Any:
    """`kernel` compiled by Triton for sm_90, its `constexpr` arguments `values`, its pointer
    arguments typed by `pointers` ('*bf16', ...) and every other argument an i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in values else pointers.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in values.items()})
    from sgraf.kernels.fused_routes import FP_FUSION

    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": FP_FUSION})


def shared_bytes(kernel: Any, values: dict[str, Any], pointers: dict[str, str], warps: int, stages: int) -> int:
    """The shared memory a block of `kernel` takes on sm_90 (Triton's own count)."""
    return int(_compiled(kernel, values, pointers, warps, stages).metadata.shared)


def compile_for_hopper(kernel: Any, values: dict[str, Any], pointers: dict[str, str], warps: int,
                       stages: int) -> tuple[str, str]:
    """(PTX, ptxas report) of `kernel` (`_compiled`'s arguments)."""
    from triton.backends.nvidia.compiler import get_ptxas

    compiled = _compiled(kernel, values, pointers, warps, stages)
    ptx = pathlib.Path(tempfile.mkdtemp()) / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
    return compiled.asm["ptx"], report


def compile_tiles(kernel: Any, values: dict[str, Any], pointers: dict[str, str], tiles: Iterable[tuple[int, ...]],
                  launch: Callable[[tuple[int, ...]], tuple[dict[str, Any], int, int]]) -> list[tuple[str, str]]:
    """`compile_for_hopper` for each tile, two at a time (Triton's compiler releases the GIL:
    half the wait on 2 cores) except under Python 3.11; `launch(tile)` gives the tile's own
    constexpr values, its warps and its pipeline stages.

    Python 3.11 keeps `ast.parse`'s recursion count in one place per interpreter: when a thread
    switch lands inside one parse (a garbage collection running a finalizer, say) and the other
    thread parses, the first raises "SystemError: AST constructor recursion depth mismatch"
    (seen in the suite on 3.11.7; 3.10, 3.12 and 3.13 do not count that way). Triton parses
    each kernel's source at every compilation, so there the tiles compile one at a time."""
    def build(tile: tuple[int, ...]) -> tuple[str, str]:
        own, warps, stages = launch(tile)
        return compile_for_hopper(kernel, {**values, **own}, pointers, warps, stages)

    if sys.version_info[:2] == (3, 11):
        return [build(tile) for tile in tiles]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(build, tiles))


def spills(report: str) -> list[int]:
    """The bytes of spill stores of each function in a `ptxas -v` report."""
    return [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
