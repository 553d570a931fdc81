"""AffinityRouter: which worker's prefix cache a request should run on, if not this one's.

Each worker publishes the landmark hashes of what its prefix cache holds
(worker/engine/prefix_landmarks.py); this router holds the latest copy of every peer's, and of
its own (its cache, plus the prompts it admitted whose prefix it is computing now, so a burst of
one prefix does not scatter before the first copy is cached). A prompt's match on a worker is
the depth of its deepest landmark that worker holds; the request goes to the peer with the
deepest match when that match is deeper than this worker's own and worth a hop (at least
`min_tokens`), among peers whose ticket backlog is below `max_backlog`. Ties keep the request
here, so a prefix that two workers hold stays where it is read: affinity only concentrates work
that would otherwise be computed twice, and load spreads as it did without it. An entry of a
lane stream goes only to a peer that takes lane tickets (all of this release; one of an older
release, still running during a rollout, would leave them waiting until the lease ran out).

Pure Python over ints (no Redis, no engine): the keeper thread feeds it, admission asks it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from llmq.worker.engine.prefix_landmarks import MAX_LANDMARKS, prompt_landmarks

__all__ = ["AffinityRouter", "PeerCache", "Route"]

# Seconds a prompt admitted here counts as held before its blocks show in the cache (a prefill
# longer than this is rare; after it the cache itself says).
CLAIM_TTL_S = 20.0


class Route(NamedTuple):
    worker_id: str  # the peer to hand the request to
    prefix: int  # the deepest landmark of the prompt that peer holds: names the shared prefix


@dataclass(frozen=True)
class PeerCache:
    worker_id: str
    landmarks: frozenset[int]  # short hashes of the landmark blocks its cache holds
    backlog: int = 0  # entries handed to it that it has not taken yet
    takes_lanes: bool = False  # it takes tickets of lane streams' entries too


@dataclass(frozen=True)
class _Pool:
    own: frozenset[int] = frozenset()
    peers: tuple[PeerCache, ...] = ()


@dataclass
class AffinityRouter:
    block_size: int
    min_tokens: int = 256
    max_backlog: int = 256
    clock: Callable[[], float] = time.monotonic
    _pool: _Pool = field(default_factory=_Pool)
    _claims: dict[int, float] = field(default_factory=dict)  # landmark -> when claimed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def target(self, token_ids: Sequence[int], on_lane: bool = False) -> Route | None:
        """The peer this prompt should run on, or None to run it here (`on_lane`: its entry is
        on a lane stream, not the queue's own)."""
        marks = prompt_landmarks(token_ids, self.block_size)
        if not marks or marks[-1][0] * self.block_size < self.min_tokens:
            return None
        pool = self._pool
        with self._lock:
            claims = set(self._claims)
        own, _ = _deepest(marks, lambda h: h in pool.own or h in claims)
        best: Route | None = None
        best_depth, best_backlog = own, 0
        for peer in pool.peers:
            if peer.backlog >= self.max_backlog or (on_lane and not peer.takes_lanes):
                continue
            depth, landmark = _deepest(marks, peer.landmarks.__contains__)
            if depth * self.block_size < self.min_tokens:
                continue
            if depth > best_depth or (depth == best_depth and best is not None
                                      and peer.backlog < best_backlog):
                best, best_depth, best_backlog = Route(peer.worker_id, landmark), depth, \
                    peer.backlog
        return best

    def claim(self, token_ids: Sequence[int]) -> None:
        """A prompt is being admitted here: count its prefix as held until the cache shows it."""
        now = self.clock()
        marks = prompt_landmarks(token_ids, self.block_size)
        with self._lock:
            for _, landmark in marks:
                self._claims[landmark] = now

    def update(self, cached: Sequence[int], peers: Sequence[PeerCache]) -> None:
        """The keeper's refresh: this worker's cache now, and every live, accepting peer's."""
        self._pool = _Pool(frozenset(cached), tuple(peers))
        now = self.clock()
        with self._lock:
            self._claims = {h: t for h, t in self._claims.items()
                            if now - t < CLAIM_TTL_S and h not in self._pool.own}

    def holds(self, landmark: int) -> bool:
        """Whether this worker's cache (or a prompt it is computing) holds this landmark."""
        if landmark in self._pool.own:
            return True
        with self._lock:
            return landmark in self._claims

    def own_landmarks(self) -> list[int]:
        """What this worker publishes: its cache and its live claims, at most MAX_LANDMARKS."""
        with self._lock:
            claims = list(self._claims)
        held = sorted(self._pool.own.union(claims))
        return held[:MAX_LANDMARKS]

    def peers(self) -> tuple[PeerCache, ...]:
        return self._pool.peers


def _deepest(marks: list[tuple[int, int]], holds: Callable[[int], bool]) -> tuple[int, int]:
    """(blocks, landmark) of the prompt's prefix a holder has: its deepest landmark held (the
    chain hash names the whole prefix, so every shallower block is there too); (0, 0): none."""
    for depth, landmark in reversed(marks):
        if holds(landmark):
            return depth, landmark
    return 0, 0
