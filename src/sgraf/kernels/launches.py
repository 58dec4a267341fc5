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

The counter also weighs each launch (`traffic=True`): the bytes it moves (every tensor it reads
and every tensor it writes, each element once: a broadcast operand counts its own elements) and,
for a matmul, its floating-point operations. Charged to the place in sgraf's code that called it,
this gives a roofline of the work on a given GPU (`Traffic.floor_seconds`): no kernel moves its
bytes faster than the memory's bandwidth or does its arithmetic faster than the chip's peak, so
the sum of each launch's larger bound is the least time the work can take as written. Where a
profiler measured more, the gap is the kernels' inefficiency; where the floor itself is high,
only fewer bytes (fusion, fewer casts and copies) or fewer operations bring it down. A
recurrent layer's launches are counted but not weighed (the CPU runs it step by step, not as
cuDNN's kernel), so the weights serve scoring blocks, which have none.

What this does not see: host-to-device copies of host tensors (a few per step: they are the same
device on a CPU) and kernels an operation launches internally beyond the first (cuDNN's GRU,
split-K matmuls). Figures from it are operation counts, a floor for the launches a profiler sees:
on an H200 (benchmarks/gpu_profile.py) a scoring block's count was within 10 % of the profiler's
kernels at 128 captions, a training step's about half of them (cuDNN's GRU launches a kernel per
time step each way, and copies).
"""

from __future__ import annotations

import collections
import os
import sys
import weakref
from dataclasses import dataclass, field
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
# Matmuls: (operand index of the left matrix, of the right one); 2 M K N operations (times the batch)
MATMULS = {"aten.mm.default": (0, 1), "aten.addmm.default": (1, 2), "aten.bmm.default": (0, 1),
           "aten.baddbmm.default": (1, 2), "aten._addmm_activation.default": (1, 2)}
# ... and their forms writing into a given tensor (`out=`: the float32 word nodes' tiles)
MATMULS.update({name.replace(".default", ".out"): operands for name, operands in MATMULS.items()})
OUTSIDE = "(outside sgraf)"
SKIPPED_FILES = (os.sep + "launches.py", os.sep + os.path.join("kernels", "cpu.py"))
SGRAF_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NVIDIA H100 SXM5 80 GB, as specified (dense, no sparsity): HBM3 bytes/s, and operations/s of the
# tensor cores in bf16 and of the CUDA cores in float32 (TF32 off, as sgraf runs)
H100 = {"bandwidth": 3.35e12, "bf16": 989e12, "fp32": 67e12}


@dataclass(frozen=True)
class Launch:
    """One weighed launch: where it was called, the operation, its bytes and matmul operations."""

    place: str
    name: str
    bytes: float
    flops: float
    low: bool          # reads a 16-bit float tensor (a matmul then runs on the tensor cores)

    def seconds(self, gpu: dict[str, float]) -> float:
        """Its roofline floor: bytes at the memory's bandwidth or operations at its dtype's peak."""
        return max(self.bytes / gpu["bandwidth"], self.flops / gpu["bf16" if self.low else "fp32"])


@dataclass
class Traffic:
    """The weighed launches of a piece of work, in order; totals and a roofline floor on a GPU."""

    launches: list[Launch] = field(default_factory=list)

    @property
    def bytes(self) -> float:
        return sum(launch.bytes for launch in self.launches)

    @property
    def flops(self) -> float:
        return sum(launch.flops for launch in self.launches)

    def floor_seconds(self, gpu: dict[str, float] = H100) -> float:
        """The least time the launches take on `gpu` (each launch's larger bound, summed)."""
        return sum(launch.seconds(gpu) for launch in self.launches)

    def by_place(self, gpu: dict[str, float] = H100) -> list[tuple[str, float, list[Launch]]]:
        """(place, floor seconds, its launches), the largest floor first."""
        places: dict[str, list[Launch]] = {}
        for launch in self.launches:
            places.setdefault(launch.place, []).append(launch)
        rows = [(place, sum(launch.seconds(gpu) for launch in launches), launches)
                for place, launches in places.items()]
        return sorted(rows, key=lambda row: -row[1])

    def extrapolated(self, other: Traffic, factor: float) -> Traffic:
        """`self + factor (other - self)`, launch by launch: the work at another size, from two sizes
        between which every launch's bytes and operations grow in proportion (a scoring block's
        images). Both must have launched the same operations in the same order."""
        if [(a.place, a.name) for a in self.launches] != [(b.place, b.name) for b in other.launches]:
            raise ValueError("the two pieces of work launched different operations")
        return Traffic([Launch(a.place, a.name, a.bytes + factor * (b.bytes - a.bytes),
                               a.flops + factor * (b.flops - a.flops), a.low)
                        for a, b in zip(self.launches, other.launches)])

    def summary(self, top: int = 6, gpu: dict[str, float] = H100) -> str:
        """Lines: the totals and the floor, then the places with the largest floors (their three
        heaviest operations by bytes)."""
        lines = [f"{len(self.launches)} launches, {self.bytes / 1e9:.2f} GB moved, {self.flops / 1e12:.2f} TFLOP "
                 f"in matmuls, floor {self.floor_seconds(gpu) * 1e3:.1f} ms"]
        for place, seconds, launches in self.by_place(gpu)[:top]:
            ops: collections.Counter = collections.Counter()
            for launch in launches:
                ops[launch.name.removeprefix("aten.").split(".")[0]] += launch.bytes
            heaviest = ", ".join(f"{name} {moved / 1e9:.2f} GB" for name, moved in ops.most_common(3))
            lines.append(f"  {place}: {seconds * 1e3:.1f} ms, {len(launches)} launches, "
                         f"{sum(launch.bytes for launch in launches) / 1e9:.2f} GB ({heaviest}), "
                         f"{sum(launch.flops for launch in launches) / 1e12:.2f} TFLOP")
        return "\n".join(lines)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view addresses (a broadcast dimension, stride 0,
    once)."""
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            count *= size
    return count * tensor.element_size() if tensor.numel() else 0


def matmul_flops(name: str, args: tuple[Any, ...]) -> int:
    """2 M K N (times the batch) for the matmuls in `MATMULS`, else 0."""
    operands = MATMULS.get(name)
    if operands is None:
        return 0
    left, right = args[operands[0]], args[operands[1]]
    return 2 * left.numel() * right.shape[-1]


def place() -> str:
    """`module.function` of the innermost frame in sgraf's code outside this module and the
    shared matmul helpers of `sgraf.kernels.cpu` (so a linear layer is charged to its caller),
    or OUTSIDE when there is none (autograd's backward, optimiser internals, a caller's own
    operations)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(SGRAF_ROOT) and not filename.endswith(SKIPPED_FILES):
            module = os.path.relpath(filename, SGRAF_ROOT)[:-3].replace(os.sep, ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return OUTSIDE


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
        traffic: with `traffic=True`, every launch's place, bytes and matmul operations (`Traffic`);
            else None.
    """

    def __init__(self, traffic: bool = False) -> None:
        super().__init__()
        self.traffic = Traffic() if traffic else None
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

    def _weigh(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Add one launch's bytes (its tensor arguments read, its outputs written; an `out=`
        argument only written) and matmul operations to `traffic`."""
        read = [t for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
                if isinstance(t, torch.Tensor)]
        written = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(tensor_bytes(t) for t in read) + sum(tensor_bytes(t) for t in written)
        low = any(t.dtype in (torch.bfloat16, torch.float16) for t in read)
        self.traffic.launches.append(Launch(place(), name, moved, matmul_flops(name, args), low))

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
            if self.traffic is not None:
                self._weigh(name, args, kwargs or {}, out)
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
