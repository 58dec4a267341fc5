"""Matmuls on the CPU through the faster of two routes, measured on this processor.

PyTorch sends float32 matmuls on the CPU to MKL; oneDNN, which PyTorch also ships, can be
called directly (`torch.ops.mkldnn._linear_pointwise`). Which one is faster depends on the
processor: on AMD EPYC (Zen 5) oneDNN runs these shapes at about 2.2x MKL's speed (450 against
200 GFLOP/s on 2 cores), on AMD EPYC Zen 3 (AVX2) at about 0.8x, and on Intel Xeon (Sapphire
Rapids) within 5 %. `float32_route()` times both once per machine (`sgraf.kernels.tuning`, with
`ROUTE_KEEP` and `ROUTE_ROUNDS`) and the functions here follow it;
`weight_gradient_route()` is measured apart, for the weight gradients of training. bfloat16
goes through oneDNN where it runs (PyTorch's own bf16 matmul on the CPU calls it too; on a
processor without bf16 support in oneDNN, such as an AVX2-only one, PyTorch's fallback). The
two routes give the same values up to float32 summation order.

`SGRAF_CPU_MATMUL=onednn` or `=aten` forces a route (for a comparison, or the numeric tests'
kernel matrix).

Under PyTorch before 2.12 only the aten route is taken (`onednn_usable`): there oneDNN's linear
was not safe against a signal arriving while it ran. With a Python handler installed, as
training has for SIGTERM and SIGINT (stop after the step, save `last.pt`), PyTorch 2.11.0
crashed with a corrupted heap or a segmentation fault in 4 to 6 of 6 runs of signals sent
every 10 ms during its linear, and never during MKL's matmul; 2.12.1 and 2.13.0 never did
(`tests/test_kernels.py` sends them, `benchmarks/results/device-image-suite-*`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sgraf import torch_compat
from sgraf.kernels import plan, tuning

ROUTES = ("onednn", "aten")          # the first is the matmul route's default (weight gradients: the last)
# the first PyTorch whose oneDNN linear a signal does not crash (see the module)
ONEDNN_SIGNAL_SAFE = (2, 12)


def onednn_usable(version: str, available: bool, has_linear: bool) -> bool:
    """Whether sgraf calls oneDNN's linear itself under PyTorch `version` (e.g. "2.11.0+cu130")."""
    return available and has_linear and torch.torch_version.TorchVersion(version) >= ONEDNN_SIGNAL_SAFE


ONEDNN = onednn_usable(torch.__version__, torch.backends.mkldnn.is_available(),
                       hasattr(torch.ops.mkldnn, "_linear_pointwise"))
# The routes' probes: the default route stays unless the other is more than 10 % faster (not
# `tuning.KEEP_DEFAULT`'s 20 %), the two timed in three alternating rounds. On a 2-core AMD EPYC
# Zen 3 the probe gave MKL 1.21-1.52x oneDNN's speed in five fresh processes, and MKL made a
# whole training step 1.05x (SAF) to 1.10x (SGR) faster and scoring 1.12-1.13x
# (`benchmarks/ab_cpu_route.py`); but one probe measured while other processes were starting
# beside it gave 1.17x and kept oneDNN.
ROUTE_KEEP = 0.1
ROUTE_ROUNDS = 3
# The probe's shape: a block of word nodes through W_loc (2,048 rows, 1,024 -> 256), the most
# frequent float32 matmul of scoring and training at the paper's size.
PROBE_SHAPE = (2048, 1024, 256)
# W_loc's weight gradient over a training chunk's word nodes (128 images x 8 captions x 16 words)
WEIGHT_GRADIENT_PROBE_SHAPE = (16384, 1024, 256)


def float32_route() -> str:
    """'onednn' or 'aten': the faster float32 matmul route on this machine (see the module).

    Called before every float32 matmul: answered from a dict after the first call per setting.
    """
    return _route("matmul")


def weight_gradient_route() -> str:
    """'onednn' or 'aten': the faster route for a float32 weight gradient `rows^T inputs`,
    measured apart from `float32_route` on a training chunk's `W_loc` gradient. MKL (aten, the
    default here) reads both operands transposed in place, oneDNN copies one, so oneDNN is taken
    only where it is clearly faster: on a 2-core AMD EPYC Zen 3 MKL ran this gradient 1.2-1.3x
    faster, while the forward matmuls of the two routes were within 20 % of each other.
    `SGRAF_CPU_MATMUL` forces both routes."""
    return _route("weight gradient")


