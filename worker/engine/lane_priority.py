"""Batch yields to interactive: where a request waits, and which running one gives way.

The scheduler's side of lanes (broker/work_lanes.py): a request from a batch lane
(`Request.batch`) waits behind every interactive request, and when an interactive request waits
to start the scheduler takes seats and KV blocks from the last running batch request. Pure
functions over the scheduler's lists.
"""

from __future__ import annotations

from llmq.worker.engine.request import Request

__all__ = ["batch_victim", "first_interactive", "seat_victims", "waiting_index"]


def waiting_index(waiting: list[Request], request: Request, front: bool) -> int:
    """Where `request` joins the fcfs waiting queue: first come first served within its class,
    every interactive request before the first batch one (`front`: a preempted request, first
    of its class)."""
    first_batch = next((i for i, r in enumerate(waiting) if r.batch), len(waiting))
    if request.batch:
        return first_batch if front else len(waiting)
    return 0 if front else first_batch


def first_interactive(waiting: list[Request]) -> Request | None:
    return next((r for r in waiting if not r.batch), None)


def seat_victims(interactive: Request | None, running: list[Request], max_num_seqs: int
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


def batch_victim(running: list[Request]) -> Request | None:
    """The running batch request to give way: the last (least important) one."""
    return next((r for r in reversed(running) if r.batch), None)
