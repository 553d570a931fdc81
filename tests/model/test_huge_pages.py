"""The KV cache on 2 MiB pages, and the repack cache's streamed forms mapped on them
(worker/engine/model/huge_pages.py, repack_cache.py)."""

from __future__ import annotations

import gc
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from llmq.worker.engine.model import huge_pages, repack_cache

THP = huge_pages.THP_MODE


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


MIB = 1 << 20


def pmd_mapped_kib(array: np.ndarray) -> int:
    """How much of the file map holding `array` is mapped as 2 MiB pages, once it is read."""
    assert int(array.sum()) >= 0  # every page faulted in
    return sum(smaps_field(torch.from_numpy(array), "FilePmdMapped"))


def evict(folder: Path) -> None:
    """What a reboot or memory pressure does to the page cache: the files' pages dropped."""
    for path in folder.glob("*.npy"):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())  # dirty pages are not dropped
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.fixture
def file_huge_pages(tmp_path) -> None:
    """Skip where this kernel or filesystem maps no file on 2 MiB pages: a file written in
    one call, mapped and read, must be (Linux 6.x with large folios, ext4 or XFS)."""
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("this kernel grants no transparent huge pages (THP never or absent)")
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(4 * MIB))
    with open(probe, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mm.madvise(mmap.MADV_HUGEPAGE)
        if not pmd_mapped_kib(np.frombuffer(mm, dtype=np.uint8)):
            pytest.skip(f"{tmp_path}'s filesystem keeps no 2 MiB folios in the page cache")


def weights() -> np.ndarray:
    """A streamed form's array as the repack cache writes it: 8 MiB, so its file (with the
    .npy header) holds four whole 2 MiB pieces."""
    return np.random.default_rng(0).integers(0, 255, 8 * MIB, dtype=np.uint8)


@pytest.mark.usefixtures("file_huge_pages")
def test_a_cold_starts_forms_are_mapped_on_huge_pages_from_their_first_byte(tmp_path):
    # Given a cold start writing a form to the repack cache
    cache = repack_cache.RepackCache(tmp_path, "entry")

    # When it maps back what it wrote (as it then runs it)
    mapped = cache.put("blk.0.ffn_down.qdot", {}, {"q": weights()})["q"]

    # Then the map is on 2 MiB pages for the file's every whole 2 MiB, its first included
    # (np.save's header, written apart, would have left the first 2 MiB in small folios)
    assert np.array_equal(mapped, weights())
    assert pmd_mapped_kib(mapped) == 8 * 1024


@pytest.mark.usefixtures("file_huge_pages")
def test_the_benchmarks_count_the_repack_maps_on_huge_pages(tmp_path):
    # Given the process's repack maps so far (earlier tests' garbage freed first, so that none
    # is freed between the two counts), and then one more form mapped and read
    gc.collect()
    resident, huge = huge_pages.file_maps()
    cache = repack_cache.RepackCache(tmp_path, "entry")
    mapped = cache.put("blk.0.ffn_down.qdot", {}, {"q": weights()})["q"]
    assert int(mapped.sum()) > 0

    # When the benchmarks count them (bench/engine.py and step_profile.py print it)
    now_resident, now_huge = huge_pages.file_maps()

    # Then the new map's 8 MiB are counted, on 2 MiB pages
    assert now_resident - resident >= 8 * MIB
    assert now_huge - huge == 8 * MIB


@pytest.mark.usefixtures("file_huge_pages")
def test_a_streamed_form_is_mapped_on_huge_pages_after_the_page_cache_was_evicted(tmp_path):
    # Given an entry written by a cold start, then its files evicted from the page cache
    cold = repack_cache.RepackCache(tmp_path, "entry")
    cold.put("blk.0.ffn_down.qdot", {}, {"q": weights()})
    cold.commit()
    evict(tmp_path / "entry")

    # When a warm start checks the entry, then maps the form as one a decode streams
    warm = repack_cache.RepackCache(tmp_path, "entry")
    assert warm.warm
    found = warm.get("blk.0.ffn_down.qdot", streamed=True)

    # Then the map is on 2 MiB pages for every whole 2 MiB of the file, the pieces the
    # check read included, and holds the bytes written
    assert found is not None
    mapped = found[1]["q"]
    assert np.array_equal(mapped, weights())
    assert pmd_mapped_kib(mapped) == 8 * 1024


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(24, dtype=np.int16).reshape(4, 6)),
    np.arange(40, dtype=np.uint16).reshape(8, 5)[::2, 1:4],  # a strided view
    np.zeros((0, 7), dtype=np.float16),
    np.float32(2.5),
], ids=["float32", "fortran", "strided", "empty", "scalar"])
def test_the_cache_writes_the_files_np_save_writes(tmp_path, array):
    # Given an array as the repack cache stores one
    cache = repack_cache.RepackCache(tmp_path, "entry")

    # When it is staged
    mapped = cache.put("form", {}, {"part": array})["part"]

    # Then its file is byte for byte the one np.save writes, and maps back the same values
    np.save(tmp_path / "expected.npy", np.ascontiguousarray(array))
    staged = next(tmp_path.glob("entry.tmp-*")) / "form.part.npy"
    assert staged.read_bytes() == (tmp_path / "expected.npy").read_bytes()
    assert np.array_equal(mapped, np.ascontiguousarray(array))
