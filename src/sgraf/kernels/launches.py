"""Kernel launches counted without a GPU: the ATen operations a piece of work dispatches.

On a GPU nearly every ATen operation that computes something is one kernel launch (a matmul
one or two, a softmax one, a `copy_` one); views, `detach` and allocations launch nothing. A
`TorchDispatchMode` sees every operation, forward and backward, so counting them on CPU tensors
under the GPU plan (`sgraf.kernels.plan.emulate_gpu`: the block sizes and chunks a CUDA device
would get) gives the operations a scoring block or a training step launches, without a device
(how they compare with a profiler's kernels: below). Two corrections make the CPU's operations
the device's:

- a recurrent layer (`nn.GRU`) is one cuDNN operation forward and one backward on a GPU, while
  the CPU runs it step by step: its operations are counted as one each way;
- tensors that live on the host in the GPU plan (the caption lengths, which the scorer and the
  training step keep on the CPU, and what is computed from them alone) launch nothing; reading
  one (`int(lengths.max())`) does not wait for the device. `LaunchCounter.host(tensor)` marks
  them. Any other read of a value into Python (`.item()`, `bool(t)`, `float(t)`) is a host
  synchronisation on a GPU: counted in `host_reads`.

What this does not see: host-to-device copies of host tensors (a few per step: they are the same
device on a CPU) and kernels an operation launches internally beyond the first (cuDNN's GRU,
split-K matmuls). Figures from it are operation counts, a floor for the launches a profiler sees:
on an H200 (benchmarks/gpu_profile.py) a scoring block's count was within 10 % of the profiler's
kernels at 128 captions, a training step's about half of them (cuDNN's GRU launches a kernel per
time step each way, and copies).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Operations that allocate or only reinterpret memory: no kernel on a GPU.
KERNEL_FREE = {
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten._unsafe_view.default",
    "aten.lift_fresh.default", "aten.set_.source_Storage_storage_offset", "aten.resize_.default",
    "aten.record_stream.default", "aten._reshape_alias.default",
    "profiler._record_function_enter_new.default", "profiler._record_function_exit._RecordFunction",
}
# Operations that read a value into Python: a host synchronisation when the tensor is on a GPU.
HOST_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
# What a recurrent layer counts as on a GPU: cuDNN's forward and backward, one operation each.
RNN_FORWARD, RNN_BACKWARD = "cudnn rnn (emulated)", "cudnn rnn backward (emulated)"


def is_view(func: Any) -> bool:
    """Whether an operation returns views of its inputs (aliases: no kernel)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class LaunchCounter(TorchDispatchMode):
    """Counts the operations that would launch kernels on a GPU, forward and backward.

    Use as a context manager around the work (under `plan.emulate_gpu()` for the GPU's plan).

    Attributes:
        launches: operations counted as kernel launches.
        host_reads: reads of a device value into Python (host synchronisations on a GPU).
        by_op: launches per operation name (the largest tell where they come from).
    """

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.host_reads = 0
        self.by_op: collections.Counter[str] = collections.Counter()
        self.reads_by_op: collections.Counter[str] = collections.Counter()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}   # by id, alive while the tensor is
        self._rnn_depth = 0
        self._hooks: list[Any] = []

    def host(self, *tensors: torch.Tensor) -> None:
        """Mark tensors as living on the host in the GPU plan (what is computed from them alone too)."""
        for tensor in tensors:
            self._host[id(tensor)] = weakref.ref(tensor)

    def _on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def __enter__(self) -> LaunchCounter:
        self._hooks = [nn.modules.module.register_module_forward_pre_hook(self._rnn_enter),
                       nn.modules.module.register_module_forward_hook(self._rnn_exit)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    # a recurrent layer: one operation forward, one backward (between the gradient of its output
    # and the gradient of its input, autograd runs only its own nodes)
    def _rnn_enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not isinstance(module, nn.RNNBase):
            return
        self._rnn_depth += 1
        if args and isinstance(args[0], nn.utils.rnn.PackedSequence):
            self.host(args[0].batch_sizes)          # a packed sequence's batch sizes stay on the CPU
        data = _first_tensor(args)
        if data is not None and data.requires_grad and torch.is_grad_enabled():
            data.register_hook(self._rnn_backward_done)

    def _rnn_exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not isinstance(module, nn.RNNBase):
            return
        self._rnn_depth -= 1
        self._count(RNN_FORWARD)
        data = _first_tensor(args)
        out = _first_tensor(output)
        if out is not None and out.requires_grad and data is not None and data.requires_grad:
            out.register_hook(self._rnn_backward_starts)

    def _rnn_backward_starts(self, grad: torch.Tensor) -> None:
        self._rnn_depth += 1
        self._count(RNN_BACKWARD)

    def _rnn_backward_done(self, grad: torch.Tensor) -> None:
        self._rnn_depth -= 1

    def _count(self, name: str) -> None:
        self.launches += 1
        self.by_op[name] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(self._on_host(t) for t in inputs)
        name = str(func)
        if on_host:
            self.host(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        elif name in HOST_READS:
            self.host_reads += 1
            self.reads_by_op[name] += 1
        elif self._rnn_depth == 0 and name not in KERNEL_FREE and not is_view(func):
            self._count(name)
        if is_view(func) and inputs and self._on_host(inputs[0]):
            self.host(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        return out

    def summary(self, top: int = 8) -> str:
        """One line: launches, host reads and the most frequent operations."""
        ops = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in self.by_op.most_common(top))
        return f"{self.launches} launches, {self.host_reads} host reads ({ops})"


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor of an argument or output (a PackedSequence's data), or None."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, nn.utils.rnn.PackedSequence):
        return value.data
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    return None
