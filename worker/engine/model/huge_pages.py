"""Tensors on 2 MiB pages: the KV cache, which attention reads at random blocks.

A decode step reads each sequence's K/V blocks where its block table puts them: with 4 KiB
pages nearly every block is a page of its own, and a batch's step walks more pages than the TLB
holds (64 sequences x ~10 blocks x 3 kv heads x K and V x 30 layers: ~115,000). On 2 MiB pages
a layer's cache is a few dozen. The cache is zeroed on ordinary pages, then marked for huge
pages (`madvise(MADV_HUGEPAGE)`, where transparent huge pages are `always` or `madvise`, the
default of most distributions): the kernel's khugepaged moves it onto 2 MiB pages in the
background at its own pace (by default 16 MiB each 10 s: a 1.4 GiB cache in ~15 minutes;
measured here: 1.44 GiB zeroed in 0.39 s, 224 MiB of it on huge pages 135 s later). NOTE:
marked before its first touch instead, the faults took huge pages at once, but where memory was
fragmented the kernel compacted it first, in the fault (THP defrag `madvise`): the default
model's 30 layers of 48 MiB took 1.0-5.2 s to zero where 4 KiB pages take 0.4 s, a worker's
start that much later. `collapse` moves a tensor at once, at that cost
(bench/attention_pages.py).

Measured with blocks scattered as a long-running worker's are (bench/attention_pages.py, Zen 4,
median): SmolLM2's shape, 30 layers x 64 sequences x ~147 keys, 35.9 ms on 4 KiB pages and 30.9
on 2 MiB; the 1B's, 16 layers x 32 x ~192, 40.8 and 31.7. A fresh cache's blocks in order (a
benchmark's) gain nothing measurable.

Where the kernel refuses (THP `never`, another OS), the tensor is on ordinary pages: the same
bytes, only slower.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def _advise(t: torch.Tensor, advice: int) -> bool:
    """madvise(advice) on t's whole 2 MiB pages; False where refused or there are none."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if _MADVISE is None or end <= start:
        return False
    if _MADVISE(start, end - start, advice):
        logger.debug("madvise(%d) refused (errno %d)", advice, ctypes.get_errno())
        return False
    return True


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype), its whole 2 MiB pages marked for khugepaged to move onto huge
    pages in the background."""
    t = torch.zeros(shape, dtype=dtype)
    _advise(t, MADV_HUGEPAGE)
    return t


def collapse(t: torch.Tensor) -> bool:
    """Move t's whole 2 MiB pages onto huge pages now (MADV_COLLAPSE, Linux 6.1+), compacting
    memory if it must; False where the kernel refuses."""
    return _advise(t, MADV_COLLAPSE)
