"""Paged attention against the contiguous-cache oracle.

Whatever the batch around a sequence (decodes, fresh prompts, prompt chunks continuing cached
context) and wherever its blocks sit in the cache, it must get the same logits as when it runs
alone over a contiguous cache. Mostly on the tiny random Llama (milliseconds per step), once on
the real model.
"""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.model.attention import AttentionMetadata
from tests.fixtures.models import (
    greedy_contiguous,
    greedy_paged,
    interleaved_block_tables,
)

# Prompts of 16 different lengths: shorter than, equal to and longer than a block.
PROMPT_LENGTHS = [1, 2, 3, 5, 7, 8, 15, 16, 17, 23, 31, 32, 33, 40, 47, 64]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def contiguous_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] from one contiguous prefill."""
    hidden = model.forward_contiguous(torch.tensor(ids), 0, model.make_contiguous_cache(len(ids)))
    return model.compute_logits(hidden)


def test_metadata_slot_mapping_follows_block_tables():
    # Given two decodes and two prefills with scattered blocks of 4 tokens
    meta = AttentionMetadata.build(
        query_lens=[1, 1, 3, 2], seq_lens=[5, 12, 8, 2],
        block_tables=[[7, 9], [3, 4, 8], [11, 5], [2, 6, 10]], block_size=4)

    # Then positions continue each sequence's cached context
    assert meta.positions.tolist() == [4, 11, 5, 6, 7, 0, 1]
    # and each slot is block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 8 * 4 + 3, 5 * 4 + 1, 5 * 4 + 2,
                                          5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    # and only the blocks a sequence needs are gathered (decode 1 needs 3, decode 0 needs 2)
    assert meta.decode_num_blocks == 3
    assert meta.decode_block_ids.tolist() == [7, 9, 0, 3, 4, 8]


def test_metadata_rejects_a_block_table_too_short_for_its_sequence():
    with pytest.raises(ValueError, match="needs 3"):
        AttentionMetadata.build([1], [9], [[1, 2]], block_size=4)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_prefilled_prompt_gets_the_same_logits_paged_as_contiguous(tiny_model, block_size):
    # Given a 40-token prompt and a cache whose blocks are scattered
    model = tiny_model.model
    prompt = random_prompt(40, model.arch.vocab_size, seed=1)
    tables, num_blocks = interleaved_block_tables([40, 40, 40], block_size)
    kv_caches = model.make_kv_caches(num_blocks, block_size)

    # When it is prefilled in one paged step
    meta = AttentionMetadata.build([40], [40], tables[1:2], block_size)
    paged = model.compute_logits(model(torch.tensor(prompt), meta, kv_caches))

    # Then every position's logits equal the contiguous oracle's
    torch.testing.assert_close(paged, contiguous_logits(model, prompt), rtol=1e-5, atol=1e-4)


def test_a_mixed_step_of_decodes_and_prompt_chunks_matches_the_oracle(tiny_model):
    # Given five sequences with cached context of various lengths, ordered decodes first:
    # two decodes, a prompt chunk continuing 16 cached tokens, one continuing 13, a fresh prompt
    model = tiny_model.model
    block_size = 4
    cached = [9, 30, 16, 13, 0]
    new = [1, 1, 8, 5, 12]
    full = [random_prompt(c + n, model.arch.vocab_size, seed=10 + i)
            for i, (c, n) in enumerate(zip(cached, new, strict=True))]
    tables, num_blocks = interleaved_block_tables([len(f) for f in full], block_size)
    kv_caches = model.make_kv_caches(num_blocks, block_size)
    # their cached context written by an earlier step (all prefills)
    earlier = [i for i, c in enumerate(cached) if c]
    meta = AttentionMetadata.build([cached[i] for i in earlier], [cached[i] for i in earlier],
                                   [tables[i] for i in earlier], block_size)
    model(torch.tensor([t for i in earlier for t in full[i][:cached[i]]]), meta, kv_caches)

    # When one step runs all their new tokens together
    meta = AttentionMetadata.build(new, [len(f) for f in full], tables, block_size)
    input_ids = [t for f, n in zip(full, new, strict=True) for t in f[-n:]]
    logits = model.compute_logits(model(torch.tensor(input_ids), meta, kv_caches))

    # Then each new token's logits equal the oracle's for the whole sequence at its position
    assert meta.num_decodes == 2
    for i, f in enumerate(full):
        rows = slice(int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1]))
        expected = contiguous_logits(model, f)[-new[i]:]
        torch.testing.assert_close(logits[rows], expected, rtol=1e-5, atol=1e-4)


def test_a_prompt_prefilled_in_chunks_gets_the_same_logits_as_in_one_piece(tiny_model):
    # Given a 50-token prompt
    model = tiny_model.model
    block_size = 8
    prompt = random_prompt(50, model.arch.vocab_size, seed=3)
    tables, num_blocks = interleaved_block_tables([50], block_size)

    def prefill(chunks: list[int]) -> torch.Tensor:
        kv_caches = model.make_kv_caches(num_blocks, block_size)
        out, done = [], 0
        for n in chunks:
            meta = AttentionMetadata.build([n], [done + n], tables, block_size)
            out.append(model.compute_logits(
                model(torch.tensor(prompt[done:done + n]), meta, kv_caches)))
            done += n
        return torch.cat(out)  # [50, vocab]

    # When it is prefilled in one piece, and in uneven chunks that straddle block edges
    whole = prefill([50])
    chunked = prefill([7, 1, 13, 16, 13])

    # Then every position's logits agree
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-4)


def test_stale_values_in_reused_blocks_do_not_leak_into_attention(tiny_model):
    # Given a cache full of another sequence's leftovers (finite noise, as freed blocks hold)
    model = tiny_model.model
    prompt = random_prompt(21, model.arch.vocab_size, seed=4)
    tables, num_blocks = interleaved_block_tables([24, 24], 8)
    clean = model.make_kv_caches(num_blocks, 8)
    dirty = [torch.randn_like(c) * 50 for c in clean]

    # When the same prompt is greedily decoded over each
    out_clean, logits_clean = greedy_paged(model, [prompt], 3, 8, kv_caches=clean)
    out_dirty, logits_dirty = greedy_paged(model, [prompt], 3, 8, kv_caches=dirty)

    # Then nothing outside the sequence's own positions was attended to
    assert out_dirty == out_clean
    torch.testing.assert_close(torch.stack(logits_dirty), torch.stack(logits_clean))


def test_greedy_output_is_the_same_alone_and_in_a_batch_of_16(tiny_model):
    # Given 16 prompts of different lengths
    model = tiny_model.model
    prompts = [random_prompt(n, model.arch.vocab_size, seed=100 + n) for n in PROMPT_LENGTHS]

    # When they are decoded together, and each one alone (paged and contiguous)
    batched, _ = greedy_paged(model, prompts, 12)

    # Then every sequence generates exactly what it generates alone
    for prompt, tokens in zip(prompts, batched, strict=True):
        (alone,), _ = greedy_paged(model, [prompt], 12)
        oracle, _ = greedy_contiguous(model, prompt, 12)
        assert tokens == alone == oracle


def test_paged_and_contiguous_agree_in_bfloat16(tiny_model_path):
    from llmq.worker.engine.model.loader import load_model

    # Given the tiny model in bfloat16
    model = load_model(tiny_model_path, "bfloat16").model
    prompt = random_prompt(37, model.arch.vocab_size, seed=5)

    # When a prompt is prefilled paged and contiguously
    tables, num_blocks = interleaved_block_tables([37], 16)
    meta = AttentionMetadata.build([37], [37], tables, 16)
    paged = model.compute_logits(model(torch.tensor(prompt), meta,
                                       model.make_kv_caches(num_blocks, 16)))

    # Then the logits agree to bfloat16 precision (a few ulps of the largest logit; the two
    # paths round differently) and the caches hold bfloat16
    oracle = contiguous_logits(model, prompt)
    assert paged.dtype == torch.float32
    assert model.make_kv_caches(1, 16)[0].dtype == torch.bfloat16
    assert (paged - oracle).abs().max() < 0.05 * oracle.abs().max()
    assert (paged.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.9


def test_cache_sizing_matches_the_allocated_tensors(tiny_model):
    # Given a byte budget turned into a number of blocks, as the model runner does
    model = tiny_model.model
    per_block = model.kv_cache_bytes_per_block(16)
    num_blocks = (1 << 20) // per_block

    # When the caches are allocated
    caches = model.make_kv_caches(num_blocks, 16)

    # Then they take exactly the budgeted bytes, one zeroed tensor per layer
    assert len(caches) == model.arch.num_layers
    assert sum(c.numel() * c.element_size() for c in caches) == num_blocks * per_block
    assert all(not c.any() for c in caches)


@pytest.mark.model
def test_real_model_greedy_output_is_the_same_alone_and_in_a_batch_of_16(default_model_f32):
    # Given SmolLM2 and 16 prompts of different lengths
    model = default_model_f32.model
    prompts = [random_prompt(n, model.arch.vocab_size, seed=200 + n) for n in PROMPT_LENGTHS]

    # When they are decoded together through the paged path
    batched, _ = greedy_paged(model, prompts, 8)

    # Then a short and a long one generate exactly what they generate alone
    for i in (0, 9, 15):
        alone, _ = greedy_contiguous(model, prompts[i], 8)
        assert batched[i] == alone
