"""The `qdot` form: GGUF blocks against activations quantized to int8 (kernels/qdot.h).

Its arithmetic is defined exactly: x rounded to int8 per 32 columns (scale max|x| / 127; per
16 in the `qdot_b16` form), an integer dot product per cell of min(group, block) columns,
combined in float32 with the weights' scales and offsets as float16 holds them (in units of a
power of two per matrix). The kernel must equal that, computed here in float64, to float32
rounding, for every GGUF type, with any number of rows in a call; each row the same bits alone
or among others; and it stays within the form's stated error of the exact product
(form_choice.py measures that error per projection before choosing it).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmq.worker.engine.model.block_quant import BLOCK_QUANT_TYPES, BlockQuant, merge_rows
from llmq.worker.engine.model.cpu_kernels import CpuKernels
from llmq.worker.engine.model.form_choice import HEAD_TOLERANCE, TOLERANCE
from llmq.worker.engine.model.quant_matrix import QuantMatrix
from tests.model.test_block_quant import write_and_read

Q = gguf.GGMLQuantizationType
TYPES = sorted(BLOCK_QUANT_TYPES, key=lambda t: t.name)
IN_FEATURES = 512


def quantized_activations(x: np.ndarray, top: int = 127, block: int = 32) -> np.ndarray:
    """x [rows, in] as the kernel reads it: round(x / s) * s, s = max|x| / top per `block`
    columns (top 127: int8; 16383: `qdot16`'s 15 bits)."""
    blocks = x.reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = (amax / top).astype(np.float32)
    inverse = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 0)
    q = np.rint(blocks * inverse.astype(np.float32))
    return (q * scale).reshape(x.shape).astype(np.float64)


def blocks_of(tmp_path, qtype: Q, out_features: int, seed: int,
              in_features: int = IN_FEATURES) -> tuple[BlockQuant, torch.Tensor]:
    tensor = write_and_read(tmp_path, qtype, (out_features, in_features), seed=seed)
    return BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape), tensor.dequantize()


def weights_as_held(bq: BlockQuant, unit: float) -> torch.Tensor:
    """The matrix [out, in] float64 with its scales and offsets rounded to float16 in `unit`s."""
    def rounded(a: np.ndarray) -> np.ndarray:
        return (a / unit).astype(np.float16).astype(np.float64) * unit
    group = lambda a: np.repeat(rounded(a), bq.group, axis=1)  # noqa: E731
    return torch.from_numpy(bq.q.astype(np.float64) * group(bq.scales) + group(bq.offsets))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("form", "block"), [("qdot", 32), ("qdot_b16", 16)])
