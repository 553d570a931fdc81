"""GGUF block-quantized matrices run natively: decoded exactly, multiplied without a dense copy.

Per quant type, a small matrix is written with gguf.GGUFWriter and read back the way the
loader reads it (raw blocks). Its decoding must reproduce gguf-py's float32 dequantization bit
for bit, and both native kernels must multiply by it: the compiled one in float32 arithmetic
(float32 rounding from the dequantized product), torch's int4 one where the type maps onto it
(bfloat16 activations, scales and outputs: ~1% of the largest output).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmq.worker.engine.model.block_quant import (
    BLOCK_QUANT_TYPES,
    BlockQuant,
    QuantizedEmbedding,
    merge_rows,
)
from llmq.worker.engine.model.cached_forms import block_rows
from llmq.worker.engine.model.cpu_kernels import CpuKernels
from llmq.worker.engine.model.gguf_loader import QuantizedTensor
from llmq.worker.engine.model.int4_weight import Int4Weight
from llmq.worker.engine.model.quant_matrix import QuantMatrix
from tests.fixtures.tiny_gguf import quantized

Q = gguf.GGMLQuantizationType
TYPES = sorted(BLOCK_QUANT_TYPES, key=lambda t: t.name)


def write_and_read(tmp_path, qtype: Q, shape: tuple[int, int], seed: int) -> QuantizedTensor:
    """One [out, in] matrix of `qtype` through a GGUF file, back as the loader keeps it."""
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("m", quantized(w, qtype, seed), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(path).tensors
    return QuantizedTensor(tensor.tensor_type, np.asarray(tensor.data).reshape(shape[0], -1),
                           shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_decode_to_exactly_the_dequantized_matrix(tmp_path, qtype):
    # Given a quantized matrix read back from a GGUF file
    tensor = write_and_read(tmp_path, qtype, (48, 512), seed=1)

    # When its blocks are decoded into integers with a scale and an offset per group
    bq = BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape)

    # Then q * scale + offset is gguf-py's float32 dequantization, bit for bit
    assert np.array_equal(bq.dequantize(), tensor.dequantize().numpy())
    if bq.bits == 4:
        assert 0 <= bq.q.min() and bq.q.max() <= 15
    # And so are the torch forms the loader uses (the int8 copy's source, a tied head's table)
    assert torch.equal(bq.dequantize_torch(), tensor.dequantize())
    table = torch.empty(tensor.shape)
    QuantizedEmbedding(bq).dequantize_into(table)
    assert torch.equal(table, tensor.dequantize())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_looked_up_from_qdot_tiles_are_the_matrix_rows(tmp_path, qtype):
    # Given a quantized matrix (a tied embedding) laid out as qdot tiles, with a partial
    # last tile (40 rows: tiles of 16)
    tensor = write_and_read(tmp_path, qtype, (40, 512), seed=4)
    bq = BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape)
    assert QuantMatrix.supports_dot(512, bq.group)
    tiles = QuantMatrix(bq, dot=True)

    # When rows are looked up from the tiles (token ids, repeated, out of order, each tile)
    ids = torch.tensor([39, 0, 17, 15, 16, 32, 0])
    rows = tiles.rows(ids)

    # Then they are the matrix's rows, to the float16 scales' rounding (2^-11 of each)
    expected = tensor.dequantize()[ids]
    assert rows.shape == (7, 512)
    assert float((rows - expected).abs().max()) <= 2e-3 * float(expected.abs().max())


@pytest.mark.parametrize(("first", "second"), [(Q.Q4_K, Q.Q6_K), (Q.Q4_0, Q.Q8_0),
                                               (Q.Q6_K, Q.Q4_1)])
def test_rows_of_mixed_types_merge_into_one_exact_matrix(tmp_path, first, second):
    # Given a fused matrix whose row blocks have different types (Q4_K_M's QKV with V in Q6_K)
    parts = [write_and_read(tmp_path, first, (32, 256), seed=2),
             write_and_read(tmp_path, second, (16, 256), seed=3)]
    # When merged, then it dequantizes to the parts' own numbers, stacked
    decoded = [BlockQuant.from_gguf(t.qtype, t.data, t.shape) for t in parts]
    merged = merge_rows(decoded)
    assert np.array_equal(merged.dequantize(),
                          np.concatenate([t.dequantize().numpy() for t in parts]))
    assert merged.group == 16 if Q.Q6_K in (first, second) else merged.group == 32
    # And it keeps each type's rows as a block of its own kind, for the qdot tiles (QuantMatrix)
    assert [(b.shape, b.group, b.bits) for b in merged.row_blocks] == [
        (d.shape, d.group, d.bits) for d in decoded]
    assert np.array_equal(np.concatenate([b.dequantize() for b in merged.row_blocks]),
                          merged.dequantize())
    # and rows taken across the two blocks are those rows, each block's in its own kind
    rows = block_rows(merged, 24, 40)
    assert np.array_equal(rows.dequantize(), merged.dequantize()[24:40])
    assert [b.shape[0] for b in rows.row_blocks] == [8, 8]


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [48, 40])
def test_the_compiled_kernel_multiplies_in_float32(tmp_path, qtype, out_features):
    # Given a quantized matrix (40 rows: a partial 16-row tile) and 1..8 rows of activations
    tensor = write_and_read(tmp_path, qtype, (out_features, 512), seed=2)
    w = tensor.dequantize()  # [out, in] float32
    matrix = QuantMatrix(BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape))
    for rows in range(1, CpuKernels.MAX_QUANT_ROWS + 1):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))

        # When the kernel multiplies by it without dequantizing
        y = CpuKernels.load().quant_matmul(x, matrix)

        # Then it is the float32 product with the dequantized matrix, to float32 rounding
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5 * float(w.abs().max()))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_product_is_the_same_bits_whatever_rows_share_the_call(tmp_path, qtype):
    # Given a quantized matrix and 8 rows of activations, each multiplied alone (a decode)
    tensor = write_and_read(tmp_path, qtype, (40, 512), seed=4)
    matrix = QuantMatrix(BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape))
    kernels = CpuKernels.load()
    x = torch.randn(CpuKernels.MAX_QUANT_ROWS, 512, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([kernels.quant_matmul(row[None], matrix) for row in x])
    for rows in range(2, CpuKernels.MAX_QUANT_ROWS + 1):
        # When the first `rows` of them are multiplied in one call (a speculative
        # verification's rows, a batch of decodes)
        y = kernels.quant_matmul(x[:rows], matrix)
        # Then every row is exactly what it is alone: greedy decoding cannot depend on which
        # rows share a step (tests/engine/test_spec_decode.py)
        assert torch.equal(y, alone[:rows]), rows


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_a_symmetric_types_tiles_hold_no_offsets_and_give_the_same_bits(tmp_path, qtype):
    # Given a matrix of a type whose offsets are all zero (40 rows: a partial 16-row tile)
    tensor = write_and_read(tmp_path, qtype, (40, 512), seed=5)
    bq = BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape)
    assert not bq.offsets.any()

    # When laid out for the kernels
    matrix = QuantMatrix(bq)

    # Then its tiles hold no offsets: smaller by exactly their float32 bytes (3 tiles of
    # [groups, 16]; a lone decode reads every byte of them once a token)
    assert matrix.offsets is None and matrix.kind == f"q8g{bq.group}s"
    zeros = torch.zeros(3, 512 // bq.group, 16)
    with_offsets = QuantMatrix.from_tiles(matrix.q, matrix.scales, zeros, bq.shape, bq.group,
                                          bq.bits)
    assert with_offsets.nbytes - matrix.nbytes == zeros.nbytes == 3 * 512 // bq.group * 64
    # And the products are those with the zero offsets added, to float32 rounding (the
    # compiler may fuse the scaling into the running total now that nothing is added to it),
    # and the float32 product's; every row the same bits alone or in a call of 8 rows
    kernels = CpuKernels.load()
    x = torch.randn(CpuKernels.MAX_QUANT_ROWS, 512, generator=torch.Generator().manual_seed(3))
    y = kernels.quant_matmul(x, matrix)
    w = tensor.dequantize()
    tolerance = {"rtol": 1e-5, "atol": 1e-5 * float(w.abs().max())}
    torch.testing.assert_close(y, kernels.quant_matmul(x, with_offsets), **tolerance)
    torch.testing.assert_close(y, x @ w.t(), **tolerance)
    assert torch.equal(y, torch.cat([kernels.quant_matmul(row[None], matrix) for row in x]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_int4_kernel_runs_the_types_that_map_onto_it(tmp_path, qtype):
    # Given a quantized matrix
    tensor = write_and_read(tmp_path, qtype, (48, 512), seed=3)
    bq = BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape)

    # When it is packed for torch's int4 kernel
    weight = Int4Weight.from_block_quant(bq)

    # Then every type with 32-column groups runs on it (Q6_K's 16-column groups do not), and
    # gives the product to bfloat16 precision
    if bq.group != 32:
        assert weight is None
        return
    assert weight is not None
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = x @ tensor.dequantize().t()
    y = weight(x.bfloat16()).float()
    assert (y - expected).abs().max() < 0.01 * expected.abs().max()
