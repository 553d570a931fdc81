"""The KV cache on 2 MiB pages (worker/engine/model/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.worker.engine.model import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib(t: torch.Tensor) -> int:
    """KiB of t's memory on huge pages: /proc/self/smaps, the mappings t's bytes overlap
    (madvise splits the one malloc made where the 2 MiB pages start and end)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    kib, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            kib += int(line.split()[1])
    return kib


def test_a_kv_cache_layer_is_zeros_on_huge_pages_where_the_kernel_grants_them():
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("this kernel grants no transparent huge pages (THP never or absent)")
    # Given a layer's cache of 24 MiB, as a 1B model's budget gives
    shape = (2, 8, 768, 16, 64)

    # When it is made as the model makes its KV caches
    cache = huge_pages.zeros(shape, torch.bfloat16)

    # Then it is zeros of that shape, and most of it lies on 2 MiB pages
    assert cache.shape == shape and cache.dtype == torch.bfloat16
    assert not cache.any()
    assert huge_kib(cache) >= cache.numel() * cache.element_size() // 1024 // 2
