"""Tensors on 2 MiB pages: the KV cache, which attention reads at random blocks.

A decode step reads each sequence's K/V blocks where its block table puts them: with 4 KiB
pages nearly every block is a page of its own, and a batch's step walks more pages than the
TLB holds (64 sequences x ~10 blocks x 3 kv heads x K and V x 30 layers: ~115,000). On 2 MiB
pages a layer's cache is a few dozen. Linux gives a mapping huge pages on request
(`madvise(MADV_HUGEPAGE)`) where transparent huge pages are `always` or `madvise` (the default
of most distributions); asked before the memory is first touched, its faults take huge pages.

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


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype), its whole 2 MiB pages asked for as huge pages before they are
    first touched (the zeroing faults them in)."""
    t = torch.empty(shape, dtype=dtype)
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if _MADVISE is not None and end > start and _MADVISE(start, end - start, MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KiB pages",
                     ctypes.get_errno())
    return t.zero_()
