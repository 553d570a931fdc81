"""The KV cache on 2 MiB pages (worker/engine/model/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.worker.engine.model import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps_field(t: torch.Tensor, field: str) -> list[int]:
    """`field`'s value in /proc/self/smaps for each mapping t's bytes overlap (madvise splits
    the one malloc made where the 2 MiB pages start and end)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    values, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == field + ":":
            values.append(int(line.split()[1]))
    return values


def test_a_kv_cache_layer_is_zeros_that_khugepaged_may_move_onto_huge_pages():
    if not THP.exists() or "[madvise]" not in THP.read_text():
        pytest.skip("THP is not `madvise` here: under `always` every mapping is eligible, "
                    "under `never` none")
    # Given a layer's cache of 24 MiB, as a 1B model's budget gives
    shape = (2, 8, 768, 16, 64)

    # When it is made as the model makes its KV caches
    cache = huge_pages.zeros(shape, torch.bfloat16)

    # Then it is zeros of that shape, and the mapping holding its whole 2 MiB pages is
    # eligible for huge pages (khugepaged moves it in the background)
    assert cache.shape == shape and cache.dtype == torch.bfloat16
    assert not cache.any()
    assert 1 in smaps_field(cache, "THPeligible")


def test_collapse_moves_a_tensor_onto_huge_pages_at_once():
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("this kernel grants no transparent huge pages (THP never or absent)")
    # Given a 24 MiB cache as the model makes it, with values
    cache = huge_pages.zeros((2, 8, 768, 16, 64), torch.bfloat16)
    cache.fill_(1.5)

    # When it is collapsed (as bench/attention_pages.py does)
    if not huge_pages.collapse(cache):
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+)")

    # Then most of it lies on 2 MiB pages, its values kept
    assert sum(smaps_field(cache, "AnonHugePages")) >= cache.numel() * 2 // 1024 // 2
    assert bool((cache == 1.5).all())