def _route(kind: str) -> str:
    setting = (kind, os.environ.get("SGRAF_CPU_MATMUL", ""), torch.get_num_threads(), tuning.enabled(),
               tuning.generation())
    route = _routes.get(setting)
    if route is None:
        route = _routes[setting] = _choose_route(kind, setting[1])
    return route


_routes: dict[tuple[str, str, int, bool, int], str] = {}


@functools.cache
def _say_once(message: str) -> None:
    import logging

    logging.getLogger(__name__).warning(message)


def _choose_route(kind: str, forced: str) -> str:
    forced = tuning.checked_route("SGRAF_CPU_MATMUL", forced, ROUTES)
    if forced:
        if forced == "onednn" and not ONEDNN:
            _say_once(f"SGRAF_CPU_MATMUL=onednn is not taken under PyTorch {torch.__version__} (oneDNN's linear "
                      f"there is not safe against signals, or oneDNN is missing): the aten route runs")
            return "aten"
        return forced
    if not ONEDNN:
        return "aten"
    name, candidates = _probe(kind)
    measure = _time_route if kind == "matmul" else _time_weight_gradient
    return tuning.choose(name, candidates, measure, keep=ROUTE_KEEP, rounds=ROUTE_ROUNDS)


def _probe(kind: str) -> tuple[str, tuple[str, ...]]:
    """The tuning name of a route's probe and its candidates, the default first."""
    if kind == "matmul":
        return "cpu float32 matmul route", ROUTES
    # aten first, the default: MKL reads the transposed operands in place, oneDNN copies one
    return "cpu float32 weight gradient route", ROUTES[::-1]


def stored_route(kind: str) -> str:
    """The route ('matmul' or 'weight gradient') this machine's store holds for the current thread
    count, else the default, without probing (`tuning.peek`): what other processes chose."""
    return tuning.peek(*_probe(kind))


def _time_route(route: str) -> float:
    rows, inputs, outputs = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=generator)
    weight, bias = torch.randn(outputs, inputs, generator=generator), torch.randn(outputs, generator=generator)
    if route == "onednn":
        return tuning.best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""))
    return tuning.best_time(lambda: F.linear(x, weight, bias))


def _time_weight_gradient(route: str) -> float:
    rows, inputs, outputs = WEIGHT_GRADIENT_PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    grad, x = torch.randn(rows, outputs, generator=generator), torch.randn(rows, inputs, generator=generator)
    if route == "onednn":
        return tuning.best_time(lambda: torch.ops.mkldnn._linear_pointwise(grad.t(), x.t(), None, "none", [], ""))
    return tuning.best_time(lambda: grad.t() @ x)


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs in `dtype` on this processor (bf16 needs AVX-512 BF16, AMX or
    one of oneDNN's other bf16 code paths: on an AVX2-only processor it cannot create one)."""
    if not ONEDNN:
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype), None,
                                           "none", [], "")
    except RuntimeError:
        return False
    return True


