"""StepInterrupt: a running step with batch work in it pauses for an arriving interactive request.

Lanes (worker/engine/lane_priority.py) make the step after an interactive request's arrival
interactive work only, but a step already running when it arrives (up to `max_num_seqs` batch
decode rows and a batch prompt chunk: 140-250 ms for the default model on a 2-core host) used
to run to its end first, and that wait was most of the request's time to first token under a
batch backlog. Now:

1. admission calls `request()` (any thread) once it has queued an interactive request for the
   busy loop; the running step, if it has batch work, checks between decoder layers and
   pauses (`ModelRunner.execute_model` returns a `PausedForward`): the engine step returns;
2. the busy loop adds the request, and the next engine steps run it beside the paused step
   (`PausedStep.request_ids` sit those steps out, lane_priority.LaneStep) while an
   interactive request is starting (waiting, or computing its prompt);
3. then the paused step resumes at its next layer and ends as it would have (it may pause
   again), so a pause wastes nothing.

Exactness. The steps run beside a paused one touch none of its requests: those sit out, so
their tokens, blocks and runner state stay as the paused step saw them, and other requests'
K/V goes to other blocks. A paused step resumes only if every one of its requests is still
running with the computed tokens and block table it was scheduled with (`PausedStep.intact`);
otherwise (a preemption for the interactive request's seat or blocks, an abort) it is
dropped, and dropping is exact too: nothing of a step is committed before its last layer. The
scheduler advances `num_computed_tokens` (and with it the prefix cache, which takes only full
blocks of computed tokens: worker/engine/kv_cache_manager.py), output tokens, stop checks,
speculative acceptance and the forks of n > 1 parents only in `update_from_output`, and the
runner appends sampled tokens and advances grammars only when it samples. What `schedule()`
did stays true: slots allocated for the step stay with their requests (the rerun uses them),
admitted requests run from their prefix-cache hit, preemptions stand, and the K/V the first
layers wrote lies past every request's computed tokens, in blocks the prefix cache does not
hold, where the rerun writes it again before anything reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmq.worker.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from llmq.worker.engine.model_runner import PausedForward
    from llmq.worker.engine.outputs import SchedulerOutput

__all__ = ["PauseCheck", "PausedStep", "StepInterrupt"]

PauseCheck = Callable[[int], bool]  # after decoder layer i: pause the step there?


class StepInterrupt:
    """Whether the busy loop's running step should pause for an arriving interactive request."""

    def __init__(self) -> None:
        self._arrived = threading.Event()  # an interactive request is on its way to the engine
        self.num_paused = 0  # steps paused, for tests and the log
        self.num_dropped = 0  # paused steps that could not resume

    def request(self) -> None:
        """An interactive request was queued for the busy loop: the running step should pause.
        Thread-safe; call it after the request is in the inbox, so the busy loop finds it."""
        self._arrived.set()

    def clear(self) -> None:
        """The busy loop is about to drain its inbox: what was requested is added now.

        NOTE: cleared before the drain, set after the put: an arrival is never missed, and at
        worst one just drained leaves the flag set, costing one needless (free) pause.
        """
        self._arrived.clear()

    def pause_check(self, has_batch_work: bool) -> PauseCheck | None:
        """The layer check of a step about to run, or None: it runs to its end."""
        # NOTE: a step of interactive work only is what an arrival would run beside anyway.
        return self._pause_after if has_batch_work else None

    def _pause_after(self, layer: int) -> bool:
        return self._arrived.is_set()


@dataclass
class PausedStep:
    """A step paused between two layers, with what its requests were when it was scheduled."""

    scheduler_output: SchedulerOutput
    forward: PausedForward
    # request id -> (the request, its computed tokens, its block table) at schedule time
    snapshot: dict[str, tuple[Request, int, list[int]]]

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput, forward: PausedForward,
           requests: dict[str, Request]) -> PausedStep:
        snapshot = {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            snapshot[request_id] = (request, request.num_computed_tokens, list(request.block_ids))
        return cls(scheduler_output, forward, snapshot)

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(self.snapshot)

    def intact(self, requests: dict[str, Request]) -> bool:
        """Whether every request of the step is as it was scheduled: then it may resume."""
        return all(requests.get(request_id) is request
                   and request.status == RequestStatus.RUNNING
                   and request.num_computed_tokens == num_computed
                   and request.block_ids == block_ids
                   for request_id, (request, num_computed, block_ids) in self.snapshot.items())
