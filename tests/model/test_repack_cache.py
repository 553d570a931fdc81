"""The repack cache (repack_cache.py): a second load of a GGUF maps the forms the first one
built, gives the same numbers, and never takes another file's or another CPU's entry."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmq.worker.engine.model import block_quant, repack_cache
from llmq.worker.engine.model.gguf_reader import FastGGUFReader
from llmq.worker.engine.model.linear import Linear
from llmq.worker.engine.model.loader import load_model
from llmq.worker.engine.model.quant_matrix import QuantMatrix
from tests.fixtures.models import greedy_paged
from tests.fixtures.tiny_gguf import write_tiny_llama
from tests.model.test_form_choice import DECODE_BOUNDS, assert_decodes_alike

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("cpu_kernels")
PROMPTS = [[5, 9, 14], [3, 200, 7, 31, 8, 2, 11, 40, 9, 17]]  # decode and a 10-row prefill


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "repacked"
    monkeypatch.setenv(repack_cache.ENV, str(path))
    # NOTE: the forms by assumption (an int8 form, the head's float32 one), whose files these
    # tests damage; the forms chosen by measurement differ by CPU
    monkeypatch.setenv("LLMQ_FORMS", "fixed")
    return path


def tiny(tmp_path, name: str = "tiny.gguf", seed: int = 3, **kwargs):
    path = tmp_path / name
    write_tiny_llama(path, seed=seed, **kwargs)
    return path


def run(path) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_paged(load_model(path, "float32", weights="native").model, PROMPTS, 5)


def entries(cache_dir) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir())


def no_block_decoding(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a warm load decoded GGUF blocks")
    monkeypatch.setattr(block_quant.BlockQuant, "from_gguf", classmethod(refuse))


def test_a_warm_load_maps_the_cold_loads_forms_and_gives_the_same_logits(
        tmp_path, cache_dir, monkeypatch):
    # Given a model loaded once (cold: the entry is written)
    path = tiny(tmp_path)
    cold_tokens, cold_logits = run(path)
    assert len(entries(cache_dir)) == 1

    # When it is loaded again, with block decoding made impossible
    no_block_decoding(monkeypatch)
    model = load_model(path, "float32", weights="native").model
    warm_tokens, warm_logits = greedy_paged(model, PROMPTS, 5)

    # Then its forms come from the entry and every logit is identical
    assert all(isinstance(m.quant, QuantMatrix) for m in model.modules()
               if isinstance(m, Linear))
    assert warm_tokens == cold_tokens
    for a, b in zip(warm_logits, cold_logits, strict=True):
        assert torch.equal(a, b)
    assert len(entries(cache_dir)) == 1


def test_another_file_or_another_cpu_gets_its_own_entry(tmp_path, cache_dir, monkeypatch):
    # Given one file's entry
    first = tiny(tmp_path, "a.gguf", seed=3)
    run(first)

    # When another file (other weights) loads, it builds its own entry and its own numbers
    second = tiny(tmp_path, "b.gguf", seed=4)
    tokens, logits = run(second)
    assert len(entries(cache_dir)) == 2
    monkeypatch.setenv(repack_cache.ENV, "off")
    uncached_tokens, uncached_logits = run(second)
    assert tokens == uncached_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, uncached_logits, strict=True))
    monkeypatch.setenv(repack_cache.ENV, str(cache_dir))

    # And the same file rewritten in place (new mtime) is rebuilt, its old entry dropped
    before = entries(cache_dir)
    tiny(tmp_path, "a.gguf", seed=5)
    run(first)
    after = entries(cache_dir)
    assert len(after) == 2 and after != before
    # And on another CPU (a cache on shared storage) it gets its own entry beside this one's
    monkeypatch.setattr(repack_cache, "_cpu_model", lambda: "model name : another CPU")
    run(first)
    assert len(entries(cache_dir)) == 3 and set(after) < set(entries(cache_dir))


def test_a_truncated_entry_is_rebuilt(tmp_path, cache_dir):
    # Given an entry one of whose arrays was cut short (a full disk, a killed copy)
    path = tiny(tmp_path)
    cold_tokens, cold_logits = run(path)
    (entry,) = cache_dir.iterdir()
    victim = next(entry.glob("*.int8.q.npy"))
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)

    # When the model loads again, then it loads right and the entry is whole again
    tokens, logits = run(path)
    assert tokens == cold_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, cold_logits, strict=True))
    assert victim.stat().st_size == size


def test_a_half_written_entry_is_not_used(tmp_path, cache_dir):
    # Given a staging folder left by a worker killed mid-write (no rename happened)
    path = tiny(tmp_path)
    key = repack_cache.cache_key(path, FastGGUFReader(path).fingerprint())
    (cache_dir / f"{key}.tmp-1").mkdir(parents=True)
    # Then the load ignores it and writes the real entry
    run(path)
    assert (cache_dir / key / repack_cache.MANIFEST).is_file()


def test_fused_rows_of_mixed_types_run_quantized_with_the_dequantized_numbers(
        tmp_path, cache_dir):
    # Given Q4_K_M's mix: Q4_K projections but V in Q6_K (a 16-column group, 8 bits)
    path = tiny(tmp_path, hidden=256, intermediate=512, weight_type=Q.Q4_K,
                override_types={f"model.layers.{i}.self_attn.v_proj.weight": Q.Q6_K
                                for i in range(2)})
    native = load_model(path, "float32", weights="native").model
    dense = load_model(path, "float32", weights="fp32").model

    # Then the fused QKV has one quantized form (no dense float32 copy), and with every step
    # on it (up to 8 rows) the two models agree to the kernels' float32 rounding
    qkv = native.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, QuantMatrix) and qkv.quant.group == 16
    assert qkv.weight.numel() == 0
    prompts = [[5, 9, 14], [3, 200, 7, 31]]
    ours, our_logits = greedy_paged(native, prompts, 5)
    theirs, their_logits = greedy_paged(dense, prompts, 5)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_a_fused_qkv_of_two_types_runs_each_in_its_own_tiles_cold_and_warm(
        tmp_path, cache_dir, monkeypatch):
    # Given Q4_K_M's mix (V in Q6_K) on the qdot tiles, loaded cold, then warm from the cache
    monkeypatch.setenv("LLMQ_FORMS", "qdot")
    path = tiny(tmp_path, hidden=256, intermediate=512, weight_type=Q.Q4_K,
                override_types={f"model.layers.{i}.self_attn.v_proj.weight": Q.Q6_K
                                for i in range(2)})
    cold = load_model(path, "float32", weights="native").model
    no_block_decoding(monkeypatch)
    warm = load_model(path, "float32", weights="native").model
    dense = load_model(path, "float32", weights="fp32").model

    # Then both hold the fused QKV's Q and K rows in 4 bits with Q4_K's offsets and its V rows
    # in 6 bits without (merged, all took V's 6 bits and groups of 16 with offsets)
    for model in (cold, warm):
        tiles = model.layers[0].self_attn.qkv_proj.dot_tiles
        assert tiles is not None and tiles.kind == "q4g32+q6g16s"
    # And the warm start decodes as the cold one, bit for bit (prefill and the one-call decode
    # step), and the float32 model's tokens within the qdot form's bound
    cold_tokens, cold_logits = greedy_paged(cold, PROMPTS, 5)
    warm_tokens, warm_logits = greedy_paged(warm, PROMPTS, 5)
    assert warm_tokens == cold_tokens
    assert all(torch.equal(a, b) for a, b in zip(warm_logits, cold_logits, strict=True))
    assert_decodes_alike(cold, dense, DECODE_BOUNDS["qdot"])


def test_the_fast_reader_reads_what_gguf_py_reads(tmp_path):
    path = tiny(tmp_path)
    ours, theirs = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    arrays = 0
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
        assert ours.fields[name].types == field.types, name
        if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 3:
            arrays += 1
            for index in (0, 3, -1, slice(1, 3)):
                assert ours.fields[name].contents(index) == field.contents(index), name
    assert arrays >= 2  # the token strings and their types at least
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data)
               for a, b in zip(ours.tensors, theirs.tensors, strict=True))
