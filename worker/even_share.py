"""EvenShare: while a queue's entries wait unread, one worker holds at most an even part of it.

The intake window (worker/intake_window.py) keeps a worker from reading more than its engine can
start within a step or two, but nothing evened the totals: over the few seconds a burst takes to
be read, whichever worker started its prompts sooner read more, and the drain lasted as long as
the larger part (the 1B model, 64 requests on two workers: a 29/35 split, 209-223 tok/s; forced
to 32/32, 222-236). So while the queue's groups have unread entries, a worker holds at most
ceil(outstanding / live workers of the queue), where outstanding is what the groups hold over
the queue's lanes (lag + pending, XINFO GROUPS), and leaves the rest for its peers.

Work conservation comes first, so the share yields in three ways:

- It never falls below the intake window: under light load, or with a count that went stale
  low, a worker reads what its window allows, as it did without the share.
- It is lifted when unread entries stay unread. A live peer that cannot take them (its
  `max_num_seqs` reached, draining, asleep) still counts as a worker, so when entries have
  waited and no other worker has read any for `PEER_STALL_STEPS` of this worker's longest
  recent steps (at least `PEER_STALL_S`), this one reads them. A peer whose window is full reads
  again once its next step has started some of what it holds: about a step, on a pool of one
  kind of worker (a 1B model's 1,024-token prefill steps take seconds on one core).
- Counts Redis cannot give (`lag` is unknown after an XDEL; `entries-read` before Redis 7)
  mean no share at all.

Plain arithmetic over what the stream reader observed; the reader is its only user.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PEER_STALL_S", "PEER_STALL_STEPS", "EvenShare"]

# Unread entries no other worker has read for this many steps (and seconds) are this worker's.
PEER_STALL_STEPS = 3
PEER_STALL_S = 2.0


class EvenShare:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.share: int | None = None  # entries this worker may hold; None: no limit
        self._peer_reads: int | None = None  # entries the group delivered to other workers
        self._peer_read_at = clock()
        self._waiting_since: float | None = None  # unread entries seen since then

    def observe(self, *, num_workers: int, lag: int | None, pending: int,
                group_reads: int | None, own_reads: int, step_s: float = 0.0) -> None:
        """The queue's groups hold `lag` unread and `pending` read entries and have delivered
        `group_reads` in all, `own_reads` of them to this worker; `num_workers` serve it, and
        this worker's recent steps took up to `step_s`."""
        now = self.clock()
        if lag is None or group_reads is None or num_workers <= 1:
            self.share = None
            self._peer_reads = None
            return
        peer_reads = group_reads - own_reads
        if peer_reads != self._peer_reads:
            self._peer_reads = peer_reads
            self._peer_read_at = now
        if lag <= 0:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now
        stall_s = max(PEER_STALL_S, PEER_STALL_STEPS * step_s)
        stalled = (self._waiting_since is not None
                   and now - max(self._peer_read_at, self._waiting_since) >= stall_s)
        self.share = None if stalled else -(-(lag + pending) // num_workers)

    def room(self, num_held: int, floor: int) -> int | None:
        """Entries this worker may still take holding `num_held`, never held below `floor` (its
        intake window); None when there is no share to keep to."""
        if self.share is None:
            return None
        return max(0, max(self.share, floor) - num_held)
