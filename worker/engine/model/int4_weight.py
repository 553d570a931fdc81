"""Int4Weight: a block-quantized matrix run by torch's int4 CPU kernel (gpt-fast's path).

References: torch's `aten._weight_int4pack_mm_for_cpu` and `_convert_weight_to_int4pack_for_cpu`
(per group of 32 input columns a scale and a zero: `w = (q - 8) * scale + zero`), gpt-fast
`quantize.py` (`WeightOnlyInt4Linear`).

The fallback for `--weights native` where the compiled kernels (cpu_kernels.py) are missing.
A `BlockQuant` maps onto it exactly, up to rounding the scales and zeros to bfloat16 (the
kernel's only fast dtype on CPU; it also takes and returns bfloat16): 4-bit types as one term
(zero = offset + 8 * scale), 8-bit ones with 32-column groups as two, q = 16 * (q >> 4) +
(q & 15): a high and a low nibble term.
"""

from __future__ import annotations

import numpy as np
import torch

from .block_quant import BlockQuant

GROUP_SIZE = 32


def _term(nibbles: np.ndarray, scales: np.ndarray, zeros: np.ndarray
          ) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(nibbles.astype(np.int32)), 1)  # [out, in / 2] uint8
    # [in / 32, out, 2]: the kernel's (scale, zero) layout
    scales_and_zeros = torch.from_numpy(
        np.stack([scales, zeros], axis=-1).transpose(1, 0, 2).copy()).to(torch.bfloat16)
    return packed, scales_and_zeros


class Int4Weight:
    """y = x W^T for W held as packed int4 terms; x and y are bfloat16 [num_rows, features]."""

    def __init__(self, terms: list[tuple[torch.Tensor, torch.Tensor]], in_features: int
                 ) -> None:
        self._terms = terms
        self.in_features = in_features

    @classmethod
    def from_block_quant(cls, bq: BlockQuant) -> Int4Weight | None:
        """None where the kernel cannot run it: groups other than 32, out_features not a
        multiple of 16."""
        out_features, in_features = bq.shape
        if bq.group != GROUP_SIZE or out_features % 16:
            return None
        if bq.bits == 4:
            return cls([_term(bq.q, bq.scales, bq.offsets + 8 * bq.scales)], in_features)
        high = ((bq.q >> 4) + 8).astype(np.uint8)  # q >> 4 in -8..7
        low = (bq.q & 0x0F).astype(np.uint8)
        return cls([_term(high, 16 * bq.scales, np.zeros_like(bq.scales)),
                    _term(low, bq.scales, bq.offsets + 8 * bq.scales)], in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + s.nbytes for p, s in self._terms)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_rows, in] bfloat16 -> [num_rows, out] bfloat16."""
        packed, scales_and_zeros = self._terms[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)
        for packed, scales_and_zeros in self._terms[1:]:
            y += torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, packed, GROUP_SIZE, scales_and_zeros)
        return y
