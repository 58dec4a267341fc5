"""The caption GRU's training pass on the CPU, with its weight gradients in one matmul each.

`torch.nn.GRU` on the CPU records every time step as separate operations, so its backward
pass computes the weight gradients one time step at a time: at batch 128 that is about 90
small (3H x B_t) @ (B_t x H) matmuls and as many additions into the gradient, plus each gate's
elementwise backward. Here the
input projections of every time step are one matmul forward and one backward, the recurrence
keeps only what backward needs (the gates, the hidden projection of the new gate, the previous
state), and the weight gradients are one matmul each over all the time steps at the end. The
arithmetic is `nn.GRU`'s (PyTorch's GRU cell, gates in the order r, z, n):

    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
    z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = n + z * (h - n)

on `sgraf.kernels.packing.Packing`'s packed rows (time-major, captions sorted by decreasing
length, so that the captions still running at a time step are a prefix of the batch). The
values equal `nn.GRU`'s up to float32 summation order.

Under bf16 autocast the matmuls run in bf16 as autocast runs a linear layer (operands and
product rounded to bf16, the weights once per pass instead of at every time step), and the gates,
the state and the gradients' sums stay in float32, where `nn.GRU` under autocast also rounds
the gates to bf16: its states are closer to a float64 GRU's than `nn.GRU`'s under autocast
(`tests/test_kernels.py`). At the paper's size on a 2-core Intel Xeon with AMX, forward and
backward took 0.30 s against `nn.GRU`'s 0.55 s under autocast (and 0.47 s in float32): its
per-step weight gradients, added into whole-size buffers one time step at a time, were most of it.

At the paper's size (300 -> 1,024, bidirectional, 128 Flickr30K-like captions), 2 threads of a
2-core AMD EPYC Zen 3: forward and backward 0.94 s against `nn.GRU`'s 1.12 s, and a whole SAF
training step at batch 128 8.1 s against 8.6 s (the two timed in turns in one process). Its
matmuls take `sgraf.kernels.cpu`'s measured routes (oneDNN where it is the faster: about 2x
MKL's speed for these shapes on an AMD EPYC Zen 5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sgraf import torch_compat
from sgraf.kernels import plan
from sgraf.kernels.cpu import fast_linear, linear_add, weight_gradient


def packed_gru(gru: nn.GRU, packed: torch.Tensor, batch_sizes: list[int]) -> torch.Tensor:
    """A one-layer `nn.GRU` (batch-first or not) on packed rows: (N, I) -> (N, H or 2H).

    Args:
        gru: the module; its weights are used, it is not called.
        packed: the packed input rows (a `PackedSequence`'s data).
        batch_sizes: captions still running at each time step, non-increasing (host ints).

    Returns:
        the packed output rows, the reverse direction's half second for a bidirectional GRU:
        `gru(PackedSequence(packed, batch_sizes, ...))[0].data` up to rounding.
    """
    suffixes = ["", "_reverse"] if gru.bidirectional else [""]
    low = _autocast_dtype()
    outputs = []
    for suffix in suffixes:
        weights = [getattr(gru, f"{name}_l0{suffix}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        outputs.append(_PackedGRU.apply(packed, *weights, batch_sizes, suffix == "_reverse", low))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def supports(gru: nn.GRU, packed: torch.Tensor) -> bool:
    """Whether `packed_gru` covers this GRU and input: one layer with biases, float32 CPU
    tensors outside the GPU plan (`sgraf.kernels.plan`), autocast off or in bf16 (elsewhere
    `nn.GRU` runs as it is)."""
    return (gru.num_layers == 1 and gru.bias and packed.device.type == "cpu" and not plan.gpu_plan(packed.device)
            and packed.dtype == torch.float32 and gru.weight_hh_l0.dtype == torch.float32
            and _autocast_dtype() in (None, torch.bfloat16) and gru.proj_size == 0)


def _autocast_dtype() -> torch.dtype | None:
    """The CPU's autocast dtype, or None with autocast off."""
    return torch_compat.autocast_dtype("cpu") if torch_compat.autocast_enabled("cpu") else None


def _steps(batch_sizes: list[int], reverse: bool) -> list[tuple[int, int]]:
    """(first packed row, captions running) of each time step, in the order the pass runs them."""
    starts, start = [], 0
    for size in batch_sizes:
        starts.append((start, size))
        start += size
    return starts[::-1] if reverse else starts


class _PackedGRU(torch.autograd.Function):
    """One direction of a one-layer GRU over packed rows (see the module)."""

    @staticmethod
    def forward(ctx: Any, packed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor,
                b_hh: torch.Tensor, batch_sizes: list[int], reverse: bool, low: torch.dtype | None) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return _forward(ctx, packed, w_ih, w_hh, b_ih, b_hh, batch_sizes, reverse, low)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*_backward(ctx, grad_out), None, None, None)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, low: torch.dtype | None) -> torch.Tensor:
    """`x @ weight^T + bias` in float32, or as autocast computes a linear layer in `low` (the
    operands and the product rounded to `low`) and widened back to float32."""
    if low is None:
        return fast_linear(x, weight, bias)
    return fast_linear(x.to(low), weight, bias).float()


