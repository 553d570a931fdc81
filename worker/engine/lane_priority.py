"""Batch yields to interactive: where a request waits, and what each step gives each lane.

The scheduler's side of lanes (broker/work_lanes.py). A request from a batch lane
(`Request.batch`) waits behind every interactive request. Each step (`LaneStep`):

- while an interactive request waits to start or is still computing its prompt, the step is
  interactive work only: batch requests sit it out, keeping their seats and KV blocks, and
  none starts. Its first token then comes after one step about as short as on an idle engine,
  whatever batch work is running;
- a seat it lacks is taken from the last running batch request (preempted), and so are KV
  blocks (`batch_victim`);
- batch prompt tokens (prefill chunks, new batch requests) are at most
  `max_batch_prefill_tokens` a step, so the step an interactive request arrives during is
  short too; batch decode rows and interactive prompts keep the whole step budget;
- the requests of a step paused for an interactive arrival (worker/engine/step_interrupt.py)
  sit out the steps run beside it, whatever their lane.

Requests without a lane are all interactive: none of this changes what they do.
"""

from __future__ import annotations

from collections.abc import Collection

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.request import Request

__all__ = ["LaneStep", "batch_victim", "interactive_starting", "waiting_index"]


def waiting_index(waiting: list[Request], request: Request, front: bool) -> int:
    """Where `request` joins the fcfs waiting queue: first come first served within its class,
    every interactive request before the first batch one (`front`: a preempted request, first
    of its class)."""
    first_batch = next((i for i, r in enumerate(waiting) if r.batch), len(waiting))
    if request.batch:
        return first_batch if front else len(waiting)
    return 0 if front else first_batch


def batch_victim(running: list[Request]) -> Request | None:
    """The running batch request to give way: the last (least important) one."""
    return next((r for r in reversed(running) if r.batch), None)


def interactive_starting(waiting: list[Request], running: list[Request],
                         paused: Collection[str] = ()) -> bool:
    """Whether an interactive request (none of `paused`) waits or is computing its prompt."""
    # NOTE: "computing its prompt" includes a resumed (preempted) request recomputing its
    # output so far: its stream stalls until then, as a first token would.
    return any(not r.batch for r in waiting) or any(
        not r.batch and r.num_tokens_to_compute - r.num_computed_tokens > 1
        and r.request_id not in paused for r in running)


class LaneStep:
    """The lane rules of one `Scheduler.schedule()`, made before anything is scheduled
    (`paused`: the requests of a paused step, which sit this one out)."""

    def __init__(self, waiting: list[Request], running: list[Request], config: EngineConfig,
                 paused: Collection[str] = ()) -> None:
        first = next((r for r in waiting if not r.batch), None)
        self.interactive_only = interactive_starting(waiting, running, paused)
        self.seat_victims = _seat_victims(first, running, config.max_num_seqs)
        self.batch_prefill_left = config.max_batch_prefill_tokens
        self.paused = paused

    def starts(self, request: Request) -> bool:
        """Whether the waiting `request` may start this step."""
        return not request.batch or (not self.interactive_only and self.batch_prefill_left > 0)

    def num_tokens(self, request: Request, remaining: int, budget: int) -> int:
        """Tokens `request` computes this step (0: it sits the step out), of the `remaining` it
        needs before its next sample, within the step's `budget`; counted as scheduled."""
        num = min(remaining, budget)
        if request.request_id in self.paused:
            return 0
        if not request.batch:
            return num
        if self.interactive_only:
            return 0
        if remaining <= 1:  # a decode row
            return num
        num = min(num, self.batch_prefill_left)
        self.batch_prefill_left -= num
        return num


def _seat_victims(interactive: Request | None, running: list[Request], max_num_seqs: int
                  ) -> list[Request]:
    """The running batch requests (last first) to preempt so `interactive` gets a seat."""
    if interactive is None:
        return []
    over = sum(r.num_seqs for r in running) + interactive.num_seqs - max_num_seqs
    victims = []
    for request in reversed(running):
        if over <= 0:
            break
        if request.batch:
            victims.append(request)
            over -= request.num_seqs
    return victims
