"""ParallelSampling: the families of n > 1 requests, for the scheduler. Pure Python.

After vLLM v0's sequence groups with blocks forked by reference (vLLM v1 keeps the parent in
`v1/engine/parallel_sampling.py`): the request as added is a parent that prefills the full
blocks of its prompt (all but its last token, `fork_at`) and never samples; then it forks into
n children (`<id>#<index>`) that hold those blocks with one reference each and compute only the
prompt's tail and their own tokens. A parent counts as n running sequences, so its children
always fit. Child i samples with seed + i (`SamplingParams.for_child`). Every one of the n ends
with its own finished output, which carries the parent's id and `index` i.

This module keeps who belongs to which family (so an abort of the id a user knows reaches every
child) and builds the children; the scheduler places them (worker/engine/scheduler.py).
"""

from __future__ import annotations

import copy
import dataclasses

from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.request import Request

__all__ = ["ParallelSampling"]


class ParallelSampling:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # The id a user knows -> the ids now in the engine for it: the parent, then its
        # unfinished children.
        self._families: dict[str, list[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._families

    def add_parent(self, request: Request) -> None:
        """Make a request with n > 1 a parent: it computes `fork_at` tokens, then forks."""
        self._families[request.request_id] = [request.request_id]
        # NOTE: all but the last prompt token, whole blocks only: a block the children share is
        # never written again, and each child computes the last token itself to get logits of
        # its own. 0 means nothing to share: the parent forks before it runs.
        request.fork_at = (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def member_ids(self, request_id: str) -> list[str]:
        """The engine's ids for a request: its family's members, or the id itself."""
        return list(self._families.get(request_id, (request_id,)))

    def fork(self, parent: Request) -> list[Request]:
        """The parent's n children, in the family in its place; blocks are the scheduler's."""
        children = []
        for index in range(parent.sampling_params.n):
            child = Request(f"{parent.request_id}#{index}", parent.prompt_token_ids,
                            parent.sampling_params.for_child(index),
                            eos_token_ids=parent.eos_token_ids,
                            arrival_time=parent.arrival_time, priority=parent.priority,
                            # NOTE: a shallow copy suffices: the parent never sampled, so its
                            # detokenizer holds no text yet, only shared tables.
                            detokenizer=copy.copy(parent.detokenizer))
            child.parent_id, child.index = parent.request_id, index
            child.batch = parent.batch
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            children.append(child)
        self._families[parent.request_id] = [child.request_id for child in children]
        return children

    def leave(self, request: Request) -> None:
        """A finished request leaves its family; the family ends with its last member (or with
        a parent that ended before it forked)."""
        family_id = request.output_id
        members = self._families.get(family_id)
        if members is None:
            return
        if request.request_id in members:
            members.remove(request.request_id)
        if not members or request.fork_at is not None:
            del self._families[family_id]

    @staticmethod
    def terminal_outputs(request: Request, output: EngineCoreOutput) -> list[EngineCoreOutput]:
        """A finished request's terminal outputs: its own, or for a parent that ended before it
        forked (aborted, failed) one for each of its n completions."""
        if request.fork_at is None:
            return [output]
        return [dataclasses.replace(output, index=i) for i in range(request.sampling_params.n)]
