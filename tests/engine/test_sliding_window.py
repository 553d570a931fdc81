"""Sliding-window attention in the engine: blocks that fall out of the window are freed and
reused by other requests, and the output still equals transformers'.

The tiny Mistral (tests/fixtures/tiny_hf.py) slides a 24-token window over 16-token blocks;
its prompts and continuations run well past it.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmq.worker.engine.kv_cache_manager import KVCacheManager
from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams
from tests.fixtures.models import one_torch_thread
from tests.fixtures.tiny_hf import VOCAB, write_tiny_hf

NEW_TOKENS = 40


def test_blocks_wholly_before_the_window_are_freed_as_a_request_advances():
    # Given a manager for a model that slides an 8-token window over 4-token blocks
    manager = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    request = Request("a", list(range(20)), SamplingParams(), arrival_time=0.0)
    manager.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    free_before = manager.num_free_blocks
    # When its next token is scheduled (the query at position 20 sees keys 13..20)
    manager.allocate_slots(request, 1)
    # Then blocks 0-2 (keys 0..11) went back to the pool; block 3 (keys 12..15) is kept
    held = manager.req_to_blocks["a"]
    null = manager.block_pool.null_block
    assert [block is null for block in held] == [True, True, True, False, False, False]
    assert manager.num_free_blocks == free_before + 3 - 1  # three freed, one new for pos 20
    # And freeing the request releases only what it still holds (no double free)
    manager.free(request)
    assert manager.num_free_blocks == manager.num_usable_blocks


@pytest.mark.model
def test_mistral_through_the_engine_equals_transformers_with_blocks_reused(tmp_path):
    import transformers

    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore

    one_torch_thread()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    folder = write_tiny_hf("mistral", tmp_path / "mistral")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (45, 30, 9, 60)]
    # Given an engine whose cache has 13 usable blocks: the four requests need 22 without the
    # window, 3 each with it, so they run side by side only by freeing what slid out of it
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=14,
                                     enable_prefix_caching=False))
    assert engine.scheduler.kv_cache_manager.sliding_window == 24
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # When they run together
    outputs = engine.generate(prompts, params)
    # Then each continuation is transformers' greedy one, and nothing was preempted
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, out in zip(prompts, outputs, strict=True):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.new_token_ids == ref[0, len(prompt):].tolist()
    assert engine.stats().num_preemptions == 0
