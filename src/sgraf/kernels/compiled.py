"""`torch.compile` (Inductor) over fixed-shape pieces of work: opt-in, but for the CPU's bf16 word nodes.

A compiled function is specialised to the shapes it is called with: scoring a split whose
captions have every length from 1 to 60 would compile one graph per length and per chunk size.
So the compiled path pads what it hands the compiler: caption widths rounded up to a multiple of
`WIDTH_STEP` words (`bucket_width`), and each eval chunk padded to the full images x captions
of the chunk grid (see `sgraf.kernels.eval_chunks`). A split then compiles one graph per width
bucket (at most `max_width / WIDTH_STEP` of them, per precision), and a second split of the same
widths compiles nothing. Padded words are masked like the padding of a caption; padded images
and captions are scored and dropped.

Inside a compiled graph the CPU's float32 matmuls take PyTorch's own route, not oneDNN called
directly (`sgraf.kernels.cpu`: Inductor lowers oneDNN's linear only with constant weights, and
ours are graph inputs, so one compiled graph serves any weights: validation after every epoch
compiles nothing new). Graphs are compiled whole (`fullgraph=True`): a graph break is an error,
not a silent second graph.

Two pieces of work can run compiled:

- `eval`: the eval scoring chunks (`SGRAF.score`, `sgraf evaluate`, the search index);
- `train`: a training step's selected pairs (`sgraf.training.pairs`), scored with autograd and
  differentiated: forward and backward are compiled together (AOTAutograd), so one graph
  replaces a few hundred operations each way. Their count is padded to the loss's bound
  (`sgraf.model.loss.max_pairs`, 3B at batch B: fixed for a batch size) and their width rounded
  up like the eval chunks' (each of the CPU's length groups to its own bucket), so a run
  compiles a graph per width bucket it meets and then nothing.
  Also under `train`: the bf16 (fp16) word nodes' elementwise passes
  (`sgraf.kernels.nodes._LowPrecisionLocalNodes`), each chain one fused loop (`elementwise`,
  dynamic shapes: compiled once for every chunk size), with the same bits as the eager passes.

On a 2-core AMD EPYC (Zen 3) the compiled scoring chunk is no faster than the eager one (the
matmuls dominate, and the eager path already writes its elementwise work in place;
`benchmarks/bench_compile.py`), and SGR's compiled pairs were no faster in fp32 either, so
those stay opt-in. The bf16 word nodes' fused passes are not: on a 2-core Intel Xeon with AMX,
where bf16 matmuls are fast and those passes are half of the nodes' backward, they made a SAF
bf16 step 1.2x and an SGR bf16 step 1.13x faster for about 20 s of compiling once per process
(`benchmarks/results/train-bf16-fused-nodes-auto-*`). So the default, `auto`, fuses them on the
CPU for chunks of at least `AUTO_ELEMENTWISE_MIN` (word x feature) values (`fuses_word_nodes`)
where PyTorch can compile (`COMPILE_MIN`) and a C++ compiler is found, and runs them eagerly if
compiling fails (one warning; the eager passes give the same bits); nothing else is compiled.
`SGRAF_COMPILE` sets it: `off` for nothing, `eval` (or `on`) for scoring, `train` for the
training pairs and the word nodes at any size, `all` for both; `compiling(mode)` does so within
a block of code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

from sgraf import torch_compat
from sgraf.errors import InputError

MODES = ("off", "eval", "train", "all", "auto")
# caption widths (words) are rounded up to a multiple of this in compiled graphs
WIDTH_STEP = 8
# the most captions in one compiled eval chunk (a scorer's caption bucket holds 128)
MAX_CHUNK_CAPTIONS = 128
# graphs one compiled function may hold (Dynamo's `recompile_limit` is raised to this at the
# first compilation): widths up to 8 x 64 words, for a few precisions and kinds of model
RECOMPILE_LIMIT = 64
# the compiler behind `compiled`: Inductor (a test counting graphs may take "aot_eager", which
# traces and guards alike without generating code)
BACKEND = "inductor"
# under `auto`, the bf16 (fp16) word nodes' passes are fused for chunks of at least this many
# (image, caption, word, feature) values: a paper-size training chunk holds about 16 million
# (128 images x 120 word slots x 1,024); a chunk this small spends about 4 ms per eager pass
AUTO_ELEMENTWISE_MIN = 2**22

logger = logging.getLogger(__name__)

_override: list[str] = []         # the innermost `compiling(...)`; process-wide (scorers use threads)
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}


def variable_mode() -> str:
    """The mode `SGRAF_COMPILE` names ('auto' when unset), whether or not this platform compiles.

    Raises:
        InputError: a value that names no mode.
    """
    setting = os.environ.get("SGRAF_COMPILE", "").strip().lower()
    aliases = {"": "auto", "0": "off", "false": "off", "no": "off", "1": "eval", "on": "eval", "true": "eval",
               "yes": "eval"}
    setting = aliases.get(setting, setting)
    if setting not in MODES:
        raise InputError(f"SGRAF_COMPILE must be one of off, on, {', '.join(MODES[1:])}, got "
                         f"{os.environ['SGRAF_COMPILE']!r}")
    return setting


def mode() -> str:
    """One of `MODES`: the `compiling` context's mode, else `SGRAF_COMPILE` (default 'auto')."""
    if _override:
        return _override[-1]
    setting = variable_mode()
    if setting not in ("off", "auto"):
        _check_supported(f"SGRAF_COMPILE={os.environ['SGRAF_COMPILE'].strip()}")
    return setting


