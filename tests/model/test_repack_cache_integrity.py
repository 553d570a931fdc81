"""The repack cache (repack_cache.py) never serves what does not belong to the file loaded: a
file replaced in place is rebuilt even when its size and mtime are kept, and a damaged entry
is dropped with one warning and rebuilt, never a crash and never other numbers."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from llmq.worker.engine.model import block_quant, repack_cache
from llmq.worker.engine.model.loader import load_model
from tests.fixtures.models import greedy_paged
from tests.fixtures.tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.usefixtures("cpu_kernels")
PROMPTS = [[5, 9, 14], [3, 200, 7, 31, 8, 2, 11, 40, 9, 17]]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "repacked"
    monkeypatch.setenv(repack_cache.ENV, str(path))
    # NOTE: the forms by assumption (an int8 form, the head's float32 one), whose files these
    # tests damage; the forms chosen by measurement differ by CPU
    monkeypatch.setenv("LLMQ_FORMS", "fixed")
    return path


def run(path) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_paged(load_model(path, "float32", weights="native").model, PROMPTS, 5)


def uncached(path, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    with monkeypatch.context() as patch:
        patch.setenv(repack_cache.ENV, "off")
        return run(path)


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def the_entry(cache_dir):
    (entry,) = [p for p in cache_dir.iterdir() if ".tmp-" not in p.name]
    return entry


def damage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == repack_cache.__name__ and r.levelno == logging.WARNING]


def test_a_file_replaced_with_the_same_size_and_mtime_is_not_served_the_old_entry(
        tmp_path, cache_dir, monkeypatch):
    # Given a model loaded once (its entry written)
    path = tmp_path / "model.gguf"
    write_tiny_llama(path, seed=3)
    run(path)
    before = path.stat()
    old_entry = the_entry(cache_dir).name

    # When another model of the same shapes is copied over it, keeping size and mtime
    write_tiny_llama(path, seed=4)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size,
                                                              before.st_mtime_ns)

    # Then it loads with its own numbers, from a new entry (the old one dropped)
    assert_same(run(path), uncached(path, monkeypatch))
    assert the_entry(cache_dir).name != old_entry


@pytest.mark.parametrize("damage", ["zeroed data", "cut short", "garbage header", "bad manifest"])
def test_a_damaged_entry_is_rebuilt_with_one_warning(tmp_path, cache_dir, caplog, damage):
    # Given an entry damaged as a crash, a full disk or a stray write leaves one
    path = tmp_path / "model.gguf"
    write_tiny_llama(path, seed=3)
    cold = run(path)
    entry = the_entry(cache_dir)
    victim = next(entry.glob("*.int8.q.npy"))
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        data_start = f.tell()
        if damage == "zeroed data":  # the right size, the data never reached the disk
            f.seek(data_start)
            f.write(bytes(size - data_start))
        elif damage == "cut short":
            f.truncate(size // 2)
        elif damage == "garbage header":
            f.seek(0)
            f.write(b"\x00garbage" * 8)
    if damage == "bad manifest":
        (entry / repack_cache.MANIFEST).write_text("{not json")

    # When the model loads again
    with caplog.at_level(logging.WARNING, logger=repack_cache.__name__):
        warm = run(path)

    # Then it gives the cold load's numbers, says so once, and the entry is whole again
    assert_same(warm, cold)
    warnings = damage_warnings(caplog)
    assert len(warnings) == 1 and "damaged" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=repack_cache.__name__):
        assert_same(run(path), cold)
    assert damage_warnings(caplog) == []
    assert victim.stat().st_size == size


def test_the_tied_heads_dense_form_is_mapped_on_a_warm_load(tmp_path, cache_dir, monkeypatch):
    # Given a tied-head model loaded once, and its LM head run on more rows than the
    # quantized kernels take (its dense form)
    path = tmp_path / "model.gguf"
    write_tiny_llama(path, seed=3, tie_word_embeddings=True)
    cold = load_model(path, "float32", weights="native").model
    hidden = torch.randn(12, cold.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    cold_logits = cold.compute_logits(hidden)
    assert any(the_entry(cache_dir).glob("lm_head.dense.*.npy"))

    # When it loads again with the dense head's decoding made impossible
    def refuse(*args, **kwargs):
        raise AssertionError("a warm load decoded the tied head")
    monkeypatch.setattr(block_quant.QuantizedEmbedding, "dequantize_into", refuse)
    warm = load_model(path, "float32", weights="native").model

    # Then the head's dense form comes from the entry, with identical logits
    assert torch.equal(warm.compute_logits(hidden), cold_logits)