def _onednn(x: torch.Tensor, route: Callable[[], str] = float32_route) -> bool:
    """Whether a CPU matmul on `x` goes through oneDNN: bf16 where oneDNN runs it (else PyTorch's
    own bf16 matmul), float32 where it is the faster `route`."""
    if not ONEDNN or x.device.type != "cpu" or plan.gpu_plan(x.device):   # the GPU plan: PyTorch's ops
        return False
    if torch.compiler.is_compiling():
        # Inductor lowers oneDNN's linear only with constant weights (ours are graph inputs):
        # a compiled graph takes PyTorch's own matmuls and Inductor picks their kernels
        return False
    if x.dtype == torch.bfloat16:
        return onednn_runs(torch.bfloat16)
    return x.dtype == torch.float32 and route() == "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with the leading dimensions of `x` folded into one (a view wherever one exists).

    PyTorch's matmul folds a 3-D or wider input into one matrix only when its leading dimensions
    are contiguous or the weight needs a gradient; otherwise (a (G, 1, m) slice of (G, P, m)
    nodes, without autograd) it runs G one-row matmuls against the weight expanded G times, which
    the CPU's bf16 matmul then copies (1,792 x 256 x 256 for one chunk of SGR's last reasoning
    step). Folded, it is one matmul."""
    if x.dim() <= 2:
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.size(-1)), weight, bias).view(*x.shape[:-1], weight.size(0))


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                relu: bool = False) -> torch.Tensor:
    """`x @ weight^T + bias` in x's dtype (eval only, no autograd), optionally followed by ReLU.

    Through oneDNN when that is this machine's faster route (see the module), the ReLU then
    applied as the matmul writes its output (no second pass); on a GPU likewise, in cuBLASLt's
    epilogue (`torch._addmm_activation`).

    Args:
        x: (..., in) input; its dtype is the compute dtype.
        weight: (out, in); bias: (out,) or None. Cast to x's dtype.
        relu: apply ReLU to the result.

    Returns:
        (..., out) in x's dtype.
    """
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if _onednn(x):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "relu" if relu else "none", [], "")
    if relu and bias is not None and plan.gpu_plan(x.device) and not torch.compiler.is_compiling():
        # on a GPU the ReLU in cuBLASLt's epilogue, as the matmul writes its output: no second pass
        # over it (a whole read and write of SGR's nodes per reasoning step; on the CPU the same
        # operation is the matmul, then the ReLU)
        flat = torch._addmm_activation(bias, x.reshape(-1, x.size(-1)), weight.t())
        return flat.view(*x.shape[:-1], flat.size(-1))
    out = linear(x, weight, bias)
    return torch.relu_(out) if relu else out


class _OneDNNLinear(torch.autograd.Function):
    """`x @ W^T + b` with oneDNN in the forward pass and for the gradients (see `weight_gradient`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.mkldnn._linear_pointwise(grad, weight.t().contiguous(), None, "none", [], "")
        rows = grad.reshape(-1, grad.shape[-1])                              # (n, out)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient(rows, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def train_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the training path, with autograd.

    In float32 outside autocast on a machine whose faster route is oneDNN, the forward pass and
    both gradients run through oneDNN; otherwise this is `linear` (`F.linear`, the input folded).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch_compat.autocast_enabled("cpu") \
            and _onednn(x):
        return _OneDNNLinear.apply(x, weight, bias)
    return linear(x, weight, bias)


def weight_gradient(rows: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """`rows^T inputs`: (n, out), (n, in) -> (out, in), the gradient of a linear layer's weight.

    Through oneDNN when that is this machine's faster route for weight gradients
    (`weight_gradient_route`; both operands passed as transposed views, oneDNN copies `rows^T`);
    otherwise a plain matmul. On a 2-core AMD EPYC Zen 5, oneDNN ran the caption GRU's
    gradients, whose output is wider than their input, 1.5-1.9x faster than MKL, as it ran
    `W_loc`'s (`benchmarks/results/train-step-routes-*`).
    """
    if _onednn(rows, weight_gradient_route):
        return torch.ops.mkldnn._linear_pointwise(rows.t(), inputs.t(), None, "none", [], "")
    return rows.t() @ inputs


def linear_add(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
    """`addend + x @ weight^T` (eval only, no autograd): one `addmm`, or oneDNN's matmul and an
    addition where oneDNN is this machine's faster float32 route (see the module)."""
    if _onednn(x):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "").add_(addend)
    return torch.addmm(addend, x, weight.t())


_AUTHORS_KERNELS: contextvars.ContextVar[bool] = contextvars.ContextVar("sgraf_authors_kernels", default=False)


@contextlib.contextmanager
def authors_kernels() -> Iterator[None]:
    """Within this context `TrainLinear` layers run as `nn.Linear` (PyTorch's own matmul), as
    in the authors' code: for the stand-ins of their loops (`sgraf.model.oracle`), whose cost
    must stay theirs."""
    token = _AUTHORS_KERNELS.set(True)
    try:
        yield
    finally:
        _AUTHORS_KERNELS.reset(token)


class TrainLinear(nn.Linear):
    """`nn.Linear` whose training pass (autograd recording) takes `train_linear`: on a CPU whose
    faster float32 route is oneDNN, the forward pass and both gradients through oneDNN (on a
    2-core AMD EPYC Zen 5 about 2.2x MKL's speed for the encoders' 1,024- and 2,048-wide layers).
    Without autograd, under autocast, on a GPU or within `authors_kernels` it is `nn.Linear`.
    The same parameters and state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not _AUTHORS_KERNELS.get():
            return train_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
