"""Int4Weight: a GGUF block-quantized matrix run by torch's int4 CPU kernel, never densified.

References: llama.cpp `ggml-quants.c` (`dequantize_row_q4_0`, `_q4_1`, `_q5_0`, `_q5_1`,
`_q8_0`, `_q4_K`, `get_scale_min_k4`: the block layouts decoded here), gguf-py
`gguf.quants` (the same layouts in numpy; the tests' oracle), torch's
`aten._weight_int4pack_mm_for_cpu` and `_convert_weight_to_int4pack_for_cpu` (gpt-fast's int4
path): per group of 32 input columns a scale and a zero, `w = (q - 8) * scale + zero`.

Every supported type is an exact sum of such int4 terms, up to rounding the scales and zeros
to bfloat16 (the kernel's only fast dtype on CPU):

| GGUF type | block | terms | how |
| --- | --- | --- | --- |
| Q4_0 | 32: d, 4-bit q | 1 | scale d, zero 0 (`(q - 8) * d`) |
| Q4_1 | 32: d, m, 4-bit q | 1 | scale d, zero m + 8d |
| Q4_K | 256: d, dmin, 8 x 6-bit (sc, m), 4-bit q | 1 | per 32: scale d*sc, zero 8*d*sc - dmin*m |
| Q5_0, Q5_1 | 32: 4 low bits + 1 high bit | 2 | the high bit as a second int4 term of scale 16d |
| Q8_0 | 32: d, int8 q | 2 | q = 16 * (q >> 4) + (q & 15): a high and a low nibble term |

Two-term types read half the bytes of bfloat16 but run the kernel twice: they pay off for the
large tied embedding / LM head at one row (measured in bench/kernels.py), not much elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
GROUP_SIZE = 32  # columns per (scale, zero) pair; every supported type has 32-column groups
INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q8_0})


@dataclass
class Int4Term:
    """One int4 matrix: nibbles [out, in] in 0..15, and scale / zero per (group, out)."""

    nibbles: np.ndarray  # [out, in] uint8, 0..15
    scales: np.ndarray  # [out, in / 32] float32
    zeros: np.ndarray  # [out, in / 32] float32

    def dequantize(self) -> np.ndarray:
        """[out, in] float32: (q - 8) * scale + zero, group by group."""
        out_features, in_features = self.nibbles.shape
        q = self.nibbles.reshape(out_features, -1, GROUP_SIZE).astype(np.float32) - 8
        return (q * self.scales[..., None] + self.zeros[..., None]).reshape(
            out_features, in_features)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block -> [num_blocks] float32."""
    return blocks[:, offset:offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's [n, 4] bytes of high bits -> [n, 32] of 0/1 (bit j is element j)."""
    bits = qh.copy().view("<u4")[:, 0]  # [n]
    return ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _decode_blocks(qtype: Q, blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Blocks [n, bytes] of one type -> terms, each (nibbles [n, 32 * k], scale and zero
    [n, k]) with k groups of 32 per block."""
    if qtype == Q.Q4_0:
        d = _f16(blocks, 0)
        return [(_split_nibbles(blocks[:, 2:18]), d[:, None], np.zeros_like(d)[:, None])]
    if qtype == Q.Q4_1:
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        return [(_split_nibbles(blocks[:, 4:20]), d[:, None], (m + 8 * d)[:, None])]
    if qtype in (Q.Q5_0, Q.Q5_1):
        d = _f16(blocks, 0)
        offset = 2 if qtype == Q.Q5_0 else 4
        # Q5_0: (q5 - 16) * d; Q5_1: q5 * d + m; q5 = 16 * high + low
        bias = -16 * d if qtype == Q.Q5_0 else _f16(blocks, 2)
        high = _high_bits(blocks[:, offset:offset + 4]) + 8  # (high + 8 - 8) * 16d = 16d*high
        low = _split_nibbles(blocks[:, offset + 4:offset + 20])
        return [(high, (16 * d)[:, None], np.zeros_like(d)[:, None]),
                (low, d[:, None], (bias + 8 * d)[:, None])]
    if qtype == Q.Q8_0:
        d = _f16(blocks, 0)
        q = blocks[:, 2:34].copy().view(np.int8)  # [n, 32]
        high = ((q >> 4) + 8).astype(np.uint8)  # q >> 4 in -8..7
        low = (q & 0x0F).astype(np.uint8)
        return [(high, (16 * d)[:, None], np.zeros_like(d)[:, None]),
                (low, d[:, None], (8 * d)[:, None])]
    if qtype == Q.Q4_K:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _q4k_scales_mins(blocks[:, 4:16])  # [n, 8] each
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 elements
        # chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
        nibbles = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        scale = d[:, None] * sc
        return [(nibbles, scale, 8 * scale - dmin[:, None] * mn)]
    raise ValueError(f"no int4 form for GGUF type {qtype.name}")


def _q4k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's `get_scale_min_k4` for all 8 sub-blocks: 12 bytes -> 6-bit (sc, m) x 8."""
    s = s.astype(np.uint16)
    sc = np.empty((s.shape[0], 8), np.float32)
    mn = np.empty((s.shape[0], 8), np.float32)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def decode_terms(qtype: Q, data: np.ndarray, shape: tuple[int, int]) -> list[Int4Term]:
    """A GGUF tensor's raw bytes [out, row_bytes] -> its exact int4 terms."""
    out_features, in_features = shape
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)  # [out * blocks_per_row, bytes]
    terms = []
    for nibbles, scales, zeros in _decode_blocks(qtype, blocks):
        groups = in_features // GROUP_SIZE
        terms.append(Int4Term(nibbles.reshape(out_features, in_features),
                              scales.reshape(out_features, groups).astype(np.float32),
                              zeros.reshape(out_features, groups).astype(np.float32)))
    return terms


def can_run_int4(qtype: Q, shape: tuple[int, int]) -> bool:
    """The kernel needs out_features % 16 == 0 and whole 32-column groups."""
    out_features, in_features = shape
    return qtype in INT4_TYPES and out_features % 16 == 0 and in_features % GROUP_SIZE == 0


class Int4Weight:
    """y = x W^T for W held as packed int4 terms; x and y are bfloat16 [num_rows, features]."""

    def __init__(self, terms: list[Int4Term]) -> None:
        self.out_features, self.in_features = terms[0].nibbles.shape
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for term in terms:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(term.nibbles.astype(np.int32)), 1)  # [out, in / 2] uint8
            # [in / 32, out, 2]: the kernel's (scale, zero) layout
            scales_and_zeros = torch.from_numpy(
                np.stack([term.scales, term.zeros], axis=-1).transpose(1, 0, 2).copy()
            ).to(torch.bfloat16)
            self._packed.append((packed, scales_and_zeros))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + s.nbytes for p, s in self._packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_rows, in] bfloat16 -> [num_rows, out] bfloat16."""
        packed, scales_and_zeros = self._packed[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)
        for packed, scales_and_zeros in self._packed[1:]:
            y += torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, packed, GROUP_SIZE, scales_and_zeros)
        return y
