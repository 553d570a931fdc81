"""The busy loop's inbox: what the IO threads ask of the engine, in FIFO order.

After vLLM v1's EngineCoreProc input queue: only the busy loop touches the engine, so the threads
that read Redis hand it work through this queue and never call the engine themselves. Items:

- `list[AddRequest]`  one read's admitted requests, added together before the next step (so
                      their prefills share it, as if added in-process);
- `AbortRequests`     stop these engine requests (a cancel, or a lease lost to a peer);
- `UtilityCall`       a control-stream call to run between two steps (worker/utility_calls.py).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from llmq.protocol import ControlCall
from llmq.worker.engine.sampling_params import SamplingParams

__all__ = ["AbortRequests", "AddRequest", "Inbox", "InboxItem", "UtilityCall"]


@dataclass
class AddRequest:
    """Put this request into the engine."""

    entry_id: str  # the stream entry id, which is the engine's request id
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    arrival_time: float  # engine clock (monotonic), back-dated to the entry's XADD
    # Run it alone: it was in the engine when the engine failed (worker/reclaimer.py), so it
    # waits for the engine to empty and nothing joins it until it ends.
    solo: bool = False
    # From a batch lane (broker/work_lanes.py): scheduled after interactive work, preempted first.
    batch: bool = False


@dataclass
class AbortRequests:
    """Abort these engine requests (cancel, or lease lost)."""

    entry_ids: list[str]


@dataclass
class UtilityCall:
    """Run this control call on the busy loop, which owns the engine."""

    call: ControlCall


InboxItem = list[AddRequest] | AbortRequests | UtilityCall
Inbox = queue.SimpleQueue[InboxItem]
