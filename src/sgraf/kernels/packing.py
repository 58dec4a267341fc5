"""Packing captions for the GRU with one gather instead of one copy per time step.

`torch.nn.utils.rnn.pack_padded_sequence` and `pad_packed_sequence` copy one time step at a
time, forward and backward: at batch 128 and captions of up to 40 tokens that is about 180
kernel launches of a training step on a GPU (a sixth of them). `Packing` computes, on the host
from the lengths, where every (caption, word) lands in the packed order, then packs with one
`index_select` and unpacks with one `index_copy` (backward: one gather or scatter each). The
values are the same numbers moved to the same places: the GRU sees the same `PackedSequence`.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence


class Packing:
    """Where each word of a zero-padded batch goes in the packed (time-major) order.

    Args:
        lengths: (B,) caption lengths (read on the CPU; a tensor elsewhere is copied once).
        device: where the data lives.

    The order is `pack_padded_sequence(..., batch_first=True, enforce_sorted=False)`'s: captions
    sorted by decreasing length (the same sort), then time step by time step.
    """

    def __init__(self, lengths: torch.Tensor, device: torch.device) -> None:
        lengths = torch.as_tensor(lengths).cpu().long()
        sorted_lengths, sorted_indices = torch.sort(lengths, descending=True)   # pack_padded_sequence's sort
        self.n_steps = int(sorted_lengths[0])
        steps = torch.arange(self.n_steps)
        self.batch_sizes = (sorted_lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(dim=1)   # (T,) on the CPU
        # packed row r holds (caption sorted_indices[b], step t), for t in order, b < batch_sizes[t]
        times, ranks = (torch.arange(lengths.numel()).unsqueeze(0) < self.batch_sizes.unsqueeze(1)).nonzero().unbind(1)
        self.captions, self.times = sorted_indices[ranks], times                 # on the CPU
        self.batch, self.device = lengths.numel(), device
        self._rows: dict[int, torch.Tensor] = {}
        self.sorted_indices = sorted_indices.to(device, non_blocking=True)
        unsorted = torch.empty_like(sorted_indices)
        unsorted[sorted_indices] = torch.arange(sorted_indices.numel())
        self.unsorted_indices = unsorted.to(device, non_blocking=True)

    def rows(self, width: int) -> torch.Tensor:
        """Each packed row's row in a (B * width) flattening of the padded batch, on the device."""
        if width not in self._rows:
            self._rows[width] = (self.captions * width + self.times).to(self.device, non_blocking=True)
        return self._rows[width]

    def pack(self, padded: torch.Tensor) -> PackedSequence:
        """(B, T', F) batch-first, T' >= the longest length -> the packed sequence."""
        flat = padded.reshape(self.batch * padded.size(1), -1)
        return PackedSequence(flat.index_select(0, self.rows(padded.size(1))), self.batch_sizes, self.sorted_indices,
                              self.unsorted_indices)

    def unpack(self, packed_data: torch.Tensor) -> torch.Tensor:
        """(N, H) packed rows (a GRU's output data) -> (B, T, H), zero beyond each length."""
        padded = packed_data.new_zeros(self.batch * self.n_steps, packed_data.size(1))
        return padded.index_copy(0, self.rows(self.n_steps), packed_data).view(self.batch, self.n_steps, -1)
