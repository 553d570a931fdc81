"""LoraBatch on its own: which rows form a segment, and that each row gets its own adapter's
product (and base rows nothing), in float32 and on a bfloat16 output."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.lora.adapter import LoraAdapter
from llmq.worker.engine.lora.lora_batch import LoraBatch

pytestmark = pytest.mark.model


def _adapter(name: str, seed: int, rank: int = 4) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, rank, cache_salt=seed)
    adapter.weights["0.o"] = (torch.randn(8, rank, generator=g), torch.randn(rank, 6, generator=g))
    return adapter


def test_runs_of_one_adapter_become_one_segment() -> None:
    a, b = _adapter("a", 1), _adapter("b", 2)
    batch = LoraBatch.from_rows([(1, a), (1, a), (1, None), (3, b), (2, b), (1, a)])
    assert batch.segments == [(0, 2, a), (3, 8, b), (8, 9, a)]
    assert LoraBatch.from_rows([(4, None)]).segments == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_adds_its_own_adapters_product(dtype: torch.dtype) -> None:
    a, b = _adapter("a", 1), _adapter("b", 2)
    rows = [(2, a), (1, None), (3, b)]
    x = torch.randn(6, 8)
    base = torch.randn(6, 6).to(dtype)
    y = base.clone()
    LoraBatch.from_rows(rows).add_("0.o", x, y)
    LoraBatch.from_rows(rows).add_("1.qkv", x, y)  # a projection no adapter targets: nothing
    expected = base.float().clone()
    expected[0:2] += x[0:2] @ a.weights["0.o"][0] @ a.weights["0.o"][1]
    expected[3:6] += x[3:6] @ b.weights["0.o"][0] @ b.weights["0.o"][1]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(y.float(), expected, **tolerance)
    assert torch.equal(y[2], base[2])  # the base model's row is untouched
