"""A test proposer for speculative decoding: drafts from a known continuation, some tokens wrong.

The tiny random model never copies its prompt, so prompt lookup would rarely draft on it; this
proposer drafts what a reference run produced, with every `corrupt_every`-th draft token (5 by
default) changed, so verification meets long accepted runs and rejections at every position.
"""

from __future__ import annotations

from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.request import Request
from llmq.worker.engine.spec_decode.speculator import (
    RequestSpecState,
    SpeculativeConfig,
    Speculator,
)


class OracleSpeculator(Speculator):
    def __init__(self, config: SpeculativeConfig, references: dict[tuple[int, ...], list[int]],
                 corrupt_every: int, vocab_size: int) -> None:
        super().__init__(config)
        self.references = references  # prompt -> the output a run without drafts produced
        self.corrupt_every = corrupt_every
        self.vocab_size = vocab_size
        self.num_calls = 0

    def draft(self, request: Request, state: RequestSpecState, k: int) -> list[int]:
        reference = self.references.get(tuple(request.prompt_token_ids), [])
        done = request.num_output_tokens
        draft = list(reference[done:done + k])
        for j in range(len(draft)):
            self.num_calls += 1
            if self.corrupt_every and self.num_calls % self.corrupt_every == 0:
                draft[j] = (draft[j] + 1) % self.vocab_size
        return draft


def use_oracle(engine: EngineCore, references: dict[tuple[int, ...], list[int]],
               corrupt_every: int = 5, k: int = 4) -> OracleSpeculator:
    """Swap the engine's proposer for the oracle (the engine must run with speculation)."""
    speculator = OracleSpeculator(SpeculativeConfig(num_speculative_tokens=k), references,
                                  corrupt_every, engine.vocab_size)
    engine.scheduler.speculator = speculator
    return speculator