def test_the_int8_kernel_computes_the_stated_arithmetic_for_every_type(tmp_path, qtype, form,
                                                                        block):
    # Given a quantized matrix (40 rows: a partial 16-row tile; 768 columns: 24 cells of 32,
    # more than the 16 a batch pass on AVX2 sums before adding them up, kernels/qdot.h
    # QDOT_CHUNK_CELLS) in the qdot layout, against x in int8 a scale per `block` columns
    in_features = 768
    bq, w = blocks_of(tmp_path, qtype, 40, seed=2, in_features=in_features)
    assert QuantMatrix.supports_dot(in_features, bq.group)
    matrix = QuantMatrix(bq, dot=True).against(form)
    for rows in (1, 2, 5, 8, 9, 21):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))

        # When the kernel multiplies (more than 8 rows too: one call, W read once)
        y = CpuKernels.load().quant_matmul(x, matrix).double()

        # Then it is the product of the int8-rounded activations with the weights as held, to
        # float32 rounding
        held = weights_as_held(bq, matrix.unit)
        expected = torch.from_numpy(quantized_activations(x.numpy(), block=block)) @ held.t()
        torch.testing.assert_close(y, expected, rtol=1e-5,
                                   atol=1e-5 * float(expected.abs().max()))
        # And within the form tolerance of the exact float product (~0.5% on these rows)
        exact = x.double() @ w.double().t()
        assert float((y - exact).norm() / exact.norm()) < TOLERANCE / 2


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("form", "block"), [("qdot", 32), ("qdot_b16", 16)])
def test_the_integer_sums_are_exact_at_their_extremes(tmp_path, qtype, form, block):
    # Given every weight of a row at its type's largest magnitude (a 4-bit q at 15, a 6-bit
    # one at 31 or -32, an 8-bit one at 127 or -128), rows of either sign, against x whose
    # every int8 is +-127: the largest sums a cell's integer products reach (AVX2 adds a whole
    # cell's nibble products in int16 lanes, kernels/qdot.h `sum16`: 8 pair sums of 3,810)
    bq, _ = blocks_of(tmp_path, qtype, 40, seed=6)
    six_bit = bq.bits == 8 and bq.q.min() >= -32 and bq.q.max() <= 31
    top, bottom = (15, 15) if bq.bits == 4 else (31, -32) if six_bit else (127, -128)
    bq.q[:] = np.where(np.arange(bq.q.shape[0])[:, None] % 2 == 0, top, bottom)
    matrix = QuantMatrix(bq, dot=True).against(form)
    signs = torch.tensor([1.0, -1.0, 1.0]).repeat(7)[:, None]  # 21 rows: more than a decode's
    x = signs * torch.ones(21, IN_FEATURES)
    x[2::3, 1::2] *= -1  # every third row alternates sign column by column

    # When the kernel multiplies them, all rows in one call and the first alone
    kernels = CpuKernels.load()
    y = kernels.quant_matmul(x, matrix).double()
    alone = kernels.quant_matmul(x[:1], matrix).double()

    # Then both are the product of the int8 activations with the weights as held, to float32
    # rounding: no sum wrapped or saturated
    held = weights_as_held(bq, matrix.unit)
    expected = torch.from_numpy(quantized_activations(x.numpy(), block=block)) @ held.t()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(alone, expected[:1], rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_against_x_in_15_bits_the_error_is_the_scales_alone(tmp_path, qtype):
    # Given a quantized matrix's qdot tiles run against x rounded to 15 bits (`qdot16`)
    bq, w = blocks_of(tmp_path, qtype, 40, seed=3)
    fine = QuantMatrix(bq, dot=True).against("qdot16")
    for rows in (1, 3, 8, 9, 21):
        x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))

        # When the kernel multiplies
        y = CpuKernels.load().quant_matmul(x, fine).double()

        # Then it is the product of the 15-bit activations with the weights as held, to
        # float32 rounding (a cell's integer sum, up to 2^27 here, rounds as it becomes a float)
        held = weights_as_held(bq, fine.unit)
        expected = torch.from_numpy(quantized_activations(x.numpy(), 16383)) @ held.t()
        torch.testing.assert_close(y, expected, rtol=1e-5,
                                   atol=4e-5 * float(expected.abs().max()))
        # And within a tenth of the LM head's tolerance of the exact product (int8 x is not)
        exact = x.double() @ w.double().t()
        assert float((y - exact).norm() / exact.norm()) < HEAD_TOLERANCE / 10


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_x_in_blocks_of_16_columns_errs_less_than_in_blocks_of_32(tmp_path, qtype):
    # Given the same tiles against x in int8 a scale per 32 columns and per 16 (`qdot_b16`)
    bq, w = blocks_of(tmp_path, qtype, 256, seed=5)
    kernels = CpuKernels.load()
    matrix = QuantMatrix(bq, dot=True)
    x = torch.randn(64, IN_FEATURES, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ w.double().t()

    def error(form: str) -> float:
        y = kernels.quant_matmul(x, matrix.against(form)).double()
        return float((y - exact).norm() / exact.norm())
    # Then the finer blocks' error is smaller: by ~12%, for normal x (0.47% against 0.53%;
    # form_choice.py checks the LM head's within 0.5%)
    assert error("qdot_b16") < 0.93 * error("qdot")


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("form", ["qdot", "qdot16", "qdot_b16"])
def test_a_rows_product_is_the_same_bits_whatever_rows_share_the_call(tmp_path, qtype, form):
    # Given 600 rows of activations, each multiplied alone (a decode); more than one panel of
    # rows (the kernel works on 256 KiB of quantized x at a time: 512 rows of 512 columns)
    bq, _ = blocks_of(tmp_path, qtype, 48, seed=4)
    matrix = QuantMatrix(bq, dot=True).against(form)
    kernels = CpuKernels.load()
    x = torch.randn(600, IN_FEATURES, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([kernels.quant_matmul(row[None], matrix) for row in x])
    for rows in (2, 7, 8, 9, 19, 600):
        # When the first `rows` are multiplied in one call, then each row is what it is alone
        assert torch.equal(kernels.quant_matmul(x[:rows], matrix), alone[:rows]), rows


@pytest.mark.usefixtures("cpu_kernels")
def test_the_qdot_layout_holds_fewer_bytes_and_adds_the_bias(tmp_path):
    # Given a Q4_K matrix with a bias, in both layouts
    bq, _ = blocks_of(tmp_path, Q.Q4_K, 48, seed=6)
    bias = torch.randn(48)
    plain, dot = QuantMatrix(bq, bias), QuantMatrix(bq, bias, dot=True)
    # Then the qdot layout holds the same integers with half the scales' bytes: 0.625 bytes
    # a weight against 0.75 (the file's own Q4_K: 0.5625)
    assert dot.q.nbytes == plain.q.nbytes and dot.nbytes == plain.nbytes - 48 * 512 // 32 * 4
    assert dot.nbytes / (48 * 512) == 0.625
    # And the kernel adds the bias to the product
    x = torch.randn(3, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    kernels = CpuKernels.load()
    torch.testing.assert_close(kernels.quant_matmul(x, dot) - bias,
                               kernels.quant_matmul(x, QuantMatrix(bq, dot=True)))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K], ids=lambda t: t.name)
def test_six_bit_types_are_held_in_six_bits_and_compute_the_stated_arithmetic(tmp_path, qtype):
    # Given a matrix whose integers all lie in -32..31 (Q6_K, a Q5 type) in the qdot layout
    bq, w = blocks_of(tmp_path, qtype, 32, seed=7)
    matrix = QuantMatrix(bq, dot=True)
    # Then its tiles hold 0.75 bytes a weight, where the 8-bit layout took 1, and the tied
    # embedding's lookups read them back
    weights = bq.q.size
    assert matrix.bits == 6 and matrix.q.nbytes == weights * 3 // 4
    assert matrix.nbytes == weights * 3 // 4 + weights // bq.group * 2 * (
        1 if matrix.offsets is None else 2)
    ids = torch.tensor([0, len(w) - 1, 17, 5])
    torch.testing.assert_close(matrix.rows(ids), w[ids], rtol=0,
                               atol=2e-3 * float(w.abs().max()))
    for rows in (1, 3, 8, 9, 21, 70):
        x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))
        # When the kernel multiplies (up to 8 rows unpacking a tile in registers, more into a
        # buffer once a tile)
        y = CpuKernels.load().quant_matmul(x, matrix).double()
        # Then it is the int8-rounded activations times the weights as held, to float32 rounding
        expected = torch.from_numpy(quantized_activations(x.numpy())) @ weights_as_held(
            bq, matrix.unit).t()
        torch.testing.assert_close(y, expected, rtol=1e-5,
                                   atol=1e-5 * float(expected.abs().max()))


