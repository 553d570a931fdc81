"""The int8 form of a projection (int8_matrix.py): x W^T through torch's int8 GEMM, each row of
x as two int8 terms, W int8 per output channel. What a user relies on: a prefill's projections
are the float ones to within the weights' int8 rounding, whatever the batch around a row."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.model.cpu_kernels import INT8_CHUNK_ROWS
from llmq.worker.engine.model.int8_matrix import Int8Matrix

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def representable(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix whose rows are an exact float scale times integers in [-127, 127], each row
    reaching 127 in magnitude: int8 per row holds it exactly. Returns (matrix, scales)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols), generator=g)
    q[:, 0] = 127
    scales = torch.rand(rows, generator=g) * 0.1 + 0.01
    return q.float() * scales[:, None], scales


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_what_int8_holds_exactly_comes_out_exactly(cpu_kernels, rows):
    # Given weights and inputs that int8 per row represents exactly
    w, _ = representable(96, 160, seed=1)
    x, _ = representable(rows, 160, seed=2)
    bias = torch.randn(96)

    # When the int8 form multiplies them
    y = cpu_kernels.int8_matmul(x, Int8Matrix(w, bias))

    # Then the result is the float64 product to float32 rounding (the integer products are
    # exact; only the final scaling rounds)
    expected = (x.double() @ w.double().t() + bias.double()).float()
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=2e-6 * float(expected.abs().max()))


def test_outlier_channels_keep_the_other_channels_precise(cpu_kernels):
    # Given activations like a Llama's: a few channels 100x the rest (per-token int8 alone
    # would give the small channels ~1 level of 127)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 576, generator=g)
    x[:, [7, 300]] *= 100
    w = torch.randn(960, 576, generator=g) * 0.05
    int8 = Int8Matrix(w)

    # When the int8 form multiplies them
    y = cpu_kernels.int8_matmul(x, int8)

    # Then the activations' two int8 terms cost a tenth of what one term per token would
    # (measured 2e-4 against 1e-2 here), and the result is within 1% of the float product
    int8_weights = (int8.q.float() * int8.scale[:, None]).t()
    s = x.abs().amax(dim=1, keepdim=True) / 127
    one_term = (torch.round(x / s) * s) @ int8_weights
    weights_only = x @ int8_weights
    assert (y - weights_only).norm() <= 0.1 * (one_term - weights_only).norm()
    exact = x @ w.t()
    assert (y - exact).norm() <= 0.01 * exact.norm()


def test_a_row_gets_the_same_numbers_in_any_batch(cpu_kernels):
    # Given one row, alone and among others in a batch that spans several chunks
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 64, generator=g)
    int8 = Int8Matrix(w)
    batch = torch.randn(2 * INT8_CHUNK_ROWS + 5, 64, generator=g)
    row = batch[INT8_CHUNK_ROWS + 3:INT8_CHUNK_ROWS + 4].clone()

    # When both are multiplied
    alone = cpu_kernels.int8_matmul(row, int8)
    in_batch = cpu_kernels.int8_matmul(batch, int8)

    # Then the row's result is bit for bit the same (per-row scales, exact integer sums)
    assert torch.equal(alone[0], in_batch[INT8_CHUNK_ROWS + 3])


def test_zero_rows_and_zero_weights_give_zeros_not_nan(cpu_kernels):
    w = torch.randn(32, 64)
    w[5] = 0
    x = torch.randn(12, 64)
    x[[0, 11]] = 0
    y = cpu_kernels.int8_matmul(x, Int8Matrix(w))
    assert torch.isfinite(y).all()
    assert (y[0] == 0).all() and (y[11] == 0).all() and (y[:, 5] == 0).all()
