"""BlockQuant: a GGUF block-quantized matrix as integers with a scale and an offset per group.

References: llama.cpp `ggml-quants.c` (`dequantize_row_q4_0` ... `_q6_K`, `get_scale_min_k4`:
the block layouts decoded here) and gguf-py `gguf.quants` (the same layouts in numpy, and the
tests' oracle: every decoding below reproduces `gguf.quants.dequantize` exactly).

Every supported type is `w = q * scale + offset` per group of `group` columns, with small
integers q, so kernels can run it without a dense copy:

| GGUF type | block | bits | group | q, scale, offset |
| --- | --- | --- | --- | --- |
| Q4_0 | 32: d, 4-bit q | 4 | 32 | q, d, -8d |
| Q4_1 | 32: d, m, 4-bit q | 4 | 32 | q, d, m |
| Q4_K | 256: d, dmin, 8 x 6-bit (sc, m), 4-bit q | 4 | 32 | q, d*sc, -dmin*m |
| Q5_0 | 32: d, 5-bit q | 8 | 32 | q - 16, d, 0 |
| Q5_1 | 32: d, m, 5-bit q | 8 | 32 | q, d, m |
| Q5_K | 256: like Q4_K with a fifth bit | 8 | 32 | q, d*sc, -dmin*m |
| Q6_K | 256: d, 16 x int8 sc, 6-bit q | 8 | 16 | q - 32, d*sc, 0 |
| Q8_0 | 32: d, int8 q | 8 | 32 | q, d, 0 |

The scale and offset are float32 products of the file's float16 numbers and small integers:
exact, so `dequantize()` equals gguf-py's float32 result bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
BLOCK_QUANT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0})


@dataclass
class BlockQuant:
    q: np.ndarray  # [out, in] int8 (0..15 when bits == 4)
    scales: np.ndarray  # [out, in / group] float32
    offsets: np.ndarray  # [out, in / group] float32
    group: int
    bits: int  # 4: every q in 0..15; 8: any int8
    # the row blocks of other kinds it was merged from, each a run of one kind (merge_rows)
    row_blocks: list[BlockQuant] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> np.ndarray:
        """[out, in] float32."""
        out_features, in_features = self.q.shape
        q = self.q.reshape(out_features, -1, self.group).astype(np.float32)
        return (q * self.scales[..., None] + self.offsets[..., None]).reshape(
            out_features, in_features)

    def dequantize_torch(self) -> torch.Tensor:
        """`dequantize()` as a torch tensor, computed by torch (threaded, no numpy
        temporaries: ~5x faster on a 1B model's projections). The same two roundings (the
        product, then the sum; no fused multiply-add), so the same bits."""
        out_features, in_features = self.q.shape
        q = torch.from_numpy(self.q).view(out_features, -1, self.group).float()
        q.mul_(torch.from_numpy(self.scales)[..., None])
        q.add_(torch.from_numpy(self.offsets)[..., None])
        return q.view(out_features, in_features)

    @classmethod
    def from_gguf(cls, qtype: Q, data: np.ndarray, shape: tuple[int, int]) -> BlockQuant:
        """A tensor's raw bytes [out, row_bytes] of one of BLOCK_QUANT_TYPES."""
        if qtype not in BLOCK_QUANT_TYPES:
            raise ValueError(f"no block decoding for GGUF type {qtype.name}")
        out_features, in_features = shape
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)  # [out * blocks, bytes]
        q, scales, offsets, group, bits = _DECODERS[qtype](blocks)
        groups = in_features // group
        return cls(q.astype(np.int8).reshape(out_features, in_features),
                   scales.astype(np.float32).reshape(out_features, groups),
                   offsets.astype(np.float32).reshape(out_features, groups), group, bits)