def _check_supported(what: str) -> None:
    if not torch_compat.compile_supported():
        import torch

        raise InputError(f"{what} needs PyTorch {'.'.join(map(str, torch_compat.COMPILE_MIN))} or later "
                         f"(this is {torch.__version__}, whose compiler cannot trace sgraf's compiled paths)")


def eval_enabled() -> bool:
    """Whether eval scoring chunks run compiled."""
    return mode() in ("eval", "all")


def train_enabled() -> bool:
    """Whether a training step's selected pairs run compiled (`sgraf.kernels.train_chunks.pair_scores`)."""
    return mode() in ("train", "all")


def fuses_word_nodes(elements: int, cpu_plan: bool) -> bool:
    """Whether a training chunk's bf16 (fp16) word nodes run their elementwise passes fused
    (`elementwise`): always under `train` and `all`; under `auto` on the CPU plan for a chunk of
    at least `AUTO_ELEMENTWISE_MIN` (word x feature) values, where this PyTorch compiles, a C++
    compiler is found and no compilation has failed in this process."""
    setting = mode()
    if setting in ("train", "all"):
        return True
    return setting == "auto" and cpu_plan and elements >= AUTO_ELEMENTWISE_MIN and _auto_compiles()


_auto_failed: list[str] = []      # why compiling failed under `auto`, once it has: eager from then on
_auto_announced: list[bool] = []  # whether `auto`'s first compilation has been logged


def _auto_compiles() -> bool:
    return not _auto_failed and torch_compat.compile_supported() and _cxx_found()


def _cxx_found() -> bool:
    """Whether Inductor's C++ compiler is on the path (`$CXX`, else g++, as Inductor looks)."""
    return shutil.which(os.environ.get("CXX") or "g++") is not None


@contextlib.contextmanager
def compiling(setting: str = "eval") -> Iterator[None]:
    """Within this context the compiled path's mode is `setting` (one of `MODES`), whatever
    `SGRAF_COMPILE` says. Process-wide (a scorer's worker threads follow it); not for use from
    several threads at once."""
    if setting not in MODES:
        raise ValueError(f"compile mode must be one of {', '.join(MODES)}, got {setting!r}")
    if setting not in ("off", "auto"):
        _check_supported(f"compiling({setting!r})")
    _override.append(setting)
    try:
        yield
    finally:
        _override.pop()


