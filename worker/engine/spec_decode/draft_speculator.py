"""The scheduler's speculator when a draft model proposes (`--speculative-method draft`).

Same rules as prompt lookup (worker/engine/spec_decode/speculator.py: who may draft, k adapted
per request, roll-back, acceptance totals); only where drafts come from differs. A model's
drafts are batched over the running requests, so the engine calls `prepare` once a step before
the scheduler runs, and the scheduler's per-request `propose` then hands out what it made.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmq.worker.engine.spec_decode.draft_model import DraftModelProposer, check_same_vocabulary
from llmq.worker.engine.spec_decode.speculator import (
    RequestSpecState,
    SpeculativeConfig,
    Speculator,
)

if TYPE_CHECKING:
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.model.loader import LoadedModel
    from llmq.worker.engine.request import Request

logger = logging.getLogger(__name__)


class DraftModelSpeculator(Speculator):
    def __init__(self, config: SpeculativeConfig, proposer: DraftModelProposer) -> None:
        super().__init__(config)
        self.proposer = proposer

    def prepare(self, running: list[Request], max_model_len: int) -> None:
        """Run the draft model for every running request that will decode and may draft."""
        wanted: list[tuple[Request, int]] = []
        for request in running:
            room = self.draft_room(request, self.config.num_speculative_tokens + 1,
                                   max_model_len)
            if room <= 0:
                continue
            length = self.state_of(request).draft_length
            # NOTE: peeked, not `next_k()`: the scheduler's `propose` counts the step down.
            k = 0 if length.cooldown > 0 else min(length.k, room)
            if k > 0:
                wanted.append((request, k))
        self.proposer.propose(wanted, {r.request_id for r in running})

    def draft(self, request: Request, state: RequestSpecState, k: int) -> list[int]:
        return self.proposer.take(request)[:k]


def build_draft_speculator(config: EngineConfig, target: LoadedModel, num_kv_blocks: int,
                           draft: LoadedModel | None = None) -> DraftModelSpeculator:
    """Load `config.draft_model` (unless given) with the target's loaders, dtype and weights,
    check it speaks the target's vocabulary, and give it a KV cache of its own."""
    import time

    from llmq.worker.engine.model.loader import load_model

    assert config.draft_model is not None and config.speculative_config is not None
    if draft is None:
        started = time.perf_counter()
        draft = load_model(config.draft_model, config.dtype, config.weights)
        logger.info("loaded draft model %s in %.1f s", config.draft_model,
                    time.perf_counter() - started)
    check_same_vocabulary(config.model or "SmolLM2-135M-Instruct (the default model)",
                          target.tokenizer.token_bytes,
                          config.draft_model, draft.tokenizer.token_bytes)
    # NOTE: the target's block count (prefix sharing aside, the same tokens are cached) plus
    # one block per running request for the draft positions past its tokens.
    num_blocks = num_kv_blocks + config.max_num_seqs
    proposer = DraftModelProposer(draft.model, target.arch.vocab_size, num_blocks,
                                  config.block_size, config.max_num_batched_tokens)
    logger.info("draft model %s: %d KV blocks (%.0f MiB)", config.draft_model, num_blocks,
                num_blocks * draft.model.kv_cache_bytes_per_block(config.block_size) / 2**20)
    return DraftModelSpeculator(config.speculative_config, proposer)
