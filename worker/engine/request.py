"""Request: one generation inside the engine, and its ordered lifecycle.

Only the scheduler changes `status`. Token ids are plain lists; the KV-cache manager keeps
`block_ids` (the block table) and `block_hashes` (chained hashes of the full blocks).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Protocol

from llmq.protocol.errors import ErrorCode
from llmq.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmq.worker.engine.spec_decode.speculator import RequestSpecState


class RequestStatus(enum.IntEnum):
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything past this point is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


class Detokenizer(Protocol):
    """What the scheduler needs to turn new token ids into text (worker/engine/detokenizer.py)."""

    def update(self, new_token_ids: list[int]) -> str:
        """Text the new tokens complete; never half a UTF-8 character."""

    def finish(self) -> str:
        """Whatever text is still held back, once the request is over."""


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value is served first under the priority policy
        # From a batch lane: scheduled after every interactive request, and preempted first.
        self.batch = False
        self.detokenizer = detokenizer

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hits when first scheduled (-1: not yet)
        self.num_preemptions = 0
        self.block_ids: list[int] = []  # the block table
        self.block_hashes: list[int] = []  # chained hashes of full blocks of all_token_ids

        self.output_text = ""  # text decided so far (stop strings trimmed)
        self.num_text_sent = 0  # chars of output_text already handed out in outputs
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.error_code: ErrorCode | None = None
        self.error_message: str | None = None

        # Parallel sampling (n > 1): the request as added is a parent that only prefills the
        # prompt's full blocks (`fork_at` tokens), then forks into n children that share those
        # blocks. A child's outputs carry its parent's id and its own `index`.
        self.fork_at: int | None = None
        self.parent_id: str | None = None
        self.index = 0
        self.new_to_runner = False  # a forked child the model runner has not seen yet
        # Speculative decoding: the n-gram index and draft length, made on its first draft.
        self.spec_state: RequestSpecState | None = None

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def output_id(self) -> str:
        """The id outputs carry: the parent's for a child of an n > 1 request."""
        return self.parent_id or self.request_id

    @property
    def num_seqs(self) -> int:
        """Running sequences this request stands for: a parent counts as its n children."""
        return self.sampling_params.n if self.fork_at is not None else 1

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV must exist before the next sample (a parent: up to its fork)."""
        return self.num_tokens if self.fork_at is None else self.fork_at

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
