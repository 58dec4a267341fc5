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

Given a `file`, the worker also writes the matrix there as a `.npy` of its dtype (the bytes
`np.save` writes): the header first, each band at its rows' offset once copied, and a
`fdatasync` after each, so that saving the matrix (`sgraf evaluate --save-sims`: 500 MB written
and synced, 0.38 s of an MSCOCO-size run on the H100; an ensemble's float64 matrix is 1 GB) is
done beside the scoring too, and the final sync of the caller's atomic write
(`sgraf.atomic_write.atomic_path`) has little left to flush.

The worker copies bands in the order they were scored, one at a time; each band's rows are
written by the scorer before the band is handed over and never again, so the copy reads
finished scores only. On CPU tensors (`sgraf.kernels.plan.emulate_gpu`, the tests) the same
thread copies without streams or events.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

_SEEK_WRITE = threading.Lock()   # where os.pwrite is missing, a seek and a write go together


class HostCopy:
    """The host copy of a (n_rows, n_cols) matrix of `dtype` (float32: one model's scores; float64:
    an ensemble's), made band by band (module docstring).

    Use as a context manager (the worker thread ends on exit), or call `close`.
    """

    def __init__(self, shape: tuple[int, int], file: str | os.PathLike[str] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self._host: torch.Tensor | None = None
        self._copied = np.zeros(self.shape[0], dtype=bool)
        self._stream: Any = None
        self._fd: int | None = None
        self._offset = 0                    # of the first row in `file`: its header's length
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sgraf-host-copy")
        self._pending: list[Future] = [self._pool.submit(self._allocate, file)]

    def __enter__(self) -> HostCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _allocate(self, file: str | os.PathLike[str] | None) -> None:
        host = torch.empty(self.shape, dtype=self.dtype)
        if file is not None:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(host.numpy().dtype),
                                                          "fortran_order": False, "shape": self.shape})
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)   # Windows: no newline bytes
            self._fd = os.open(file, flags, 0o666)
            self._write(header.getvalue(), 0)
            self._offset = len(header.getvalue())
        host.zero_()    # its pages faulted in here, beside the scoring, not during the copy
        self._host = host

    def _write(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            if hasattr(os, "pwrite"):
                written = os.pwrite(self._fd, view, offset)     # type: ignore[arg-type]
            else:                           # Windows: no pwrite; one writer at a time moves the position
                with _SEEK_WRITE:
                    os.lseek(self._fd, offset, os.SEEK_SET)
                    written = os.write(self._fd, view)
            view, offset = view[written:], offset + written

    def _save(self, rows: slice) -> None:
        """Write `rows` of the host matrix to the file at their offset and sync them."""
        if self._fd is None:
            return
        assert self._host is not None
        row_bytes = self.shape[1] * self._host.element_size()
        self._write(self._host[rows].numpy(), self._offset + rows.start * row_bytes)
        try:
            getattr(os, "fdatasync", os.fsync)(self._fd)     # macOS and Windows: fsync
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENOTSUP):    # file systems that cannot sync
                raise

    def band(self, share: torch.Tensor, rows: slice) -> None:
        """Queue `share[rows]` (scored, never written again) for copying to the same rows."""
        if tuple(share.shape) != self.shape or share.dtype != self.dtype:
            raise ValueError(f"HostCopy: a band of a {tuple(share.shape)} {share.dtype} matrix, expected {self.shape} "
                             f"{self.dtype}")
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
        self._save(rows)

    def result(self, matrix: torch.Tensor) -> np.ndarray:
        """The host matrix, once every band is copied; the rows no band covered copied from
        `matrix` (the whole scored matrix) now."""
        if tuple(matrix.shape) != self.shape or matrix.dtype != self.dtype:
            raise ValueError(f"HostCopy: a {tuple(matrix.shape)} {matrix.dtype} matrix, expected {self.shape} "
                             f"{self.dtype}")
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
        if missing.size:       # the runs of rows no band covered, to the file
            breaks = np.flatnonzero(np.diff(missing) != 1) + 1
            for run in np.split(missing, breaks):
                self._save(slice(int(run[0]), int(run[-1]) + 1))
        return self._host.numpy()

    def close(self) -> None:
        """Wait for queued copies (they hold the device matrix), end the worker, close the file."""
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
