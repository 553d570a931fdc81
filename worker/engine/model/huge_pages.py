"""Memory on 2 MiB pages: the KV cache, which attention reads at random blocks, and the
weights a decode streams, which the repack cache maps from files (`read_in`).

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

A file's map takes 2 MiB pages where the page cache holds the file in 2 MiB folios: what a
large write leaves (a cold start writes each repack file in one call, repack_cache.py `_save`),
but not what a plain read or a fault of an unadvised map reads back after the cache was evicted
(a reboot, memory pressure): small folios, kept for as long as the page cache keeps them.
`read_in` reads a file in through a map advised for huge pages, so its readahead reads 2 MiB
folios. What it is worth (Zen 4, the 1B model's lone decode, median CPU time a token of 5
starts alternated with the code before;
bench/results/lone_huge_pages-zen4-2026-12-06-twentyfourth.txt): after the repack files were
evicted, 35.65 ms with 659 of the maps' 672 MB on 2 MiB pages against 37.64 with none; with
4 KiB pages one core's hardware prefetcher stops at every page's end.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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


@functools.cache
def _granted() -> bool:
    """Whether this kernel grants transparent huge pages at all (not `never`, not absent)."""
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def read_in(path: Path) -> None:
    """Bring the file into the page cache, in 2 MiB folios where it is not cached yet: a byte
    of each 2 MiB read through a read-only map advised for huge pages. Cheap where it is
    cached (a fault a 2 MiB, no read). NOTE: not through the copy-on-write maps the repack
    cache hands out: private and writable, their faults read small folios in, advised or not
    (Linux 6.18, ext4); they map the folios this reads as 2 MiB pages."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not _granted():
            return  # left to the maps' faults: nothing to gain from reading it now
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages
                return
            for offset in range(0, size, HUGE_PAGE):
                mm[offset]  # the fault reads the folio in


def file_maps(suffix: str = ".npy") -> tuple[int, int]:
    """(bytes resident, bytes of those mapped as 2 MiB pages) of this process's maps of files
    named `*suffix` (by default the repack cache's arrays), from /proc/self/smaps: a
    benchmark prints it beside a lone decode's rate, which it moves by ~5%. (0, 0) where
    there is none or no smaps (another OS)."""
    resident = huge = 0
    inside = False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1].endswith(suffix)
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
        elif inside and fields[0] == "FilePmdMapped:":
            huge += int(fields[1]) * 1024
    return resident, huge


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
