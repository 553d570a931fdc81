"""LoraBatch: which rows of a step's flat batch run under which adapter, and the low-rank add.

After Punica / S-LoRA's segmented GEMM (vLLM's `punica_wrapper`): the base projection runs once
over every row of the step, then each adapter adds its own x A B to its rows only. The model
runner orders the step's sequences so an adapter's rows are contiguous (decodes first, then
prefills, each grouped by adapter), so a segment is a slice, not a gather; the base model's
rows get nothing.

With the compiled kernels, a projection's add for every segment is one call
(model/kernels/lora_rows.cpp). NOTE: in torch it is two small GEMMs per segment (more for
Q/K/V), each a few microseconds of dispatch: 8 adapters over a 30-layer model made ~2,000
calls a step, which cost a 64-row batch a third of its tokens/s (bench/lora.py).

`LoraSlot` is the one object every hooked `Linear` (model/linear.py) reads the step's batch
from: the runner sets it around the forward pass, so the layers' signatures stay as they are.
"""

from __future__ import annotations

import ctypes
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cache

import torch

from llmq.worker.engine.lora.adapter import LoraAdapter, projection_index
from llmq.worker.engine.model.cpu_kernels import CpuKernels, LoraSegment


@dataclass
class LoraBatch:
    """Segments (first row, end row, adapter) of the flat batch, in row order."""

    segments: list[tuple[int, int, LoraAdapter]] = field(default_factory=list)
    _kernel_segments: ctypes.Array[LoraSegment] | None = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, row_adapters: list[tuple[int, LoraAdapter | None]]) -> LoraBatch:
        """From each sequence's (number of rows, adapter or None), in batch order: runs of one
        adapter become one segment."""
        segments: list[tuple[int, int, LoraAdapter]] = []
        row = 0
        for num_rows, adapter in row_adapters:
            if adapter is not None:
                if segments and segments[-1][2] is adapter and segments[-1][1] == row:
                    segments[-1] = (segments[-1][0], row + num_rows, adapter)
                else:
                    segments.append((row, row + num_rows, adapter))
            row += num_rows
        return cls(segments)

    def of_rows(self, rows: list[int]) -> LoraBatch:
        """The batch of `rows` (ascending rows of this one) alone, numbered from 0 in that
        order: a step's last layer runs its sampled rows alone (LlamaForCausalLM.forward_layers)."""
        segments = []
        for start, end, adapter in self.segments:
            first, stop = bisect_left(rows, start), bisect_left(rows, end)
            if first < stop:
                segments.append((first, stop, adapter))
        return LoraBatch(segments)

    def add_(self, key: str, x: torch.Tensor, y: torch.Tensor,
             kernels: CpuKernels | None = None) -> None:
        """y[rows] += x[rows] A B for every segment whose adapter targets projection `key`.
        x [num_rows, in], y [num_rows, out] (the base projection's fresh output, any dtype).
        With `kernels`, float32/bfloat16 rows go through the compiled kernel in one call."""
        if (kernels is not None and x.dtype in _KERNEL_DTYPES and y.dtype in _KERNEL_DTYPES
                and x.stride(1) == 1 and y.stride(1) == 1):
            kernels.lora_add(x, y, self._segments_for_kernel(), _index(key))
            return
        x = x.float()  # [num_rows, in] (no copy on the float32 paths)
        for start, end, adapter in self.segments:
            projection = adapter.weights.get(key)
            if projection is None:
                continue
            xa = torch.mm(x[start:end], projection.a)  # [rows, padded rank]
            for rank_offset, col_start, b in projection.blocks:  # b [rank, cols]
                rank, cols = b.shape
                part = xa[:, rank_offset:rank_offset + rank]
                target = y[start:end, col_start:col_start + cols]
                if y.dtype == torch.float32:
                    target.addmm_(part, b)
                else:
                    target.add_(torch.mm(part, b).to(y.dtype))

    def _segments_for_kernel(self) -> ctypes.Array[LoraSegment]:
        """The segments as the kernel reads them, built on the step's first call."""
        if self._kernel_segments is None:
            array = (LoraSegment * len(self.segments))()
            for entry, (start, end, adapter) in zip(array, self.segments, strict=True):
                table = adapter.kernel_table
                entry.start, entry.end = start, end
                entry.table, entry.table_len = ctypes.addressof(table), len(table)
            self._kernel_segments = array
        return self._kernel_segments


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@cache
def _index(key: str) -> int:
    return projection_index(key)


class LoraSlot:
    """The step's `LoraBatch` (None: no row runs an adapter), shared by the hooked layers,
    and the model's compiled kernels (None: the torch path)."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        self.batch: LoraBatch | None = None
        self.kernels = kernels

    def add_(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """The step's low-rank products of projection `key` added into y (LoraBatch.add_)."""
        if self.batch is not None:
            self.batch.add_(key, x, y, self.kernels)
