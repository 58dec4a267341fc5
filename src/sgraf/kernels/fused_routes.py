"""How the route of each Triton kernel is chosen (`sgraf.kernels.words`, `graph_steps`, `attention`).

Each of those modules has two routes: 'eager' (PyTorch's operations, the default) and 'fused' (its
kernel). The kernel comes in a few tiles, and a probe times each tile as a route of its own
('fused 64x32x8x2'), so that the tile chosen is stored with the route. `FusedRoutes` holds what
the modules share:
- the environment variable that forces 'eager' or 'fused';
- the stored choice, looked up without measuring (inside a scoring loop);
- the probe (`sgraf.kernels.tuning.choose`), in which a tile that fails to build is timed as never
  finishing, so it is never chosen;
- the tile a route names.
Whether the kernel can run on a device (`can_fuse`: `fusable(device)`, a CUDA device with Triton)
and whether it takes this work (`applies`) are the caller's to say, looked up at each call (so a
test can stand Triton's interpreter in for a device, one kernel's module at a time).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgraf.errors import InputError
from sgraf.kernels import tuning

logger = logging.getLogger(__name__)

ROUTES = ("eager", "fused")          # the first is the default; the forcing variables take these


def fusable(device: torch.device | str) -> bool:
    """Whether a fused route can run here: a CUDA device with Triton importable. (Tests run the
    kernels on the CPU through Triton's interpreter by asking for a fused route.)"""
    return torch.device(device).type == "cuda" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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
               runner: Callable[[str], Callable[[], object]]) -> str:
        """`peek`, measured on this device if it has not been: `runner(route)` sets up a probe
        and returns the call to time (synchronised here on a CUDA device)."""
        forced = self.forced(device, can_fuse)
        if forced:
            return forced
        device = torch.device(device)
        if not (can_fuse and applies):
            return ROUTES[0]
        return tuning.choose(name, self.measured, lambda route: self._time(route, device, runner), device=device)

    def _time(self, route: str, device: torch.device, runner: Callable[[str], Callable[[], object]]) -> float:
        try:
            run = runner(route)

            def synchronised() -> None:
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            return tuning.best_time(synchronised)
        except Exception as error:   # noqa: BLE001  (a kernel that does not build here is never chosen)
            logger.warning("the fused %s route failed on %s (%s: %s); the eager route stays",
                           self.what, device, type(error).__name__, error)
            return float("inf")
