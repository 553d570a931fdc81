"""ReadMux: which result streams a client follows and from where, without doing any IO.

A client that follows thousands of requests must not hold a connection per request (redis-py caps
a pool at 100, and a server at `maxclients`). Instead one reader per client reads every followed
result stream with `XREAD BLOCK`, and hands each entry to the follower that waits for it. The key
set is split into lanes of at most `keys_per_lane` keys, each read on its own connection, so one
command never carries more than a lane's keys (the server runs each command alone) and 10,000
followers need a handful of connections:

    mux = ReadMux()
    subscription, wake = mux.subscribe(key, sink)       # wake: the lane's read must be cut short
    args = mux.read_command(lane, block_ms)             # XREAD COUNT .. BLOCK .. STREAMS ..
    for sink, entries in mux.dispatch(lane, reply):     # the raw reply, RESP2 or RESP3
        deliver(sink, entries)                          # [StreamEntry(entry_id, fields)]

A lane's read covers the keys it had when it was sent; a key subscribed after that is `uncovered`
until the next read, which is why `subscribe` says when the read in flight should be woken
(`CLIENT UNBLOCK`). Positions only move forward, so after a failed read the next one resumes
exactly after the last entry handed over, and several followers of one stream each get every
entry once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from llmq.broker import replies
from llmq.broker.replies import StreamEntry

__all__ = ["FALLBACK_SLICE_MS", "KEYS_PER_LANE", "READ_SLICE_MS", "UNBLOCK_TRIES", "Lane",
           "LaneIO", "PollPace", "ReadMux", "ReaderBase", "Subscription", "format_entry_id",
           "merge_replies", "parse_entry_id", "single_key_reads"]

# NOTE: XREAD BLOCK in slices well under the socket timeout, so a quiet stream never looks like
# a dead server.
READ_SLICE_MS = 5_000
# NOTE: a lane's XREAD names up to this many keys: ~0.5 ms of server time per read, and five
# connections for 10,000 followers.
KEYS_PER_LANE = 2000
ENTRIES_PER_STREAM = 512  # COUNT: a long answer arrives in a few reads
# NOTE: without CLIENT UNBLOCK (an ACL without it) a stream followed while a read is blocked waits
# for that read to end; slices this short bound the wait.
FALLBACK_SLICE_MS = 100
UNBLOCK_TRIES = 6  # a read sent but not yet blocked in the server cannot be woken: try again

# NOTE: on a Redis Cluster one XREAD may only name keys of one slot, and result streams are spread
# over every slot: a lane there is polled, one XREAD per stream without BLOCK, pipelined per node,
# at a pace that quickens while entries arrive and slows to POLL_MAX_MS when all is quiet.
POLL_MIN_MS = 2
POLL_MAX_MS = 50

EntryId = tuple[int, int]
_ORIGIN: EntryId = (0, 0)


def parse_entry_id(raw: bytes | str) -> EntryId:
    """`b"1717171717171-3"` -> (1717171717171, 3); ValueError when it is not an entry id."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_entry_id(entry_id: EntryId) -> str:
    return f"{entry_id[0]}-{entry_id[1]}"


@dataclass(eq=False)
class Subscription:
    """One follower of one stream: every entry after `position` goes to its `sink`."""

    key: str
    sink: Any  # whatever the IO layer delivers through (an asyncio.Queue, a queue.SimpleQueue)
    position: EntryId = _ORIGIN
    lane: Lane | None = None


@dataclass(eq=False)
class Lane:
    """Up to `keys_per_lane` followed keys, read by one connection."""

    index: int
    subscriptions: dict[str, list[Subscription]] = field(default_factory=dict)
    reading: bool = False  # a read is in flight (it may be blocked in the server)
    covered: set[str] = field(default_factory=set)  # the keys that read names
    rounds: int = 0  # reads sent so far: tells a wake-up which read it was meant for

    def __len__(self) -> int:
        return len(self.subscriptions)

    @property
    def uncovered(self) -> bool:
        """Some followed key is missing from the read in flight."""
        return self.reading and any(key not in self.covered for key in self.subscriptions)


