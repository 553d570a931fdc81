"""Dense forms mapped packed (packed_weight.py): a warm start runs a bfloat16, float16 or
float32 form on the repack cache's map of its oneDNN-packed bytes, packing nothing and copying
nothing, with the cold start's logits; a map packed for another CPU or oneDNN is repacked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmq.worker.engine.model import block_quant, form_choice, packed_weight, repack_cache
from llmq.worker.engine.model.linear import Linear
from llmq.worker.engine.model.loader import load_model
from tests.fixtures.models import greedy_paged
from tests.fixtures.tiny_gguf import write_tiny_llama

pytestmark = [pytest.mark.usefixtures("cpu_kernels"),
              pytest.mark.skipif(not packed_weight.available(),
                                 reason="this torch cannot wrap packed bytes")]
PROMPTS = [[5, 9, 14], [3, 200, 7, 31, 8, 2, 11, 40, 9, 17, 4, 6]]  # decode and a prefill


@pytest.fixture
def tiny_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(repack_cache.ENV, str(tmp_path / "repacked"))
    monkeypatch.setenv(form_choice.DIR_ENV, str(tmp_path / "forms"))
    path = tmp_path / "tiny-qwen2.gguf"  # biased QKV: the mapped forms add the bias too
    write_tiny_llama(path, architecture="qwen2", hidden=64, intermediate=128, seed=5)
    return path


def load(path: Path):
    return load_model(path, "float32", weights="native").model


def dense_forms(model) -> list[tuple[torch.Tensor, list[np.ndarray]]]:
    return [(t, m._backing) for m in model.modules() if isinstance(m, Linear)
            for parts in m._dense.values() for t in parts]


def assert_mapped(model, form: str) -> None:
    """Every dense form is a packed tensor whose memory is one of the cache's file maps (but
    a float32 LM head: it runs on its plain weight, mapped too, linear.py `_build_chosen`)."""
    forms = [(t, backing) for t, backing in dense_forms(model)
             if not (form == "fp32" and any(t is p for p in model.lm_head._dense[form]))]
    assert forms and all(t.is_mkldnn and t.dtype == form_choice.DENSE_DTYPES[form]
                         for t, _ in forms)
    for tensor, backing in forms:
        assert any(isinstance(a, np.memmap)
                   and a.ctypes.data == torch.ops.mkldnn.data_ptr(tensor) for a in backing)


@pytest.mark.parametrize("form", ["bf16", "fp16", "fp32"])
def test_a_warm_start_maps_the_packed_forms_and_packs_nothing(tiny_path, monkeypatch, form):
    # Given every projection on one dense form, loaded once (cold: packed, stored, mapped)
    monkeypatch.setenv(form_choice.ENV, form)
    if not form_choice.dense_form_runs(form):
        form = "fp32"  # forced where oneDNN cannot run it (float16 on an AMD Zen 5): float32
    cold = load(tiny_path)
    assert_mapped(cold, form)
    cold_tokens, cold_logits = greedy_paged(cold, PROMPTS, 5)

    # When it loads again with packing and block decoding made impossible
    def refuse(*args, **kwargs):
        raise AssertionError("a warm start packed or decoded a weight")
    monkeypatch.setattr(packed_weight, "pack", refuse)
    monkeypatch.setattr(block_quant.BlockQuant, "from_gguf", classmethod(refuse))
    warm = load(tiny_path)

    # Then its forms are the cache's maps, and every logit is the cold start's
    assert_mapped(warm, form)
    tokens, logits = greedy_paged(warm, PROMPTS, 5)
    assert tokens == cold_tokens
    for a, b in zip(logits, cold_logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not packed_weight.runs(torch.bfloat16),
                    reason="oneDNN packs no bfloat16 on this CPU (AVX2 only): no packed form")
def test_a_map_packed_for_another_cpu_or_onednn_is_repacked(tiny_path, monkeypatch):
    # Given a cache written where oneDNN packs differently (another layout tag)
    monkeypatch.setenv(form_choice.ENV, "bf16")
    monkeypatch.setattr(packed_weight, "LAYOUT_TAG", "another-cpu-0000")
    cold_tokens, cold_logits = greedy_paged(load(tiny_path), PROMPTS, 5)
    monkeypatch.undo()
    monkeypatch.setenv(repack_cache.ENV, str(tiny_path.parent / "repacked"))
    monkeypatch.setenv(form_choice.DIR_ENV, str(tiny_path.parent / "forms"))
    monkeypatch.setenv(form_choice.ENV, "bf16")

    # When this CPU loads it
    packs = []
    pack = packed_weight.pack
    monkeypatch.setattr(packed_weight, "pack", lambda w: packs.append(w.shape) or pack(w))
    warm = load(tiny_path)

    # Then every dense form is packed again here (not wrapped from the foreign bytes), and
    # the numbers are the same
    assert len(packs) == len(dense_forms(warm)) > 0
    tokens, logits = greedy_paged(warm, PROMPTS, 5)
    assert tokens == cold_tokens
    for a, b in zip(logits, cold_logits, strict=True):
        assert torch.equal(a, b)