@pytest.mark.usefixtures("cpu_kernels")
def test_a_fused_matrix_of_two_types_holds_each_in_its_own_layout(tmp_path):
    # Given a fused QKV as Q4_K_M writes it: Q and K rows in Q4_K, V rows in Q6_K, with a bias
    parts = [blocks_of(tmp_path, qtype, rows, seed=20 + i)
             for i, (qtype, rows) in enumerate([(Q.Q4_K, 64), (Q.Q4_K, 32), (Q.Q6_K, 32)])]
    bq = merge_rows([b for b, _ in parts])
    bias = torch.randn(128, generator=torch.Generator().manual_seed(3))
    matrix = QuantMatrix(bq, bias, dot=True)
    # Then the qdot tiles hold the Q4_K rows in 4 bits with offsets and the Q6_K rows in 6
    # without: 0.625 and 0.875 bytes a weight, where merged into V's kind all took 1
    assert matrix.kind == "q4g32+q6g16s"
    assert matrix.nbytes == 96 * IN_FEATURES * 5 // 8 + 32 * IN_FEATURES * 7 // 8
    merged = BlockQuant(bq.q, bq.scales, bq.offsets, bq.group, bq.bits)
    assert QuantMatrix(merged, dot=True).nbytes == 128 * IN_FEATURES
    kernels = CpuKernels.load()
    q4 = QuantMatrix(merge_rows([parts[0][0], parts[1][0]]), bias[:96], dot=True)
    q6 = QuantMatrix(parts[2][0], bias[96:], dot=True)
    w = torch.cat([dense for _, dense in parts]).double()
    for form in ("qdot", "qdot16", "qdot_b16"):
        fused = matrix.against(form)
        for rows in (1, 3, 9, 70):
            x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))
            # When one call multiplies x by the fused matrix
            y = kernels.quant_matmul(x, fused)
            # Then it is each part's own product, side by side, bit for bit, biases added
            assert torch.equal(y, torch.cat([kernels.quant_matmul(x, q4.against(form)),
                                             kernels.quant_matmul(x, q6.against(form))], dim=1))
            # and within the form's error of the exact product
            exact = x.double() @ w.t() + bias.double()
            error = float((y.double() - exact).abs().max() / exact.abs().max())
            assert error < TOLERANCE, (form, rows, error)
