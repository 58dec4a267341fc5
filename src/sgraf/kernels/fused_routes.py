"""How the route of each Triton kernel is chosen (`sgraf.kernels.words`, `graph_steps`, `attention`,
`filtration`).

Each of those modules has two routes: 'eager' (PyTorch's operations, the default) and 'fused' (its
kernel). The kernel comes in a few tiles, and a probe times each tile as a route of its own
('fused 64x32x8x2'), so that the tile chosen is stored with the route. `FusedRoutes` holds what
the modules share:
- the environment variable that forces 'eager' or 'fused';
- the stored choice, looked up without measuring (inside a scoring loop);
- the probe (`sgraf.kernels.tuning.choose`), in which a tile that fails to build, or whose output
  on the probe's inputs lies further from the eager route's than `AGREEMENT` allows, is timed as
  never finishing, so it is never chosen (the kernels' tests hold them to the eager route through
  Triton's interpreter; the probe checks it again on the device that will run them);
- the tile a route names.
Whether the kernel can run on a device (`can_fuse`: `fusable(device)`, a CUDA device with Triton)
and whether it takes this work (`applies`) are the caller's to say, looked up at each call (so a
test can stand Triton's interpreter in for a device, one kernel's module at a time).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgraf import torch_compat
from sgraf.errors import InputError
from sgraf.kernels import tuning

logger = logging.getLogger(__name__)

Outputs = torch.Tensor | tuple[torch.Tensor, ...]   # what a probed route returns

ROUTES = ("eager", "fused")          # the first is the default; the forcing variables take these
# Every kernel is built with multiplies and adds contracted into FMAs, as nvcc builds PyTorch's own
# CUDA kernels and as the kernels' probes and budgets were set; pinned, since Triton 3.10 builds
# without them unless asked.
FP_FUSION = True
# How far a fused route's output may lie from the eager route's on the probe's inputs, as a
# fraction of the largest eager value, by the probe's dtype. float32 sums in another order (the
# kernels' tests hold them within 1e-5); 16-bit values are rounded at other places (through
# Triton's interpreter, which truncates where a GPU rounds, the word nodes' bf16 probe lies 1.5 %
# apart, the reasoning steps' 0.5 %). A kernel that reads or writes the wrong place is further off
AGREEMENT = {torch.float32: 1e-4, torch.bfloat16: 2 ** -4, torch.float16: 2 ** -4}
# float32 under TF32 (`sgraf evaluate --tf32`): the eager route's matmuls and the kernels' both
# round their operands to 10 bits of mantissa, as float16 does
AGREEMENT_TF32 = AGREEMENT[torch.float16]


def dtype_key(dtype: torch.dtype) -> str:
    """`dtype` as the kernels' stored choices name it. float32 while CUDA's matmuls may use TF32
    is a dtype of its own: the eager route and the kernels then multiply in TF32, so they are
    timed and held to each other apart from exact float32."""
    return f"{dtype}|tf32" if _tf32(dtype) else str(dtype)


def agreement(dtype: torch.dtype) -> float:
    """How far a fused route's probe output may lie from the eager route's (`AGREEMENT`)."""
    return AGREEMENT_TF32 if _tf32(dtype) else AGREEMENT[dtype]


def _tf32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def fusable(device: torch.device | str) -> bool:
    """Whether a fused route can run here: a CUDA device with Triton 3.4 or later installed
    (`torch_compat.triton_usable`). (Tests run the kernels on the CPU through Triton's
    interpreter by asking for a fused route.)"""
    return torch.device(device).type == "cuda" and torch_compat.triton_usable()


@dataclass(frozen=True)
class FusedRoutes:
    """The routes of one kernel: `variable` forces one, `what` names it in the log, `tiles`
    (tuples of ints the kernel's module reads, such as rows, features, warps and stages; the
    first is plain 'fused''s) are timed."""

    variable: str
    what: str
    tiles: tuple[tuple[int, ...], ...]

    @property
    def measured(self) -> tuple[str, ...]:
        """The routes a probe times: 'eager', then 'fused RxFxWxS' for each tile."""
        return (ROUTES[0], *(f"fused {'x'.join(map(str, tile))}" for tile in self.tiles))

    def tile(self, route: str) -> tuple[int, ...]:
        """The tile a fused route names ('fused 64x32x8x2'), or the first of `tiles` ('fused')."""
        _, _, tile = route.partition(" ")
        return tuple(int(part) for part in tile.split("x")) if tile else self.tiles[0]

    def forced(self, device: torch.device | str, can_fuse: bool) -> str:
        """The route `variable` forces ('eager' or 'fused'), '' when it is unset.

        Raises:
            InputError: the variable names another route, or 'fused' where the kernel cannot run.
        """
        forced = tuning.forced_route(self.variable, ROUTES)
        if forced == "fused" and not can_fuse:
            raise InputError(f"{self.variable}=fused needs a CUDA device with Triton installed; this is {device}")
        return forced

    def peek(self, name: str, device: torch.device | str, can_fuse: bool, applies: bool = True) -> str:
        """The forced route, else the choice stored under `name` for this device, else 'eager';
        'eager' inside a compiled graph, where the kernel cannot run (`can_fuse`) or does not take
        the work (`applies`). Never measures."""
        if torch.compiler.is_compiling():
            return ROUTES[0]
        forced = self.forced(device, can_fuse)
        if forced:
            return forced
        if not (can_fuse and applies):
            return ROUTES[0]
        return tuning.peek(name, self.measured, device=device)

    def choose(self, name: str, device: torch.device | str, can_fuse: bool, applies: bool,
               runner: Callable[[str], Callable[[], Outputs]], dtype: torch.dtype) -> str:
        """`peek`, measured on this device if it has not been: `runner(route)` sets up a probe (the
        same inputs for every route) and returns the call to time, which returns the route's
        output; a fused route's first output is held to the eager route's within `agreement(dtype)`."""
        forced = self.forced(device, can_fuse)
        if forced:
            return forced
        device = torch.device(device)
        if not (can_fuse and applies):
            return ROUTES[0]
        reference: list[Outputs] = []    # the eager route's output, measured first
        return tuning.choose(name, self.measured,
                             lambda route: self._time(route, device, runner, reference, agreement(dtype)),
                             device=device)

    def _time(self, route: str, device: torch.device, runner: Callable[[str], Callable[[], Outputs]],
              reference: list[Outputs], agreement: float) -> float:
        try:
            run = runner(route)

            def synchronised() -> Outputs:
                output = run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                return output

            output = synchronised()     # the warm-up call
            if route == ROUTES[0]:
                reference.append(output)
            else:
                apart = relative_difference(output, reference[0]) if reference else float("inf")
                if not apart <= agreement:
                    logger.warning("the fused %s route %r gave values %.3g of the largest apart from the eager "
                                   "route's on %s (at most %.3g allowed); it is never chosen", self.what, route,
                                   apart, device, agreement)
                    return float("inf")
            return tuning.best_time(synchronised, warmup=0)
        except Exception as error:   # noqa: BLE001  (a kernel that does not build here is never chosen)
            if device_fault(error):
                raise                # the device's context is lost: every later call would fail far from here
            logger.warning("the fused %s route failed on %s (%s: %s); the eager route stays",
                           self.what, device, type(error).__name__, error)
            return float("inf")


DEVICE_FAULTS = ("CUDA error", "illegal memory access", "unspecified launch failure", "misaligned address")


def device_fault(error: BaseException) -> bool:
    """Whether `error` is a fault of the device itself (an illegal address, a failed launch), after
    which its context cannot recover, rather than a kernel that does not build or fit (Triton's
    OutOfResources, a compile error), which a probe times as failed and goes on."""
    accelerator = getattr(torch, "AcceleratorError", None)
    return (accelerator is not None and isinstance(error, accelerator)) or \
        any(text in str(error) for text in DEVICE_FAULTS)


def relative_difference(output: Outputs, reference: Outputs) -> float:
    """The largest |output - reference| over the largest |reference|, over every tensor of the two
    (a tensor or a tuple of tensors); infinite where their shapes differ or a value is not finite."""
    outputs = output if isinstance(output, tuple) else (output,)
    references = reference if isinstance(reference, tuple) else (reference,)
    if len(outputs) != len(references) or any(a.shape != b.shape for a, b in zip(outputs, references)):
        return float("inf")
    apart = [float((a.double() - b.double()).abs().max()) for a, b in zip(outputs, references)]
    largest = max(float(b.double().abs().max()) for b in references)
    ratio = max(apart) / largest if largest > 0 else max(apart)
    return ratio if all(math.isfinite(x) for x in apart) and math.isfinite(ratio) else float("inf")
