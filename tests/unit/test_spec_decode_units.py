"""Speculative decoding's pure-Python parts: prompt-lookup drafts, the adaptive draft length,
KV blocks freed on rejection, and the configuration's errors."""

from __future__ import annotations

from typing import Any

import pytest

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.kv_cache_manager import KVCacheManager
from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.spec_decode.draft_length import MAX_COOLDOWN_STEPS, DraftLength
from llmq.worker.engine.spec_decode.ngram_proposer import NgramIndex
from llmq.worker.engine.spec_decode.speculator import SpeculativeConfig, Speculator


def test_the_longest_matching_ngram_wins_and_its_latest_occurrence():
    index = NgramIndex(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # "1 2 3" occurred at 0 (followed by 9); "2 3" last at 4 (followed by 8): 3-gram wins
    assert index.propose(tokens, 3) == [9, 2, 3]
    # With only 2-grams, the latest "2 3" (followed by 8 7 1) wins
    assert NgramIndex(1, 2).propose(tokens, 3) == [8, 7, 1]


def test_no_match_proposes_nothing_and_the_suffix_never_matches_itself():
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 5], 4) == []
    index = NgramIndex(min_n=2, max_n=3)
    assert index.propose([7, 7], 4) == []  # "7 7" has no earlier occurrence with a successor
    assert index.propose([7, 7, 7], 4) == [7]  # now it has: the one at 0, followed by one 7


def test_the_index_grows_with_the_output():
    index = NgramIndex(min_n=2, max_n=2)
    tokens = [5, 6, 7, 8, 9]
    assert index.propose(tokens, 2) == []
    tokens += [5, 6]  # the output starts copying the prompt
    assert index.propose(tokens, 2) == [7, 8]
    tokens += [7, 8, 9]
    assert index.propose(tokens, 4) == [5, 6, 7, 8]  # "8 9" was followed by the copy itself


def test_draft_length_grows_on_acceptance_and_backs_off_to_zero_on_misses():
    length = DraftLength(max_k=8)
    assert length.next_k() == 8
    length.record(8, 2)  # a partial run: k follows what was accepted
    assert length.next_k() == 3
    length.record(3, 3)
    assert length.next_k() == 5
    # A request whose drafts keep failing proposes less and less often
    proposals = 0
    for _ in range(400):
        k = length.next_k()
        if k:
            proposals += 1
            length.record(k, 0)
    assert proposals < 15
    assert length.cooldown <= MAX_COOLDOWN_STEPS
    # and one accepted draft brings it back at once
    while length.next_k() == 0:
        pass
    length.record(1, 1)
    assert length.next_k() == 3


def test_trim_frees_blocks_past_the_accepted_tokens_only():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = Request("r", list(range(6)), SamplingParams(), arrival_time=0.0)
    manager.allocate_slots(request, 6)  # the prefill
    request.num_computed_tokens = 6
    request.append_output_token_ids([42])
    free_before = manager.num_free_blocks
    # A verification of the last token + 5 drafts needs positions 6..11: a third block
    manager.allocate_slots(request, 6)
    assert len(request.block_ids) == 3 and manager.num_free_blocks == free_before - 1
    # No draft accepted: 8 tokens exist, the third block held rejected drafts only
    request.num_computed_tokens = 7
    request.append_output_token_ids([43])
    manager.trim(request, request.num_tokens)
    assert len(request.block_ids) == 2 and manager.num_free_blocks == free_before
    manager.trim(request, request.num_tokens)  # nothing more to free
    assert len(request.block_ids) == 2
    manager.free(request)
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_requests_that_cannot_use_a_draft_get_none():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    tokens = [1, 2, 3, 1, 2]

    def draft(**params: Any) -> list[int]:
        request = Request("r", tokens, SamplingParams(**params), arrival_time=0.0)
        request.num_computed_tokens = len(tokens) - 1  # decoding: the last token is new
        return speculator.propose(request, budget=5, max_model_len=100)

    assert draft() == [3, 1, 2]
    assert draft(speculative=False) == []
    assert draft(min_tokens=1) == []  # the stop-token ban before min_tokens is per position


@pytest.mark.parametrize("fields, message", [
    ({"speculative_method": "eagle"}, "speculative_method must be one of"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
])
def test_bad_speculative_settings_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
