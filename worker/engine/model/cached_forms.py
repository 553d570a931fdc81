"""The forms Linear builds from a projection's GGUF blocks, other than its quantized one: each
mapped from the repack cache (repack_cache.py) where it holds them for this shape, else built
from the blocks and stored there, then run from the map, so a warm start reads bytes instead
of building and a cold one ends with a warm one's RSS.

`blocks`: the projection's blocks, decoded on first need and shared by every form built from
them (Linear._blocks); `shape`: its (out_features, in_features).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from . import packed_weight
from .block_quant import BlockQuant, merge_rows
from .form_choice import DENSE_DTYPES
from .int8_matrix import Int8Matrix
from .quant_matrix import QuantMatrix, row_slices
from .repack_cache import RepackCache

DENSE_CHUNK_ROWS = 4096  # rows dequantized at a time into a dense form (bounds the peak RSS)

Blocks = Callable[[], BlockQuant | None]
_TILE_ARRAYS = ("q", "scales", "offsets")


def tile_arrays(quant: QuantMatrix) -> tuple[dict, dict[str, np.ndarray]]:
    """A QuantMatrix's (meta, arrays) as the repack cache keeps them; a stacked one's row
    blocks each under its index (`q0`, `scales0`, ..., meta `row_blocks`)."""
    if quant.row_blocks:
        metas, arrays = [], {}
        for i, block in enumerate(quant.row_blocks):
            meta, own = tile_arrays(block)
            metas.append(meta)
            arrays.update({f"{part}{i}": array for part, array in own.items()})
        return {"shape": [quant.out_features, quant.in_features], "row_blocks": metas}, arrays
    arrays = {"q": quant.q.numpy(), "scales": quant.scales.numpy()}
    if quant.offsets is not None:  # none where all zero (QuantMatrix)
        arrays["offsets"] = quant.offsets.numpy()
    return {"shape": [quant.out_features, quant.in_features], "group": quant.group,
            "bits": quant.bits, "unit": quant.unit}, arrays


def from_tile_arrays(meta: dict, arrays: dict[str, np.ndarray], shape: tuple[int, int],
                     bias: torch.Tensor | None, dot: bool = False) -> QuantMatrix:
    """The QuantMatrix over the repack cache's arrays (no copy)."""
    if "row_blocks" in meta:
        metas = meta["row_blocks"]
        rows = [block["shape"][0] for block in metas]
        blocks = []
        for i, (block, n, part_bias) in enumerate(
                zip(metas, rows, row_slices(bias, rows), strict=True)):
            own = {part: arrays[f"{part}{i}"] for part in _TILE_ARRAYS if f"{part}{i}" in arrays}
            blocks.append(from_tile_arrays(block, own, (n, shape[1]), part_bias, dot))
        return QuantMatrix.stacked(blocks)
    t = {part: torch.from_numpy(a) for part, a in arrays.items()}
    return QuantMatrix.from_tiles(t["q"], t["scales"], t.get("offsets"), shape, meta["group"],
                                  meta["bits"], bias, dot=dot, unit=meta.get("unit", 1.0))


def block_rows(bq: BlockQuant, start: int, stop: int) -> BlockQuant:
    """Rows [start, stop) of a projection's blocks (views, no copy, unless they span row
    blocks of different kinds: then those rows merged as merge_rows merges them)."""
    if bq.row_blocks:
        pieces, at = [], 0
        for block in bq.row_blocks:
            first, last = max(start, at), min(stop, at + block.shape[0])
            if first < last:
                pieces.append(block_rows(block, first - at, last - at))
            at += block.shape[0]
        return merge_rows(pieces)
    return BlockQuant(bq.q[start:stop], bq.scales[start:stop], bq.offsets[start:stop],
                      bq.group, bq.bits)


def _decoded(blocks: Blocks) -> BlockQuant:
    bq = blocks()
    assert bq is not None, "a form built from blocks the projection does not have"
    return bq


def qdot_form(blocks: Blocks, shape: tuple[int, int], bias: torch.Tensor | None,
              cache: RepackCache | None, name: str) -> QuantMatrix:
    """The blocks in the qdot layout (kernels/qdot.h), as `<name>.qdot`."""
    found = cache.get(f"{name}.qdot", streamed=True) if cache is not None else None
    if found is not None and tuple(found[0]["shape"]) == shape:
        return from_tile_arrays(*found, shape, bias, dot=True)
    qdot = QuantMatrix(_decoded(blocks), bias, dot=True)
    if cache is None:
        return qdot
    meta, arrays = tile_arrays(qdot)
    # NOTE: run from the cache's map, as the quantized form (the copy built is dropped)
    return from_tile_arrays(meta, cache.put(f"{name}.qdot", meta, arrays), shape, bias,
                            dot=True)


def int8_form(blocks: Blocks, shape: tuple[int, int], bias: torch.Tensor | None,
              cache: RepackCache | None, name: str) -> Int8Matrix:
    """The two-term int8 form (int8_matrix.py), as `<name>.int8`."""
    found = cache.get(f"{name}.int8", streamed=True) if cache is not None else None
    if found is None or found[1]["q"].shape != shape:
        # NOTE: from this projection's blocks alone: one float32 matrix at a time
        int8 = Int8Matrix(_decoded(blocks).dequantize_torch(), bias)
        if cache is None:
            return int8
        found = ({}, cache.put(f"{name}.int8", {"shape": [*int8.q.shape]},
                               {"q": int8.q.numpy(), "scale": int8.scale.numpy()}))
    arrays = found[1]
    return Int8Matrix.from_parts(torch.from_numpy(arrays["q"]),
                                 torch.from_numpy(arrays["scale"]), bias)


def dense_form(form: str, blocks: Blocks, shape: tuple[int, int], rows: tuple[int, int],
               cache: RepackCache | None, name: str, backing: list[np.ndarray]
               ) -> torch.Tensor:
    """Output rows [start, stop) of the weight in `form`'s dtype packed for oneDNN, as
    `<name>.<form>` (`<name>.<form>.<start>-<stop>` for a part: the packed bytes,
    packed_weight.py) where they are packed for this CPU. `backing` keeps each map the
    returned tensor wraps (the tensor does not own it)."""
    start, stop = rows
    dtype, part_shape = DENSE_DTYPES[form], (stop - start, shape[1])
    name = f"{name}.{form}" if rows == (0, shape[0]) else f"{name}.{form}.{start}-{stop}"
    found = cache.get(name, streamed=True) if cache is not None else None
    if found is not None:
        mapped = packed_weight.from_arrays(found[1], part_shape, dtype)
        if mapped is not None:
            backing.append(found[1]["packed"])  # the map outlives the tensor
            return mapped
    bq = _decoded(blocks)
    weight = torch.empty(part_shape, dtype=dtype)
    for first in range(start, stop, DENSE_CHUNK_ROWS):
        last = min(first + DENSE_CHUNK_ROWS, stop)
        weight[first - start:last - start] = block_rows(bq, first, last).dequantize_torch()
    packed = packed_weight.pack(weight)
    if cache is None or not packed_weight.available():
        return packed
    # NOTE: this start, too, runs from the map: its anonymous copy is freed, so a cold
    # start ends with a warm one's RSS
    arrays = cache.put(name, {"shape": list(part_shape)}, packed_weight.to_arrays(packed))
    if not isinstance(arrays["packed"], np.memmap):
        return packed  # not written (a warm entry, a full disk): keep the copy
    mapped = packed_weight.from_arrays(arrays, part_shape, dtype)
    if mapped is None:
        return packed
    backing.append(arrays["packed"])
    return mapped
