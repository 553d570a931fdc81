"""LoRA on the quantized native path, and llama.cpp's GGUF LoRA, on a tiny random Llama.

The tiny model is converted to GGUF by llama.cpp's own converter (tests/fixtures/tiny_hf.py)
and its PEFT adapter by llama.cpp's `convert_lora_to_gguf.py`. On `--weights native` the base
projections run on the quantized and int8 kernels and each adapter row adds its low-rank product
to them: the result must be the dequantized model's with the same adapter (within the native
path's own bound, test_families_oracle.py). A GGUF LoRA must give the logits of the PEFT adapter
it was converted from.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.models import one_torch_thread
from tests.fixtures.tiny_hf import VOCAB, convert_to_gguf, llama_cpp_dir, write_tiny_hf
from tests.fixtures.tiny_lora import convert_lora_to_gguf, paged_with_adapters, write_peft_adapter

pytestmark = pytest.mark.model

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama as an HF folder (`hf`) and a Q8_0 GGUF (`q8`); `loras`: its adapter
    directory, with the PEFT adapter `full` and its GGUF conversion `full-gguf`."""
    if llama_cpp_dir() is None:
        from tests.fixtures.redis_servers import in_ci

        message = "no llama.cpp converters: make llama-cpp-converter"
        if in_ci():
            pytest.fail(message + " (required under CI=true)")
        pytest.skip(message)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = tmp_path_factory.mktemp("lora-native")
    hf = write_tiny_hf("llama3", root / "hf")
    q8 = root / "tiny.q8_0.gguf"
    convert_to_gguf([(hf, q8)], outtype="q8_0")
    loras = root / "loras"
    write_peft_adapter(hf, loras / "full", r=8, alpha=16, seed=1)
    write_peft_adapter(hf, loras / "qv", r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                       seed=2, scale=0.3)
    convert_lora_to_gguf(hf, loras / "full", loras / "full-gguf.gguf")
    return {"hf": hf, "q8": q8, "loras": loras}


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("lengths, new_tokens, max_rel_diff", [
    ((2, 3, 1, 2), 6, 1e-3),  # the quantized kernels' bound (test_families_oracle.py)
    # NOTE: a prefill of more than 8 rows runs on the int8 form, whose weights are rounded per
    # output channel: logits move by up to ~5% of the largest with or without an adapter
    # (test_native_weights.py; measured 1.2% here on the base model alone)
    ((17, 9, 12, 5), 4, 0.06),
    # NOTE: 564 prefill rows: the MLP of so long a step runs in slices of rows (llama.py
    # MLP_SLICE_ROWS), and each adapter's rows must still get their own products
    ((300, 9, 250, 5), 2, 0.06)])
def test_adapters_on_native_weights_equal_the_dequantized_model(
        checkpoints, lengths, new_tokens: int, max_rel_diff: float) -> None:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    native = load_model(checkpoints["q8"], "float32", weights="native")
    dense = load_model(checkpoints["q8"], "float32", weights="fp32")
    manager = LoraManager(checkpoints["loras"], native.arch)
    full, qv = manager.get("full"), manager.get("qv")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    # When the base model and two adapters share each step: short prompts keep every step on
    # the quantized kernels (at most 8 rows), long ones put the prefill on the int8 form
    adapters = [full, None, qv, full]
    ours = paged_with_adapters(native.model, prompts, adapters, new_tokens)
    theirs = paged_with_adapters(dense.model, prompts, adapters, new_tokens)
    # Then the tokens are the dequantized model's, and the logits within the native bound
    assert ours[1] == theirs[1]
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert (a - b).abs().max() <= max_rel_diff * b.abs().max()
    # And the adapters change the tokens: the products were added on the native path
    base_only = paged_with_adapters(native.model, prompts, [None] * 4, new_tokens)
    assert base_only[1][0] != ours[1][0] and base_only[1][1] == ours[1][1]


def test_a_gguf_lora_equals_the_peft_adapter_it_was_converted_from(checkpoints) -> None:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    loaded = load_model(checkpoints["hf"], "float32")
    manager = LoraManager(checkpoints["loras"], loaded.arch)
    assert manager.available() == ["full", "full-gguf", "qv"]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (15, 4)]
    peft_form = paged_with_adapters(loaded.model, prompts, [manager.get("full")] * 2, 6)
    gguf_form = paged_with_adapters(loaded.model, prompts, [manager.get("full-gguf")] * 2, 6)
    assert gguf_form[1] == peft_form[1]
    for a, b in zip(gguf_form[0] + gguf_form[2], peft_form[0] + peft_form[2], strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE)
