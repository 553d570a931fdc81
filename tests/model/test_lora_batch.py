"""LoraBatch on its own: which rows form a segment, and that each row gets its own adapter's
product (and base rows nothing), in float32 and on bfloat16 rows; the compiled kernel
(model/kernels/lora_rows.cpp) gives what the torch path gives, for a batch of many adapters
of uneven ranks, segment lengths and widths."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.lora.adapter import LoraAdapter, LoraProjection
from llmq.worker.engine.lora.lora_batch import LoraBatch

pytestmark = pytest.mark.model


def _projection(g: torch.Generator, in_features: int, ranks: list[int], widths: list[int]
                ) -> LoraProjection:
    """A fused projection of parts side by side: ranks[i] columns of A, B [rank, width] into
    the next widths[i] output columns. A is padded with zero columns as the loaders pad it."""
    padded = -(-sum(ranks) // 16) * 16
    a = torch.zeros(in_features, padded)
    a[:, :sum(ranks)] = torch.randn(in_features, sum(ranks), generator=g)
    blocks, rank_offset, col_start = [], 0, 0
    for rank, width in zip(ranks, widths, strict=True):
        blocks.append((rank_offset, col_start, torch.randn(rank, width, generator=g)))
        rank_offset, col_start = rank_offset + rank, col_start + width
    return LoraProjection(a, blocks)


def _adapter(name: str, seed: int, rank: int = 4) -> LoraAdapter:
    adapter = LoraAdapter(name, rank, cache_salt=seed)
    adapter.weights["0.o"] = _projection(torch.Generator().manual_seed(seed), 8, [rank], [6])
    return adapter


def _expected(base: torch.Tensor, x: torch.Tensor, rows: list[tuple[int, LoraAdapter | None]],
              key: str) -> torch.Tensor:
    """The product of each row's adapter, one row at a time, in float64."""
    expected = base.double().clone()
    row = 0
    for num_rows, adapter in rows:
        projection = None if adapter is None else adapter.weights.get(key)
        if projection is not None:
            xa = x[row:row + num_rows].double() @ projection.a.double()
            for rank_offset, col_start, b in projection.blocks:
                rank, cols = b.shape
                expected[row:row + num_rows, col_start:col_start + cols] += (
                    xa[:, rank_offset:rank_offset + rank] @ b.double())
        row += num_rows
    return expected


def test_runs_of_one_adapter_become_one_segment() -> None:
    a, b = _adapter("a", 1), _adapter("b", 2)
    batch = LoraBatch.from_rows([(1, a), (1, a), (1, None), (3, b), (2, b), (1, a)])
    assert batch.segments == [(0, 2, a), (3, 8, b), (8, 9, a)]
    assert LoraBatch.from_rows([(4, None)]).segments == []


def test_some_rows_keep_their_adapters_numbered_anew() -> None:
    # rows 0-1 a, 2 base, 3-7 b, 8 a; a step's last layer runs the sampled rows 1, 2, 5, 7, 8
    a, b = _adapter("a", 1), _adapter("b", 2)
    batch = LoraBatch.from_rows([(1, a), (1, a), (1, None), (3, b), (2, b), (1, a)])
    assert batch.of_rows([1, 2, 5, 7, 8]).segments == [(0, 1, a), (2, 4, b), (4, 5, a)]
    assert batch.of_rows([2]).segments == []
    assert batch.of_rows([]).segments == []


@pytest.mark.parametrize("with_kernels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_adds_its_own_adapters_product(dtype: torch.dtype, with_kernels: bool,
                                                request: pytest.FixtureRequest) -> None:
    kernels = request.getfixturevalue("cpu_kernels") if with_kernels else None
    a, b = _adapter("a", 1), _adapter("b", 2)
    rows: list[tuple[int, LoraAdapter | None]] = [(2, a), (1, None), (3, b)]
    x = torch.randn(6, 8)
    base = torch.randn(6, 6).to(dtype)
    y = base.clone()
    LoraBatch.from_rows(rows).add_("0.o", x, y, kernels)
    # a projection no adapter targets: nothing
    LoraBatch.from_rows(rows).add_("1.qkv", x, y, kernels)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(y.double(), _expected(base, x, rows, "0.o"), **tolerance)
    assert torch.equal(y[2], base[2])  # the base model's row is untouched


@pytest.mark.parametrize("x_dtype, y_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_the_kernel_equals_the_torch_path_over_many_adapters(
        cpu_kernels, x_dtype: torch.dtype, y_dtype: torch.dtype) -> None:
    # Given eight adapters of uneven ranks on a Q/K/V-like projection (three parts, widths no
    # multiple of 16), one leaving it alone, and a batch of segments of 1 to 9 rows with
    # base-model rows between them
    g = torch.Generator().manual_seed(7)
    in_features, widths = 40, [24, 8, 13]
    adapters = []
    for i, rank in enumerate([1, 3, 4, 8, 16, 5, 20, 16]):
        adapter = LoraAdapter(f"a{i}", rank, cache_salt=i)
        if i != 5:
            adapter.weights["2.qkv"] = _projection(
                g, in_features, [rank, max(1, rank // 2), rank], widths)
        adapters.append(adapter)
    rows: list[tuple[int, LoraAdapter | None]] = []
    for i, adapter in enumerate(adapters):
        rows += [(i % 3 + 1, None), (1 + (i * 5) % 9, adapter)]
    num_rows = sum(n for n, _ in rows)
    x = torch.randn(num_rows, in_features, generator=g).to(x_dtype)
    base = torch.randn(num_rows, sum(widths), generator=g).to(y_dtype)
    # When the kernel and the torch path each add the batch's products
    by_kernel, by_torch = base.clone(), base.clone()
    LoraBatch.from_rows(rows).add_("2.qkv", x, by_kernel, cpu_kernels)
    LoraBatch.from_rows(rows).add_("2.qkv", x, by_torch, None)
    # Then every row holds its own adapter's product, the same from both
    expected = _expected(base, x.float(), rows, "2.qkv")
    tolerance = ({"atol": 1e-4, "rtol": 1e-5} if y_dtype == torch.float32
                 else {"atol": 0.5, "rtol": 0.02})
    torch.testing.assert_close(by_kernel.double(), expected, **tolerance)
    torch.testing.assert_close(by_kernel.double(), by_torch.double(), **tolerance)
    untouched = [r for r, adapter in enumerate(a for n, a in rows for _ in range(n))
                 if adapter is None or adapter is adapters[5]]
    assert torch.equal(by_kernel[untouched], base[untouched])
