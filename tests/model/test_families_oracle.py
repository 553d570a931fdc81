"""Every supported family against transformers, in float32, from the HF folder and the GGUF.

Tiny random models (tests/fixtures/tiny_hf.py: built offline with transformers, converted by
llama.cpp's own convert_hf_to_gguf.py) run through llmq's paged path (three prompts batched,
decodes after one prefill step) and its contiguous oracle path. Logits must equal transformers'
to float32 rounding at every prompt position and every generated step, and greedy 32-token
continuations must be identical. The prompts run past Mistral's 24-token window.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.models import greedy_contiguous, greedy_paged, one_torch_thread
from tests.fixtures.tiny_hf import (
    FAMILIES,
    HF_ONLY,
    VOCAB,
    convert_to_gguf,
    llama_cpp_dir,
    write_tiny_hf,
)

pytestmark = pytest.mark.model

NEW_TOKENS = 32
# Families whose decode steps the one-call native kernel runs (llama.py `_one_call`)
ONE_CALL = {"llama3", "llama3-untied", "qwen2"}
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # logits are O(1-10): float32 rounding is ~1e-6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF folder, GGUF file), all converted in one converter run."""
    if llama_cpp_dir() is None:
        from tests.fixtures.redis_servers import in_ci

        message = "no llama.cpp convert_hf_to_gguf.py: make llama-cpp-converter"
        if in_ci():
            pytest.fail(message + " (required under CI=true)")
        pytest.skip(message)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = tmp_path_factory.mktemp("families")
    pairs = {family: (write_tiny_hf(family, root / family), root / f"{family}.gguf")
             for family in FAMILIES}
    convert_to_gguf([pair for family, pair in pairs.items() if family not in HF_ONLY])
    return pairs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 7, 19)]


@functools.cache
def hf_model(folder: Path):  # -> transformers' model, loaded once per family
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@functools.cache
def hf_reference(folder: Path, prompt: tuple[int, ...]
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers' logits at every prompt position, greedy continuation, and its logits
    (computed once per family and prompt, for both sources)."""
    model = hf_model(folder)
    x = torch.tensor([list(prompt)])
    with torch.no_grad():
        prefill = model(x).logits[0]  # [len(prompt), vocab]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    return prefill, out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


# NOTE: a family llama.cpp's converter does not write (HF_ONLY: docs/models.md says so) has no
# GGUF to compare; it is compared from its HF folder only.
@pytest.mark.parametrize("family, source", [
    (family, source) for family in sorted(FAMILIES) for source in ("hf", "gguf")
    if not (source == "gguf" and family in HF_ONLY)])
def test_family_equals_transformers_in_float32(checkpoints, prompts, family: str, source: str
                                               ) -> None:
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    folder, gguf_file = checkpoints[family]
    loaded = load_model(folder if source == "hf" else gguf_file, "float32")
    model = loaded.model
    paged, paged_logits = greedy_paged(model, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        ref_prefill, ref_tokens, ref_logits = hf_reference(folder, tuple(prompt))
        steps = _steps_before_longrope_switch(model, len(prompt))
        ref_tokens, ref_logits = ref_tokens[:steps], ref_logits[:steps]
        cache = model.make_contiguous_cache(len(prompt))
        ours_prefill = model.compute_logits(model.forward_contiguous(torch.tensor(prompt), 0,
                                                                     cache))
        torch.testing.assert_close(ours_prefill, ref_prefill, **TOLERANCE)
        assert paged[i][:steps] == ref_tokens, f"prompt {i}: paged greedy differs"
        torch.testing.assert_close(torch.stack([step[i] for step in paged_logits[:steps]]),
                                   ref_logits, **TOLERANCE)
        contiguous, _ = greedy_contiguous(model, prompt, NEW_TOKENS)
        assert contiguous[:steps] == ref_tokens, f"prompt {i}: contiguous greedy differs"


def _steps_before_longrope_switch(model, prompt_len: int) -> int:
    """Generated tokens comparable with transformers: all, but for a longrope sequence that
    grows past original_max_position_embeddings. There transformers drops its cache and
    recomputes every key with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation);
    llmq keeps the keys already cached (rotated with the short ones) and rotates the new
    tokens with the long factors (docs/models.md)."""
    long_after = model.rotary.long_after if model.rotary.inv_freq_long is not None else None
    if long_after is None or prompt_len > long_after:
        return NEW_TOKENS
    return min(NEW_TOKENS, long_after - prompt_len + 1)


@pytest.fixture(scope="module")
def q8_checkpoints(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> its GGUF quantized to Q8_0 by llama.cpp's converter."""
    root = tmp_path_factory.mktemp("families-q8")
    files = {family: root / f"{family}.q8_0.gguf" for family in FAMILIES
             if family not in HF_ONLY}
    convert_to_gguf([(checkpoints[family][0], file) for family, file in files.items()],
                    outtype="q8_0")
    return files


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - HF_ONLY))
def test_quantized_gguf_on_native_weights_equals_its_dequantized_model(q8_checkpoints,
                                                                       family: str) -> None:
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    native = load_model(q8_checkpoints[family], "float32", weights="native").model
    dense = load_model(q8_checkpoints[family], "float32", weights="fp32").model
    # Then only plain Llama blocks decode in one kernel call; every other family says no
    # rather than computing something else (llama3 RoPE scaling only changes the tables)
    assert native._one_call == (family in ONE_CALL)
    if native.arch.num_experts:
        _experts_hold_only_their_blocks(native, dense)
    # When four short prompts prefill together (8 rows) and decode (4 rows), every step on
    # the quantized kernels (larger steps run the int8 form: close, not equal)
    g = torch.Generator().manual_seed(2)
    short = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (2, 3, 1, 2)]
    ours, our_logits = greedy_paged(native, short, 8)
    theirs, their_logits = greedy_paged(dense, short, 8)
    # Then they give the dequantized model's tokens and logits, within the bound
    # test_native_weights.py states
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def _experts_hold_only_their_blocks(native, dense) -> None:
    """An MoE model's experts keep their quantized blocks only (no int8 or dense copy of
    every expert), and run on them for any number of rows: the dequantized weights' result."""
    from llmq.worker.engine.model.linear import QUANT_MAX_ROWS, Linear
    from llmq.worker.engine.model.moe import SparseMoe

    moe = next(m for m in native.modules() if isinstance(m, SparseMoe))
    experts = [m for m in moe.experts.modules() if isinstance(m, Linear)]
    assert all(e.quant_only and e.int8 is None and e.weight.numel() == 0 for e in experts)
    dense_moe = next(m for m in dense.modules() if isinstance(m, SparseMoe))
    x = torch.randn(3 * QUANT_MAX_ROWS + 1, native.arch.hidden_size)
    expected = dense_moe.experts[0].gate_up_proj(x)
    torch.testing.assert_close(moe.experts[0].gate_up_proj(x), expected, rtol=1e-4, atol=1e-4)
