"""LoraBatch: which rows of a step's flat batch run under which adapter, and the low-rank add.

After Punica / S-LoRA's segmented GEMM (vLLM's `punica_wrapper`): the base projection runs once
over every row of the step, then each adapter adds its own x A B to its rows only. The model
runner orders the step's sequences so an adapter's rows are contiguous (decodes first, then
prefills, each grouped by adapter), so a segment is a slice, not a gather: two small GEMMs per
adapter segment and projection, none for the base model's rows.

`LoraSlot` is the one object every hooked `Linear` (model/linear.py) reads the step's batch
from: the runner sets it around the forward pass, so the layers' signatures stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmq.worker.engine.lora.adapter import LoraAdapter


@dataclass
class LoraBatch:
    """Segments (first row, end row, adapter) of the flat batch, in row order."""

    segments: list[tuple[int, int, LoraAdapter]] = field(default_factory=list)

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

    def add_(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += x[rows] A B for every segment whose adapter targets projection `key`.
        x [num_rows, in], y [num_rows, out] (the base projection's fresh output, any dtype)."""
        x = x.float()  # [num_rows, in] (no copy on the float32 paths)
        for start, end, adapter in self.segments:
            pair = adapter.weights.get(key)
            if pair is None:
                continue
            a, b = pair  # [in, R], [R, out] (scaled)
            xa = torch.mm(x[start:end], a)  # [rows, R]
            if y.dtype == torch.float32:
                y[start:end].addmm_(xa, b)
            else:
                y[start:end].add_(torch.mm(xa, b).to(y.dtype))


class LoraSlot:
    """The step's `LoraBatch` (None: no row runs an adapter), shared by the hooked layers."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None
