"""QuantMatrix: a block-quantized projection laid out in the compiled kernels' tiles, for
`CpuKernels.quant_matmul` and the one-call decode step (kernels/layer_kernels.cpp `QMat`): 16
rows a tile, float32 scales for the float kernel, or the qdot layout (kernels/qdot.h) that the
forms of DOT_FORMS run against int8 (or 15-bit) activations.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import torch

from .block_quant import BlockQuant
from .cpu_kernels import QMat

__all__ = ["DOT_FORMS", "QuantMatrix", "row_slices"]

# the forms that run qdot tiles, and how each rounds x (kernels/layer_kernels.cpp `QMat.dot`)
DOT_FORMS = {"qdot": 1, "qdot16": 2, "qdot_b16": 3}


class QuantMatrix:
    """A BlockQuant laid out for `CpuKernels.quant_matmul`: tiles of 16 rows (zero-padded),
    each [in / 2, 16] bytes of 4-bit q (byte r of entry p: column 2p of row r in the low
    nibble, 2p + 1 in the high) or [in, 16] int8, with float32 scales and offsets
    [in / group, 16] per tile; plus the projection's bias, which the kernel adds.

    `offsets` is None where they are all zero (the symmetric types: Q6_K, Q8_0, Q5_0): a lone
    decode reads every byte of the tiles once a token, and a Q6_K tile's zero offsets were
    1/6 of them (q8g16: 1.5 -> 1.25 bytes a weight). The kernel then adds no offset term.

    `dot`: the tiles laid out for the int8-activation kernel instead (kernels/qdot.h, the
    `qdot` form: [in / 8, 16, 4] bytes of nibbles, [in / 16, 3, 16, 4] of 6-bit q + 32 (`bits`
    6: an 8-bit type whose q all lie in -32..31, as Q6_K's and the Q5 types' do: 0.75 bytes a
    weight, not 1) or [in / 4, 16, 4] of q + 128), run against
    x quantized to int8 per 32 columns, with the scales and offsets in float16 (a Q4_K weight
    0.625 bytes, not 0.75: that form's lone decode is bound by reading them), in units of
    `unit`, the power of two that puts the largest at 2^14 (float16's normal range spans 2^30,
    so a matrix's smallest stay normal too; their rounding, 2^-11 of each, is far inside the
    int8 activations' ~0.5%); `supports_dot` says which shapes it takes. `form`: how x is
    rounded against these tiles (`against`, DOT_FORMS): `qdot` as above; `qdot16` to 15 bits
    (two int8 halves, two products a weight), whose error is the float16 scales' alone;
    `qdot_b16` to int8 per 16 columns (~0.47% error where 32 give ~0.53%)."""

    q: torch.Tensor  # the tiles (and their scales and offsets): none in a stacked matrix
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bias: torch.Tensor | None
    struct: QMat
    row_blocks: list[QuantMatrix] | None = None  # a stacked matrix's (see `stacked`)

    def __init__(self, bq: BlockQuant, bias: torch.Tensor | None = None, dot: bool = False
                 ) -> None:
        out_features, in_features = bq.shape
        if dot and bq.row_blocks and all(b.shape[0] % 16 == 0 for b in bq.row_blocks):
            biases = row_slices(bias, [block.shape[0] for block in bq.row_blocks])
            self._stack([QuantMatrix(block, part, dot=True)
                         for block, part in zip(bq.row_blocks, biases, strict=True)])
            return
        self.out_features, self.in_features = out_features, in_features
        self.group, self.bits, self.unit = bq.group, bq.bits, 1.0
        self.form = "qdot" if dot else "quant"
        tiles = -(-out_features // 16)
        pad = tiles * 16 - out_features

        def tiled(a: np.ndarray) -> torch.Tensor:  # [out, c] -> [tiles, c, 16]
            a = np.pad(a, ((0, pad), (0, 0)))
            return torch.from_numpy(np.ascontiguousarray(
                a.reshape(tiles, 16, -1).transpose(0, 2, 1)))

        scales, offsets = bq.scales, bq.offsets if bq.offsets.any() else None
        if dot:
            largest = max(float(np.abs(bq.scales).max()), float(np.abs(bq.offsets).max()))
            self.unit = 2.0 ** (int(np.ceil(np.log2(largest))) - 14) if largest > 0 else 1.0
            scales = (scales / self.unit).astype(np.float16)
            offsets = None if offsets is None else (offsets / self.unit).astype(np.float16)
        if dot and bq.bits == 8 and bq.q.size and -32 <= bq.q.min() and bq.q.max() <= 31:
            self.bits = 6
        q = _dot_tiles(np.pad(bq.q, ((0, pad), (0, 0))), self.bits) if dot else tiled(
            _nibble_pairs(bq.q) if bq.bits == 4 else bq.q.astype(np.uint8))  # int8 keeps its bits
        self._bind(q, tiled(scales), None if offsets is None else tiled(offsets), bias)

    @classmethod
    def from_tiles(cls, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                   shape: tuple[int, int], group: int, bits: int,
                   bias: torch.Tensor | None = None, dot: bool = False, unit: float = 1.0,
                   form: str | None = None) -> QuantMatrix:
        """A QuantMatrix of tiles laid out before (the repack cache's arrays); `form`: one of
        DOT_FORMS for qdot tiles (`dot`: `qdot`), else the float kernel's."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = shape
        self.group, self.bits, self.unit = group, bits, unit
        self.form = form or ("qdot" if dot else "quant")
        self._bind(q, scales, offsets, bias)
        return self

    @classmethod
    def stacked(cls, blocks: list[QuantMatrix]) -> QuantMatrix:
        """Row blocks of one matrix, each in its own qdot layout, as one: a call runs them in
        turn on the same x (kernels/layer_kernels.cpp `quant_mm`, following `QMat.next`), so a
        fused QKV of Q4_K rows and Q6_K ones reads each in its own bytes and arithmetic. Each
        block's rows but the last's are a multiple of 16 (whole tiles)."""
        self = cls.__new__(cls)
        self._stack(blocks)
        return self

    def _stack(self, blocks: list[QuantMatrix]) -> None:
        assert all(b.dot and not b.row_blocks for b in blocks)
        assert all(b.out_features % 16 == 0 for b in blocks[:-1])
        first = blocks[0]
        self.row_blocks = blocks
        self.out_features = sum(b.out_features for b in blocks)
        self.in_features, self.form, self.unit = first.in_features, first.form, 1.0
        # NOTE: as merge_rows would hold them merged: for messages, not the arithmetic
        self.group, self.bits = min(b.group for b in blocks), max(b.bits for b in blocks)
        self.offsets = self.bias = None  # its blocks' own, each added by its own call
        for block, following in itertools.pairwise(blocks):
            block.struct.next = ctypes.addressof(following.struct)
        self.struct = first.struct

    def against(self, form: str) -> QuantMatrix:
        """These qdot tiles (shared, not copied), run as `form` (one of DOT_FORMS)."""
        assert self.dot and form in DOT_FORMS
        if self.row_blocks:
            return QuantMatrix.stacked([b.against(form) for b in self.row_blocks])
        return QuantMatrix.from_tiles(self.q, self.scales, self.offsets,
                                      (self.out_features, self.in_features), self.group,
                                      self.bits, self.bias, unit=self.unit, form=form)

    @property
    def dot(self) -> bool:
        """Whether the tiles are in the qdot layout (run as one of DOT_FORMS)."""
        return self.form in DOT_FORMS

    def _bind(self, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
              bias: torch.Tensor | None) -> None:
        self.q, self.scales, self.offsets = q, scales, offsets
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.struct = QMat(self.q.data_ptr(), self.scales.data_ptr(),
                           0 if offsets is None else offsets.data_ptr(),
                           0 if self.bias is None else self.bias.data_ptr(), self.out_features,
                           self.in_features, self.group, self.bits,
                           DOT_FORMS.get(self.form, 0), self.unit, 0)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the matrix, dequantized from the qdot tiles -> [n, in] float32
        (a tied embedding's lookups, from the head's tiles every decode step keeps resident
        anyway); exact to the float16 scales' rounding (2^-11 of each)."""
        assert self.dot and not self.row_blocks
        tile, row = ids // 16, ids % 16
        n = ids.shape[0]
        if self.bits == 6:  # per 16 columns, three bytes a lane: see _dot_tiles
            lanes = self.q[tile, :, :, row].to(torch.int16)  # [n, in / 16, 3, 4] bytes
            top = lanes >> 6
            last = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4)
            q = torch.cat((lanes & 63, last[:, :, None]), dim=2) - 32
        else:
            lanes = self.q[tile, :, row].to(torch.int16)  # [n, in / 8 | in / 4, 4] bytes
            if self.bits == 4:  # lane byte j: column 8e + j low, 8e + 4 + j high
                q = torch.stack((lanes & 15, lanes >> 4), dim=2)
            else:
                q = lanes - 128
        grouped = q.reshape(n, -1, self.group).float()
        out = grouped * self.scales[tile, :, row].float()[..., None]
        if self.offsets is not None:
            out += self.offsets[tile, :, row].float()[..., None]
        return out.reshape(n, self.in_features).mul_(self.unit)

    @staticmethod
    def supports(bq: BlockQuant) -> bool:
        return bq.group % 8 == 0

    @staticmethod
    def supports_dot(in_features: int, group: int) -> bool:
        """Whether the qdot kernel takes blocks of this shape (kernels/qdot.h
        `qdot_supports`): whole 32-column blocks of x, and groups of 16 (two to a block) or of
        whole blocks."""
        return in_features % 32 == 0 and (group == 16 or group % 32 == 0)

    @property
    def nbytes(self) -> int:
        if self.row_blocks:
            return sum(b.nbytes for b in self.row_blocks)
        offsets = 0 if self.offsets is None else self.offsets.nbytes
        return self.q.nbytes + self.scales.nbytes + offsets

    @property
    def kind(self) -> str:
        """`q<bits>g<group>`, `s` after it without offsets: what decides the tiles' bytes (a
        stacked matrix's blocks' joined by `+`)."""
        if self.row_blocks:
            return "+".join(b.kind for b in self.row_blocks)
        return f"q{self.bits}g{self.group}{'' if self.offsets is not None else 's'}"


def row_slices(t: torch.Tensor | None, rows: list[int]) -> list[torch.Tensor | None]:
    """`t` cut into consecutive slices of `rows` rows each (a stacked matrix's blocks' biases);
    all None where `t` is None."""
    starts = [0, *itertools.accumulate(rows)]
    return [None if t is None else t[a:b] for a, b in itertools.pairwise(starts)]


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[out, in] of 0..15 -> [out, in / 2] bytes: column 2p in the low nibble, 2p + 1 high."""
    q = q.astype(np.uint8)
    return q[:, 0::2] | (q[:, 1::2] << np.uint8(4))


def _dot_tiles(q: np.ndarray, bits: int) -> torch.Tensor:
    """[out (a multiple of 16), in] integers -> qdot.h's tiles [tiles, in / 8 | in / 4, 16, 4]
    bytes: per lane of 4 bytes one row's columns 8e + j (low nibble) and 8e + 4 + j (high), or
    its q + 128 of columns 4e + j; bits 6: [tiles, in / 16, 3, 16, 4], lane byte j of vector i
    holding u = q + 32 of column 16e + 4i + j in its low 6 bits, and bits 2i, 2i + 1 of column
    16e + 12 + j's u in its top two."""
    out_features, in_features = q.shape
    if bits == 6:
        u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(
            out_features // 16, 16, in_features // 16, 4, 4)  # [tiles, row, unit, entry, j]
        last = u[:, :, :, 3:]
        planes = u[:, :, :, :3] | (((last >> np.array([0, 2, 4], np.uint8)[:, None]) & 3)
                                   << np.uint8(6))  # [tiles, row, unit, 3, j]
        return torch.from_numpy(np.ascontiguousarray(planes.transpose(0, 2, 3, 1, 4)))
    if bits == 4:
        q = q.astype(np.uint8).reshape(out_features // 16, 16, in_features // 8, 2, 4)
        lanes = q[:, :, :, 0] | (q[:, :, :, 1] << np.uint8(4))  # [tiles, 16, in / 8, 4]
    else:
        lanes = (q.astype(np.int16) + 128).astype(np.uint8).reshape(
            out_features // 16, 16, in_features // 4, 4)
    return torch.from_numpy(np.ascontiguousarray(lanes.transpose(0, 2, 1, 3)))