class ReadMux:
    def __init__(self, keys_per_lane: int = KEYS_PER_LANE,
                 entries_per_stream: int = ENTRIES_PER_STREAM) -> None:
        if keys_per_lane < 1:
            raise ValueError(f"keys_per_lane must be >= 1, got {keys_per_lane}")
        self.keys_per_lane = keys_per_lane
        self.entries_per_stream = entries_per_stream
        self.lanes: list[Lane] = []
        self._lane_of: dict[str, Lane] = {}
        self._counter = itertools.count()

    def __len__(self) -> int:
        """Followed keys."""
        return len(self._lane_of)

    @property
    def num_subscriptions(self) -> int:
        return sum(len(subs) for lane in self.lanes for subs in lane.subscriptions.values())

    def subscribe(self, key: str, sink: Any) -> tuple[Subscription, bool]:
        """Follow `key` from its first entry; (subscription, whether its lane must be woken)."""
        lane = self._lane_of.get(key)
        if lane is None:
            lane = min((lane for lane in self.lanes if len(lane) < self.keys_per_lane),
                       key=len, default=None)
            if lane is None:
                lane = Lane(next(self._counter))
                self.lanes.append(lane)
            self._lane_of[key] = lane
        subscription = Subscription(key, sink, lane=lane)
        lane.subscriptions.setdefault(key, []).append(subscription)
        return subscription, lane.reading and key not in lane.covered

    def unsubscribe(self, subscription: Subscription) -> None:
        lane = subscription.lane
        if lane is None:
            return
        subscription.lane = None
        subs = lane.subscriptions.get(subscription.key, [])
        if subscription in subs:
            subs.remove(subscription)
        if not subs:
            lane.subscriptions.pop(subscription.key, None)
            self._lane_of.pop(subscription.key, None)

    def read_command(self, lane: Lane, block_ms: int | None) -> list[Any] | None:
        """The XREAD of the lane's next round (`block_ms` None: no BLOCK); marks the lane as
        reading. None when the lane follows no key any more: its last follower can leave
        between the reader's idle check and this call, and an XREAD naming no stream is a
        syntax error (Redis 7), which would fail the lane's next followers."""
        keys = list(lane.subscriptions)
        if not keys:
            return None
        ids = [format_entry_id(min(s.position for s in lane.subscriptions[key])) for key in keys]
        lane.covered = set(keys)
        lane.reading = True
        lane.rounds += 1
        block = [] if block_ms is None else ["BLOCK", block_ms]
        return ["XREAD", "COUNT", self.entries_per_stream, *block, "STREAMS", *keys, *ids]

    def read_failed(self, lane: Lane) -> None:
        """The lane's read ended without a reply; the next one starts from the same positions."""
        lane.reading = False
        lane.covered = set()

    def dispatch(self, lane: Lane, reply: object) -> list[tuple[Any, list[StreamEntry]]]:
        """Hand a read's entries to the followers that have not seen them yet: (sink, entries).

        `reply` is the XREAD reply (`replies.read_streams`): None (nothing arrived, or the read
        was woken), a RESP2 list of [key, entries] or a RESP3 map key -> entries.
        """
        self.read_failed(lane)
        out: list[tuple[Any, list[StreamEntry]]] = []
        for key, entries in replies.read_streams(reply):
            subs = lane.subscriptions.get(key)
            if not subs:
                continue  # unsubscribed while the read was in flight
            parsed = [(parse_entry_id(entry.entry_id), entry) for entry in entries]
            if not parsed:
                continue
            for sub in subs:
                fresh = [entry for position, entry in parsed if position > sub.position]
                if fresh:
                    sub.position = parsed[-1][0]
                    out.append((sub.sink, fresh))
        return out

    def sinks(self, lane: Lane) -> list[Any]:
        """Every sink of the lane (to tell them all about an error that ends their reads)."""
        return [sub.sink for subs in lane.subscriptions.values() for sub in subs]

    def drop_lane_subscriptions(self, lane: Lane) -> None:
        for subs in list(lane.subscriptions.values()):
            for sub in list(subs):
                self.unsubscribe(sub)


def single_key_reads(command: list[Any]) -> list[tuple[str, str, int]]:
    """(key, after id, count) of each stream a lane's `read_command` (without BLOCK) names."""
    count = int(command[2])
    streams = command[command.index("STREAMS") + 1:]
    half = len(streams) // 2
    return [(streams[i], streams[half + i], count) for i in range(half)]


def merge_replies(single_key_replies: list[Any]) -> list[list[object]]:
    """Single-key XREAD replies (redis-py's parsed shape) as one multi-key reply for dispatch."""
    merged: list[list[object]] = []
    for reply in single_key_replies:
        if isinstance(reply, dict):
            merged.extend([key, entries] for key, entries in reply.items())
        elif reply:
            merged.extend(list(pair) for pair in reply)
    return merged


class PollPace:
    """How long a polled lane waits before its next round."""

    def __init__(self) -> None:
        self.ms = POLL_MIN_MS

    def after(self, got_entries: bool) -> float:
        """Seconds to wait after a round that did (or did not) bring entries."""
        self.ms = POLL_MIN_MS if got_entries else min(POLL_MAX_MS, self.ms * 2)
        return self.ms / 1000


@dataclass(eq=False)
class LaneIO:
    """What a reader keeps per lane: its connection and the loop (task or thread) reading it."""

    lane: Lane
    work: Any  # an asyncio.Event or threading.Event: set when the lane has keys to read
    runner: Any = None  # the asyncio.Task or threading.Thread running the lane's loop
    conn: Any = None  # the lane's dedicated connection, None until (re)connected
    client_id: int | None = None  # its CLIENT ID, for CLIENT UNBLOCK; None: cannot be woken
    wake_pending: bool = False  # a CLIENT UNBLOCK for the current read is under way
    pace: PollPace = field(default_factory=PollPace)  # a polled (cluster) lane's pace


class ReaderBase:
    """The IO-free half of the sync and asyncio result readers."""

    def __init__(self, url: str, policy: Any, keys_per_lane: int, *, polled: bool = False
                 ) -> None:
        self._url = url
        self._polled = polled  # a cluster: lanes are polled (see POLL_MAX_MS), never blocked
        self._policy = policy  # llmq.broker.retry.RetryPolicy, shared with the client
        self._mux = ReadMux(keys_per_lane)
        self._lanes: dict[int, LaneIO] = {}
        self._can_unblock = True  # False once the server refused CLIENT ID or CLIENT UNBLOCK
        self._closed = False

    @property
    def num_connections(self) -> int:
        """Connections the reader holds open (one per lane in use)."""
        return sum(1 for lane in self._lanes.values() if lane.conn is not None)

    def _block_ms(self, io: LaneIO) -> int:
        return READ_SLICE_MS if io.client_id is not None else FALLBACK_SLICE_MS