def merge_rows(parts: list[BlockQuant]) -> BlockQuant:
    """Row blocks of one matrix (a fused QKV whose parts have different types) -> one
    BlockQuant, exactly: in the finest group size (a group's scale and offset repeat over its
    sub-groups) and 8 bits where any part has them (every 4-bit q, 0..15, is a valid int8).

    Where the parts are of more than one kind (bits, group, offsets or none), the merged
    matrix keeps them too, a run of each kind merged (`row_blocks`): the qdot tiles hold each
    in its own layout (QuantMatrix), so Q4_K_M's Q and K rows stay 4-bit beside a Q6_K V, where
    merged they took V's 6 bits and its groups of 16 with Q4_K's offsets."""
    if len(parts) == 1:
        return parts[0]
    merged = _stacked(parts)
    runs: list[list[BlockQuant]] = []
    for part in parts:
        if runs and _kind(runs[-1][-1]) == _kind(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    if len(runs) > 1:
        merged.row_blocks = [_stacked(run) for run in runs]
    return merged


def _kind(bq: BlockQuant) -> tuple[int, int, bool]:
    return bq.bits, bq.group, bool(bq.offsets.any())


def _stacked(parts: list[BlockQuant]) -> BlockQuant:
    if len(parts) == 1:
        return parts[0]
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise ValueError(f"group sizes {[p.group for p in parts]} do not nest")
    bits = max(p.bits for p in parts)
    return BlockQuant(np.concatenate([p.q for p in parts]),
                      np.concatenate([np.repeat(p.scales, p.group // group, axis=1)
                                      for p in parts]),
                      np.concatenate([np.repeat(p.offsets, p.group // group, axis=1)
                                      for p in parts]), group, bits)


class QuantizedEmbedding:
    """Rows of a block-quantized embedding, dequantized on lookup (as gguf-py would: exact),
    so the table is never held dense: 1/4 of float32's bytes for a Q8_0 table."""

    def __init__(self, bq: BlockQuant) -> None:
        self.group = bq.group
        self.q = torch.from_numpy(bq.q)  # [vocab, hidden] int8
        self.scales = torch.from_numpy(bq.scales)  # [vocab, hidden / group] float32
        self.offsets = torch.from_numpy(bq.offsets)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self.offsets.nbytes

    def dequantize_into(self, out: torch.Tensor) -> None:
        """The whole table into `out` [vocab, hidden] float32 (a tied LM head's dense form),
        with the same two roundings as `BlockQuant.dequantize`."""
        vocab, hidden = self.q.shape
        grouped = out.view(vocab, -1, self.group)
        torch.mul(self.q.view(vocab, -1, self.group), self.scales[..., None], out=grouped)
        grouped.add_(self.offsets[..., None])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, hidden] float32."""
        n, hidden = ids.shape[0], self.q.shape[1]
        q = self.q[ids].float().view(n, -1, self.group)  # [n, groups, group]
        return (q * self.scales[ids][..., None] + self.offsets[ids][..., None]).view(n, hidden)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block -> [num_blocks, 1] float32."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-block -> [n, 32]: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


# (q [n, block] integers, scales, offsets [n, groups] float32, group size, bits)
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's [n, 4] bytes of high bits -> [n, 32] of 0/16 (bit j is element j)."""
    bits = qh.copy().view("<u4")  # [n, 1]
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b: np.ndarray) -> _Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d, 32, 4


def _q4_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 32, 4


def _q5_0(b: np.ndarray) -> _Decoded:
    q = (_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int16) - 16
    return q, _f16(b, 0), np.zeros((len(b), 1), np.float32), 32, 8


def _q5_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2), 32, 8


def _q8_0(b: np.ndarray) -> _Decoded:
    return b[:, 2:34].copy().view(np.int8), _f16(b, 0), np.zeros((len(b), 1), np.float32), 32, 8


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks -> per-32 scale d*sc and offset -dmin*m, [n, 8] each."""
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> _Decoded:
    scales, offsets = _k_scales(b)
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # 4 chunks of 64: low nibbles, then high
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return q.reshape(-1, 256), scales, offsets, 32, 4


def _q5_k(b: np.ndarray) -> _Decoded:
    scales, offsets = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32)  # bit j of byte l: element 32 j + l
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    return (low | (high << 4)).reshape(-1, 256), scales, offsets, 32, 8


def _q6_k(b: np.ndarray) -> _Decoded:
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n, 16]
    low = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
           & 0x0F).reshape(-1, 8, 32)
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1))
            & 0x03).reshape(-1, 8, 32)
    q = (low | (high << 4)).astype(np.int16) - 32
    return q.reshape(-1, 256), _f16(b, 208) * sc, np.zeros_like(sc), 16, 8


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
             Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q8_0: _q8_0}
