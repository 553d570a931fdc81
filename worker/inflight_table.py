"""InFlightTable: the stream entries this worker holds, from XREADGROUP/XAUTOCLAIM to XACK.

Shared by the worker's threads (vLLM v1's EngineCoreProc keeps the same kind of table between
its input thread, busy loop and output thread): the stream reader and the lease keeper add
entries, the busy loop reads cancel flags, the output thread numbers deltas and removes entries
once their terminal event is acked, the lease keeper renews and fences them.

Key = the stream entry id, which is also the engine-internal request id: unique even when two
entries carry the same wire `id` (a resubmission), so their attempts never mix.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmq.broker.work_lanes import WorkLane
from llmq.protocol import Encoding

if TYPE_CHECKING:
    from llmq.worker.request_spans import RequestTrace


@dataclass
class InFlight:
    entry_id: str  # stream entry id = engine request id
    request_id: str  # the wire id: names the result stream llmq:r:{<request_id>}
    attempt: int  # = the entry's delivery count
    encoding: Encoding  # events go out in the request's encoding
    metadata: Any = None  # echoed back on the terminal event
    forgiven: int = 0  # deliveries that ended in a hand-back by a draining worker, not a crash
    stream: bool = True  # delta events wanted
    prompt_tokens: int = 0
    seq: int = 0  # next delta sequence number of this attempt
    admitted_ms: int = 0  # Redis server time when admitted
    # Set by the lease keeper when a peer owns the entry now: write nothing more for it.
    fenced: bool = False
    # Set when the request stream lost the entry (Redis restarted without persistence): no
    # lease to renew any more, the request still runs and its events are still written.
    orphaned: bool = False
    # Set by the cancel listener; the busy loop aborts the request as soon as it is in the engine.
    cancel_requested: bool = False
    # Set once the terminal event is queued for writing: the entry is done in the engine.
    terminal: bool = False
    # A suspect after an engine-fatal error: it runs alone (worker/reclaimer.py).
    solo: bool = False
    # Set by the busy loop once the engine has it: what an engine failure makes suspect.
    in_engine: bool = False
    # Set once the engine produced its first token: it runs, no longer waits to start (what the
    # stream reader's intake window counts, worker/intake_window.py).
    started: bool = False
    n: int = 1  # completions asked for; the terminal event waits for all of them
    # The stream the entry is on (broker/work_lanes.py); None: the queue's own stream.
    lane: WorkLane | None = None
    finished_choices: dict[int, Any] = field(default_factory=dict)  # index -> its last output
    trace: RequestTrace | None = None  # its spans' times, when the worker traces


class InFlightTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Notified whenever an entry leaves or starts: either may make room for a read.
        self._room = threading.Condition(self._lock)
        self._entries: dict[str, InFlight] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, entry: InFlight) -> bool:
        """Add an entry; False when it is already here (a reclaim racing our own renewal)."""
        with self._lock:
            if entry.entry_id in self._entries:
                return False
            self._entries[entry.entry_id] = entry
            return True

    def get(self, entry_id: str) -> InFlight | None:
        with self._lock:
            return self._entries.get(entry_id)

    def pop(self, entry_id: str) -> InFlight | None:
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            self._room.notify_all()
            return entry

    def wait_for_change(self, timeout: float) -> None:
        """Block until an entry leaves or starts (or `timeout` s pass)."""
        with self._lock:
            self._room.wait(timeout)

    def mark_started(self, entry_ids: list[str]) -> None:
        """The engine produced these entries' first tokens (busy loop, once per step)."""
        with self._lock:
            changed = False
            for entry_id in entry_ids:
                e = self._entries.get(entry_id)
                if e is not None and not e.started:
                    e.started = changed = True
            if changed:
                self._room.notify_all()

    def num_not_started(self) -> int:
        """Entries held that the engine has not started yet: being admitted, or waiting in it."""
        with self._lock:
            return sum(1 for e in self._entries.values()
                       if not e.started and not e.terminal and not e.fenced)

    def entry_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def live_entry_ids(self) -> list[str]:
        """Entries whose lease this worker holds: what a renewal or a hand-back covers."""
        with self._lock:
            return [e.entry_id for e in self._entries.values() if not e.fenced and not e.orphaned]

    def orphan(self, entry_ids: list[str]) -> None:
        with self._lock:
            for entry_id in entry_ids:
                if (e := self._entries.get(entry_id)) is not None:
                    e.orphaned = True

    def orphan_all(self) -> None:
        """The consumer group is gone (NOGROUP): none of our entries has a lease any more."""
        with self._lock:
            for e in self._entries.values():
                e.orphaned = True

    def by_request_id(self, request_id: str) -> list[InFlight]:
        with self._lock:
            return [e for e in self._entries.values() if e.request_id == request_id]

    def request_cancel(self, request_id: str) -> list[str]:
        """Flag every entry of a request for cancellation; returns their entry ids."""
        with self._lock:
            hit = [e for e in self._entries.values() if e.request_id == request_id]
            for e in hit:
                e.cancel_requested = True
            return [e.entry_id for e in hit]

    def fence(self, entry_ids: list[str]) -> list[str]:
        """Mark entries a peer has taken over; returns those that were not fenced before."""
        newly = []
        with self._lock:
            for entry_id in entry_ids:
                e = self._entries.get(entry_id)
                if e is not None and not e.fenced:
                    e.fenced = True
                    newly.append(entry_id)
        return newly

    def lanes_of(self, entry_ids: list[str]) -> dict[str, WorkLane | None]:
        """entry id -> its lane, for the entries held (None: the queue's own stream)."""
        with self._lock:
            return {i: e.lane for i in entry_ids if (e := self._entries.get(i)) is not None}

    def count_lanes(self, *, not_started: bool = False) -> dict[str | None, int]:
        """Entries held per priority class (None: the queue's own stream, interactive), those
        still running; with `not_started`, only those the engine has not started."""
        counts: dict[str | None, int] = {}
        with self._lock:
            for e in self._entries.values():
                if e.terminal or e.fenced or (not_started and e.started):
                    continue
                cls = e.lane.priority_class if e.lane is not None else None
                counts[cls] = counts.get(cls, 0) + 1
        return counts

    def holds_solo(self) -> bool:
        """Whether a suspect entry is held: a worker takes no second one meanwhile."""
        with self._lock:
            return any(e.solo for e in self._entries.values())

    def running_count(self) -> int:
        """Entries whose engine work is not finished yet (not terminal, not fenced)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.terminal and not e.fenced)
