"""A score matrix copied to the host band by band while a GPU scores the rest of it.

`sgraf evaluate` scores the whole (n_images, n_captions) matrix on the device, counts the ranks
there (`sgraf.metrics`) and then needs the matrix on the host only to save it (`--save-sims`) or
to hand it back (`evaluate_checkpoints_with_sims`). Copied after the scoring, as one
`.cpu()`, the copy stood on the command's path: at MSCOCO-5K size it is 500 MB into a fresh
host array, whose pages are faulted in by the copy itself (on a 2-core AMD EPYC Zen 3 the same
copy takes 0.2 s into fresh memory and 0.04 s into memory already touched).

`HostCopy` takes that copy off the path:
- a worker thread allocates the host matrix and touches its pages while the first blocks are
  scored;
- `band(share, rows)` is called by the scorer when every caption of an image block is scored
  (`sgraf.model.blocks.score_encoded`'s `on_rows`); on CUDA it records an event on the scoring
  stream, and the worker copies those rows on a stream of its own once the event has passed, so
  the copy engine runs beside the next blocks' kernels;
- `result(matrix)` waits for the last band and returns the host matrix. Rows no band covered
  (a scorer that calls no `on_rows`, the matrix gathered from several processes) are copied
  then, so the result is always the whole matrix.

The worker copies bands in the order they were scored, one at a time; each band's rows are
written by the scorer before the band is handed over and never again, so the copy reads
finished scores only. On CPU tensors (`sgraf.kernels.plan.emulate_gpu`, the tests) the same
thread copies without streams or events.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch


class HostCopy:
    """The host copy of a float32 (n_rows, n_cols) matrix, made band by band (module docstring).

    Use as a context manager (the worker thread ends on exit), or call `close`.
    """

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self._host: torch.Tensor | None = None
        self._copied = np.zeros(self.shape[0], dtype=bool)
        self._stream: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sgraf-host-copy")
        self._pending: list[Future] = [self._pool.submit(self._allocate)]

    def __enter__(self) -> HostCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _allocate(self) -> None:
        host = torch.empty(self.shape, dtype=torch.float32)
        host.zero_()    # its pages faulted in here, beside the scoring, not during the copy
        self._host = host

    def band(self, share: torch.Tensor, rows: slice) -> None:
        """Queue `share[rows]` (scored, never written again) for copying to the same rows."""
        if tuple(share.shape) != self.shape:
            raise ValueError(f"HostCopy: a band of a {tuple(share.shape)} matrix, expected {self.shape}")
        event = None
        if share.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(share.device))
        self._pending.append(self._pool.submit(self._copy, share, rows, event))

    def _copy(self, share: torch.Tensor, rows: slice, event: Any) -> None:
        assert self._host is not None
        if event is None:
            self._host[rows].copy_(share[rows])
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream(share.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(event)
                # a pageable destination: returns when copied; the scoring stream goes on
                self._host[rows].copy_(share[rows])
        self._copied[rows] = True

    def result(self, matrix: torch.Tensor) -> np.ndarray:
        """The host matrix, once every band is copied; the rows no band covered copied from
        `matrix` (the whole scored matrix) now."""
        if tuple(matrix.shape) != self.shape:
            raise ValueError(f"HostCopy: a {tuple(matrix.shape)} matrix, expected {self.shape}")
        for future in self._pending:
            future.result()
        self._pending = []
        assert self._host is not None
        missing = np.flatnonzero(~self._copied)
        if missing.size == self.shape[0]:
            self._host.copy_(matrix)
        elif missing.size:
            index = torch.from_numpy(missing)
            self._host[index] = matrix[index.to(matrix.device)].cpu()
        self._copied[:] = True
        return self._host.numpy()

    def close(self) -> None:
        """Wait for queued copies (they hold the device matrix) and end the worker."""
        self._pool.shutdown(wait=True)
