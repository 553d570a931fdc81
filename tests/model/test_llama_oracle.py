"""SmolLM2-135M-Instruct against transformers reading the same GGUF, in float32.

The oracle proves the loader (dequantization, llama.cpp's Q/K row permutation undone, tied
head) and the model (RMSNorm, half-split RoPE, GQA, SwiGLU) right. A wrong RoPE pairing still
gets the top token right most of the time, so logits are compared at every position, and greedy
continuations token for token, through both the paged path and the contiguous one.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmq.worker.engine.model.attention import AttentionMetadata
from tests.fixtures.models import greedy_contiguous, greedy_paged, interleaved_block_tables

pytestmark = pytest.mark.model

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(default_model_f32) -> list[list[int]]:
    """Token ids of the raw prompts, then of the chat-templated ones, by llmq's tokenizer."""
    tok = default_model_f32.tokenizer
    return ([tok.encode(p) for p in RAW_PROMPTS]
            + [tok.encode_chat(messages, add_generation_prompt=True) for messages in CHATS])


def hf_greedy(hf_model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (it stops after its EOS, which it keeps) and the raw
    logits of each step [num_new_tokens, vocab]."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=2, output_logits=True,
                                return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)


def cut_after_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("which", range(len(RAW_PROMPTS) + len(CHATS)))
def test_logits_match_transformers_at_every_position(default_model_f32, hf_model, prompts, which):
    # Given a prompt (raw or chat-templated) and the same GGUF read by transformers
    model = default_model_f32.model
    ids = prompts[which]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]  # [len(ids), vocab]

    # When our model prefills it through the contiguous cache and through the paged one
    # (blocks of 16 scattered over the cache)
    contiguous = model.compute_logits(
        model.forward_contiguous(torch.tensor(ids), 0, model.make_contiguous_cache(len(ids))))
    tables, num_blocks = interleaved_block_tables([len(ids)] * 3, 16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], tables[2:], 16)
    paged = model.compute_logits(
        model(torch.tensor(ids), meta, model.make_kv_caches(num_blocks, 16)))

    # Then the logits agree within 1e-3 at every position
    assert (contiguous - expected).abs().max() < 1e-3
    assert (paged - expected).abs().max() < 1e-3


@pytest.mark.parametrize("which", range(len(RAW_PROMPTS) + len(CHATS)))
def test_greedy_continuation_matches_transformers(default_model_f32, hf_model, prompts, which):
    # Given a prompt and transformers' greedy 32-token continuation of it
    model = default_model_f32.model
    ids = prompts[which]
    expected, expected_logits = hf_greedy(hf_model, ids)
    eos_ids = set(hf_model.generation_config.eos_token_id
                  if isinstance(hf_model.generation_config.eos_token_id, list)
                  else [hf_model.generation_config.eos_token_id])

    # When our model continues it greedily: prefill + 31 decode steps over block tables,
    # and one token at a time over a contiguous cache
    paged, paged_logits = greedy_paged(model, [ids], NEW_TOKENS)
    contiguous, _ = greedy_contiguous(model, ids, NEW_TOKENS)

    # Then all three continuations are identical (up to and including transformers' EOS),
    # and so are the logits of every decode step
    assert cut_after_eos(paged[0], eos_ids) == expected
    assert cut_after_eos(contiguous, eos_ids) == expected
    ours = torch.cat(paged_logits)[:len(expected)]  # [num_new_tokens, vocab]
    assert (ours - expected_logits).abs().max() < 1e-3


def test_chat_continuations_end_their_turn(default_model_f32, prompts):
    # Given the chat-templated prompts: a model loaded right answers and closes its turn
    model, tok = default_model_f32.model, default_model_f32.tokenizer
    outputs, _ = greedy_paged(model, prompts[len(RAW_PROMPTS):], NEW_TOKENS)

    # Then the answer to the capital question names Paris, and at least one answer ends
    # with <|im_end|> within 32 tokens
    assert "Paris" in tok.decode(outputs[0])
    assert any(2 in out for out in outputs)
