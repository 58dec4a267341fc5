"""Small helpers for running on several processes with ``torchrun``.

``torchrun`` (``python -m torch.distributed.run``) starts one process per device and sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. `init_from_env`
reads them and joins the process group (NCCL with CUDA, gloo on CPU); without them everything
here degrades to a single process, so library code can call these helpers unconditionally.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sgraf.devices import resolve_device
from sgraf.errors import InputError

logger = logging.getLogger(__name__)

# How long a process waits for the others of its torchrun job to join the process group
# (`SGRAF_JOIN_TIMEOUT`, seconds): environment variables left from another job, or a process of
# this one that died, would otherwise keep it waiting without end.
JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank among `world_size` and the device it should use."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when the ``torchrun`` environment variables are present."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(device: str | torch.device | None = None, backend: str | None = None,
                  what: str = "device") -> DistInfo:
    """Join the process group described by the ``torchrun`` environment, if any.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or None (CUDA when available),
            checked by `sgraf.devices.resolve_device`. Under torchrun each process takes the
            CUDA device of its ``LOCAL_RANK``.
        backend: process-group backend; default NCCL for CUDA, gloo for CPU.
        what: how the caller's user named the device setting, for error messages.

    Returns:
        This process's `DistInfo` (rank 0 of 1 when not launched by torchrun).

    Raises:
        InputError: a device this machine cannot use, or a ``LOCAL_RANK`` without its GPU.
    """
    target = resolve_device(device, what=what)
    use_cuda = target.type == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        index = local_rank if launched_by_torchrun() else (target.index or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"LOCAL_RANK {index} has no CUDA device: this machine has "
                             f"{torch.cuda.device_count()}; start at most that many processes per node")
        torch.cuda.set_device(index)
        target = torch.device("cuda", index)
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        _join(backend or ("nccl" if use_cuda else "gloo"), target)
        logger.debug("joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(),
                     dist.get_backend())
    return DistInfo(rank=get_rank(), world_size=get_world_size(), local_rank=local_rank, device=target)


JOIN_NOTICE_S = 10.0    # after this long waiting to join, a warning says so (on every rank)


def join_timeout() -> float:
    """`SGRAF_JOIN_TIMEOUT` (seconds, > 0), else `JOIN_TIMEOUT_S`."""
    given = os.environ.get("SGRAF_JOIN_TIMEOUT")
    if given is None:
        return JOIN_TIMEOUT_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InputError(f"SGRAF_JOIN_TIMEOUT must be a number of seconds > 0, got {given!r}")
    return seconds


def _join(backend: str, device: torch.device) -> None:
    """`dist.init_process_group` from the torchrun environment, bounded by `join_timeout()` and
    interruptible: the rendezvous waits in another thread while this one stays where SIGINT and
    SIGTERM are handled (a wait inside PyTorch's C++ defers them without end)."""
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    seconds = join_timeout()
    logger.info("joining the %s processes of the torchrun job at %s as rank %s (at most %.0f s; "
                "SGRAF_JOIN_TIMEOUT sets it)", world, where, rank, seconds)
    failure: list[BaseException] = []

    def join() -> None:
        try:
            if device.type == "cuda":     # the current CUDA device is per thread: this one's too
                torch.cuda.set_device(device)
            dist.init_process_group(backend=backend)
        except BaseException as error:  # noqa: BLE001  (raised again in the caller's thread)
            failure.append(error)

    thread = threading.Thread(target=join, name="sgraf-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    said = False
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive() and not said and time.monotonic() > deadline - seconds + JOIN_NOTICE_S:
            said = True     # a WARNING: the INFO above is not shown on ranks other than 0
            logger.warning("still waiting for the other %d processes of the torchrun job at %s (rank %s; at most "
                           "%.0f s, SGRAF_JOIN_TIMEOUT sets it; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left "
                           "from another job?)", int(world) - 1, where, rank, seconds)
        if thread.is_alive() and time.monotonic() > deadline:
            raise InputError(f"the torchrun job's process group at {where} did not form within {seconds:.0f} s: this "
                             f"process is rank {rank} of WORLD_SIZE={world} and the others did not join; start every "
                             "process with torchrun, or unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (left "
                             "from another job?) to run alone")
    if failure:
        raise failure[0]


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Wait for every process (no-op on one process)."""
    if is_distributed():
        dist.barrier()


def cleanup(barrier: bool = True) -> None:
    """Leave the process group, if one was joined, once every process has reached this point.

    Without the barrier a process that finished first could tear its gloo connections down
    while another still used them, and gloo then aborted that process now and then. A process
    leaving on an error (`barrier=False`) does not wait there: the others wait in a collective it
    will never join, so the job would hang without a word (up to the backend's 30-minute timeout);
    it leaves, and torchrun stops the others.
    """
    if dist.is_available() and dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def shard_range(n_items: int, rank: int | None = None, world_size: int | None = None) -> range:
    """The contiguous share ``[start, stop)`` of `n_items` that `rank` handles (sizes differ by <= 1)."""
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    return range(n_items * rank // world_size, n_items * (rank + 1) // world_size)


def communication_device() -> torch.device:
    """Where the process group's collectives take their tensors: the current CUDA device under
    NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_variable(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Gather from every process a tensor whose FIRST dimension may differ between processes.

    The other dimensions and the dtype must agree. Returns the list ordered by rank, on the
    input's device (on one process: ``[tensor]``).
    """
    if not is_distributed():
        return [tensor]
    comm_device = communication_device()
    local = tensor.detach().to(comm_device).contiguous()
    sizes = [torch.zeros(1, dtype=torch.int64, device=comm_device) for _ in range(get_world_size())]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], dtype=torch.int64, device=comm_device))
    sizes = [int(size.item()) for size in sizes]
    longest = max(sizes)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [part[:size].to(tensor.device) for part, size in zip(gathered, sizes)]


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """`all_gather_variable` concatenated along the first dimension, in rank order."""
    parts = all_gather_variable(tensor)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def all_reduce_mean(value: float) -> float:
    """Mean of a Python number over processes (the number itself on one process)."""
    if not is_distributed():
        return float(value)
    comm_device = communication_device()
    total = torch.tensor([float(value)], dtype=torch.float64, device=comm_device)
    dist.all_reduce(total)
    return float(total.item()) / get_world_size()