def bucket_width(n_words: int) -> int:
    """`n_words` rounded up to a multiple of `WIDTH_STEP`: the caption width a compiled graph sees."""
    return max(1, -(-int(n_words) // WIDTH_STEP)) * WIDTH_STEP


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled by Inductor (`torch.compile(dynamic=False, fullgraph=True)`, `BACKEND`),
    once per process: every call with new shapes, dtypes or configuration compiles a new graph
    (counted in `torch._dynamo.utils.counters["stats"]["unique_graphs"]`)."""
    found = _compiled.get(function)
    if found is None:
        found = _compiled[function] = _first_calls_serialised(_torch_compile(function, dynamic=False))
    return found


def elementwise(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, a chain of elementwise operations, compiled by Inductor with dynamic shapes
    (`torch.compile(dynamic=True, fullgraph=True)`, `BACKEND`), once per process: one graph
    serves every shape of the same rank and dtypes, so a training run's chunks of every size
    compile it once. Inductor fuses the chain into one loop over the tensors (on a CPU, C++)."""
    found = _compiled.get(function)
    if found is None:
        found = _compiled[function] = _eager_if_auto_fails(function, _torch_compile(function, dynamic=True))
    return found


def _eager_if_auto_fails(function: Callable[..., Any], graph: Callable[..., Any]) -> Callable[..., Any]:
    """`graph`, or under `auto` once compiling has failed, `function` itself (the same values):
    the default must not stop a run on a machine that cannot compile. Under `train` and `all`,
    which ask for the compiler, its error is raised."""
    def call(*args: Any) -> Any:
        auto = mode() == "auto"
        if auto and _auto_failed:
            return function(*args)
        if auto and not _auto_announced:   # the first step pauses while Inductor compiles: say why
            _auto_announced.append(True)
            logger.info("compiling the bf16 word nodes' fused passes (once per process, some seconds; "
                        "SGRAF_COMPILE=off runs them eagerly)")
        try:
            return graph(*args)
        except Exception as error:   # noqa: BLE001 (any compiler failure: no C++ compiler, a crash)
            if not auto:
                raise
            first_line = (str(error).strip().splitlines() or [""])[0]
            _auto_failed.append(f"{type(error).__name__}: {first_line}")
            logger.warning("could not compile the bf16 word nodes' passes (%s); they run eagerly, with the same "
                           "values (SGRAF_COMPILE=off skips compiling)", _auto_failed[0])
            return function(*args)

    return call


def _torch_compile(function: Callable[..., Any], dynamic: bool) -> Callable[..., Any]:
    """`torch.compile(function, fullgraph=True)` on `BACKEND`, Dynamo's graph limit raised first."""
    import torch   # torch.compile imports its compiler stack at first use, not with sgraf
    import torch._dynamo

    # Dynamo keeps at most `recompile_limit` graphs per function (8 by default), then fails
    # under fullgraph: one function serves every width, precision and kind of model here
    torch_compat.raise_recompile_limit(RECOMPILE_LIMIT)
    return torch.compile(function, dynamic=dynamic, fullgraph=True, backend=BACKEND)


def _first_calls_serialised(graph: Callable[..., Any]) -> Callable[..., Any]:
    """`graph` with its first call for each kind of input (shapes, strides, dtypes, other values)
    made under a lock: a scorer's worker threads meeting a new shape at once would each compile
    it (Dynamo looks for a compiled graph before it takes its own lock)."""
    lock = threading.Lock()
    seen: set[Any] = set()

    def call(*args: Any) -> Any:
        key = _signature(args)
        if key in seen:
            return graph(*args)
        with lock:
            result = graph(*args)
            seen.add(key)
        return result

    return call


def _signature(value: Any) -> Any:
    """What a compiled graph is specialised to in `value`: tensors by shape, strides and dtype,
    containers item by item, modules by identity, plain values as they are."""
    if hasattr(value, "shape") and hasattr(value, "stride"):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_signature(item) for item in value))
    if isinstance(value, dict):
        return ("dict", *((key, _signature(item)) for key, item in value.items()))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return ("object", id(value), str(value) if not hasattr(value, "forward") else "")


def padded_count(n: int) -> int:
    """`n` rounded up to a power of two: the images or captions of a GPU-plan block in a compiled
    graph (a block is one chunk there; rounding keeps its shapes to a handful), and the filtration
    kernel's block sizes (`sgraf.kernels.filtration`)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad_to(tensor: Any, size: int, dim: int = 0) -> Any:
    """`tensor` extended with zeros (False for bool) along `dim` to `size`, contiguous (a graph is
    specialised to its inputs' strides too: a slice of a larger block would compile another)."""
    missing = size - tensor.size(dim)
    if missing <= 0:
        return tensor.contiguous()
    import torch

    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
