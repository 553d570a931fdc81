"""LoRA adapters against transformers + PEFT, in float32, on a tiny random Llama.

Adapters are made by PEFT itself (tests/fixtures/tiny_lora.py: random nonzero A and B, saved
with `save_pretrained`) and served from an adapter directory. The paged path's logits must
equal transformers + PEFT's at every prompt position and every greedy step, for one adapter
and for a batch mixing the base model and two adapters; through the engine, each request of a
mixed batch gets exactly the tokens it gets alone, and a prefix cached under one adapter is
never served to another or to the base model.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.models import one_torch_thread
from tests.fixtures.tiny_hf import VOCAB, write_tiny_hf
from tests.fixtures.tiny_lora import paged_with_adapters, peft_model, write_peft_adapter

pytestmark = pytest.mark.model

NEW_TOKENS = 12
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # logits are O(1-10): float32 rounding is ~1e-6


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base HF folder, adapter directory): `full` targets every projection (rank 8),
    `qv` only q_proj and v_proj with rsLoRA (rank 4), `wide` is rank 16."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_hf("llama3", root / "base")
    loras = root / "loras"
    write_peft_adapter(base, loras / "full", r=8, alpha=16, seed=1)
    write_peft_adapter(base, loras / "qv", r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                       use_rslora=True, seed=2, scale=0.3)
    write_peft_adapter(base, loras / "wide", r=16, alpha=8, seed=3)
    return base, loras


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (21, 6, 13)]


@functools.cache
def reference(base: Path, adapter: Path | None, prompt: tuple[int, ...]
              ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers + PEFT: logits at every prompt position, the greedy continuation, and the
    logits of each generated step."""
    model = peft_model(base, adapter)
    x = torch.tensor([list(prompt)])
    with torch.no_grad():
        prefill = model(input_ids=x).logits[0]  # [len(prompt), vocab]
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                             max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return prefill, out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def test_one_adapter_and_a_mixed_batch_equal_transformers_peft(lora_setup, prompts) -> None:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    base, loras = lora_setup
    loaded = load_model(base, "float32")
    manager = LoraManager(loras, loaded.arch)
    full, qv = manager.get("full"), manager.get("qv")
    # When every prompt runs under one adapter, and then when the base model and the two
    # adapters share one batch (decodes of all three in every step)
    for names in (["full", "full", "full"], ["full", None, "qv"]):
        adapters = [{"full": full, "qv": qv, None: None}[n] for n in names]
        prefill, tokens, steps = paged_with_adapters(loaded.model, prompts, adapters,
                                                      NEW_TOKENS)
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            ref_prefill, ref_tokens, ref_steps = reference(
                base, None if name is None else loras / name, tuple(prompt))
            # Then every logit equals transformers + PEFT's, and so do the greedy tokens
            torch.testing.assert_close(prefill[i], ref_prefill, **TOLERANCE)
            assert tokens[i] == ref_tokens, f"prompt {i} under {name}: greedy tokens differ"
            torch.testing.assert_close(steps[i], ref_steps, **TOLERANCE)
    # And the adapters matter: each changes the greedy tokens of the base model
    base_tokens = reference(base, None, tuple(prompts[0]))[1]
    assert reference(base, loras / "full", tuple(prompts[0]))[1] != base_tokens
    assert reference(base, loras / "qv", tuple(prompts[0]))[1] != base_tokens


def _engine(base: Path, loras: Path, **config):
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore
    from llmq.worker.engine.model.loader import load_model

    cfg = EngineConfig(model=str(base), dtype="float32", lora_dir=str(loras), num_kv_blocks=64,
                       **config)
    return EngineCore(cfg, load_model(base, "float32"))


def _run(engine, requests: list[tuple[list[int], str | None]]) -> list:
    """Each (prompt, adapter) through the gate and the engine, all in one batch; the finished
    outputs in order."""
    from llmq.protocol import Request
    from llmq.worker.engine.input_processor import InputProcessor

    gate = InputProcessor.for_engine(engine)
    prompts, params = [], []
    for prompt, lora in requests:
        processed = gate.process(Request(prompt_token_ids=prompt, lora=lora, temperature=0.0,
                                         max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
        prompts.append(processed.prompt_token_ids)
        params.append(processed.sampling_params)
    return engine.generate(prompts, params)


def test_each_request_of_a_mixed_engine_batch_gets_what_it_gets_alone(lora_setup, prompts
                                                                       ) -> None:
    one_torch_thread()
    base, loras = lora_setup
    engine = _engine(base, loras, enable_prefix_caching=False)
    mix = [(prompts[0], None), (prompts[1], "full"), (prompts[2], "qv"), (prompts[1], None),
           (prompts[0], "wide"), (prompts[2], "full")]
    # When six requests (the base model and three adapters, interleaved) run as one batch
    together = _run(engine, mix)
    # Then each gets exactly the tokens it gets alone, and the logprobs it gets alone
    for (prompt, lora), out in zip(mix, together, strict=True):
        alone = _run(engine, [(prompt, lora)])[0]
        assert out.new_token_ids == alone.new_token_ids, f"{lora}: tokens differ in the batch"
        for a, b in zip(out.new_logprobs, alone.new_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # And the requests under an adapter got what transformers + PEFT gives
    for (prompt, lora), out in zip(mix, together, strict=True):
        adapter = None if lora is None else loras / lora
        assert out.new_token_ids == reference(base, adapter, tuple(prompt))[1]


def test_a_prefix_cached_under_one_adapter_serves_no_other(lora_setup, prompts) -> None:
    one_torch_thread()
    base, loras = lora_setup
    engine = _engine(base, loras)
    prompt = prompts[0] + prompts[2]  # 34 tokens: two full blocks to cache
    # Given the prompt's blocks cached under adapter `full`
    first = _run(engine, [(prompt, "full")])[0]
    assert first.usage.cached_prompt_tokens == 0
    # When the same prompt runs under `full` again, then under the base model and under `qv`
    again = _run(engine, [(prompt, "full")])[0]
    on_base = _run(engine, [(prompt, None)])[0]
    on_qv = _run(engine, [(prompt, "qv")])[0]
    # Then only `full` itself hits its cached prefix; the others compute theirs
    assert again.usage.cached_prompt_tokens == 32
    assert again.new_token_ids == first.new_token_ids
    assert on_base.usage.cached_prompt_tokens == 0
    assert on_qv.usage.cached_prompt_tokens == 0
    assert on_base.new_token_ids == reference(base, None, tuple(prompt))[1]
    assert on_qv.new_token_ids == reference(base, loras / "qv", tuple(prompt))[1]