def _weight_gradient(rows: torch.Tensor, inputs: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """`rows^T inputs` in float32, or as autocast's matmuls give a weight's gradient: in `low`,
    widened to float32."""
    if low is None:
        return weight_gradient(rows, inputs)
    return weight_gradient(rows.to(low), inputs.to(low)).float()


def _forward(ctx: Any, packed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor,
             b_hh: torch.Tensor, batch_sizes: list[int], reverse: bool, low: torch.dtype | None) -> torch.Tensor:
    hidden = w_hh.size(1)
    steps = _steps(batch_sizes, reverse)
    # in bf16 the weights are rounded once, not at every time step
    w_ih_c, w_hh_c = (w_ih, w_hh) if low is None else (w_ih.to(low), w_hh.to(low))
    input_gates = _matmul(packed, w_ih_c, b_ih, low)                       # (N, 3H), every step at once
    n_rows = packed.size(0)
    # what backward needs, row by row: r, z, n, W_hn h + b_hn, and the previous state h
    saved = packed.new_empty(5, n_rows, hidden)
    reset, update, new, hidden_new, previous = saved.unbind(0)
    out = packed.new_empty(n_rows, hidden)
    state = packed.new_zeros(max(batch_sizes, default=0), hidden)
    for start, size in steps:
        rows = slice(start, start + size)
        h = state[:size]
        gates = _matmul(h, w_hh_c, b_hh, low)                                 # (B_t, 3H)
        i_r, i_z, i_n = input_gates[rows].split(hidden, dim=1)
        h_r, h_z, h_n = gates.split(hidden, dim=1)
        r = torch.sigmoid(i_r + h_r, out=reset[rows])
        z = torch.sigmoid(i_z + h_z, out=update[rows])
        n = torch.tanh(torch.addcmul(i_n, r, h_n), out=new[rows])
        hidden_new[rows] = h_n
        previous[rows] = h
        h_next = torch.addcmul(n, z, h - n, out=out[rows])
        state[:size] = h_next
    ctx.save_for_backward(packed, w_ih_c, w_hh_c, saved)
    ctx.batch_sizes, ctx.reverse, ctx.low = batch_sizes, reverse, low
    return out


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    packed, w_ih, w_hh, saved = ctx.saved_tensors
    low = ctx.low
    reset, update, new, hidden_new, previous = saved.unbind(0)
    hidden = w_hh.size(1)
    n_rows = packed.size(0)
    grad_input_gates = packed.new_empty(n_rows, 3 * hidden)
    grad_hidden_gates = packed.new_empty(n_rows, 3 * hidden)
    grad_state = packed.new_zeros(max(ctx.batch_sizes, default=0), hidden)
    grad_out = grad_out.contiguous()
    # (H, 3H); in bf16 rounded once, as in the forward pass, not at every time step
    w_hh_t = (w_hh if low is None else w_hh.to(low)).t().contiguous()
    for start, size in reversed(_steps(ctx.batch_sizes, ctx.reverse)):
        rows = slice(start, start + size)
        dh = grad_state[:size] + grad_out[rows]
        r, z, n, h_n, h = reset[rows], update[rows], new[rows], hidden_new[rows], previous[rows]
        d_ir, d_iz, d_in = grad_input_gates[rows].split(hidden, dim=1)
        d_hr, d_hz, d_hn = grad_hidden_gates[rows].split(hidden, dim=1)
        # h' = n + z (h - n): dn = dh (1 - z), dz = dh (h - n); tanh' = 1 - n^2
        torch.mul(dh * (1 - z), 1 - n * n, out=d_in)
        torch.mul(dh * (h - n), z * (1 - z), out=d_iz)
        torch.mul(d_in * h_n, r * (1 - r), out=d_ir)
        d_hr.copy_(d_ir)
        d_hz.copy_(d_iz)
        torch.mul(d_in, r, out=d_hn)
        if low is None:
            grad_state[:size] = linear_add(grad_hidden_gates[rows], w_hh_t, dh * z)
        else:
            grad_state[:size] = _matmul(grad_hidden_gates[rows], w_hh_t, None, low).add_(dh * z)
    needs = ctx.needs_input_grad
    grad_packed = _matmul(grad_input_gates, w_ih.t().contiguous(), None, low) if needs[0] else None
    grad_w_ih = _weight_gradient(grad_input_gates, packed, low) if needs[1] else None
    grad_w_hh = _weight_gradient(grad_hidden_gates, previous, low) if needs[2] else None
    grad_b_ih = grad_input_gates.sum(dim=0) if needs[3] else None
    grad_b_hh = grad_hidden_gates.sum(dim=0) if needs[4] else None
    return grad_packed, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh
