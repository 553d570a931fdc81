"""WorkerContext: what the worker's IO threads share, in one typed object.

The stream reader, admission, lease keeper, cancel listener and result writer each take this
context (and the one or two collaborators they call) instead of a dozen loose arguments. It
holds the configuration and the key names built from it, the connection factory (each thread
opens its own client, so a blocking read never holds another thread's connection), the
metrics, the busy loop's inbox, the in-flight table, the heartbeat's counters and the connection
state readiness reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from llmq.broker.connection import connect_at_most_once
from llmq.broker.keys import Keys
from llmq.worker.connection_state import ConnectionState
from llmq.worker.heartbeat_counters import HeartbeatCounters
from llmq.worker.inbox import Inbox
from llmq.worker.inflight_table import InFlightTable
from llmq.worker.intake_window import IntakeWindow
from llmq.worker.lane_registry import LaneRegistry
from llmq.worker.worker_config import WorkerConfig

if TYPE_CHECKING:
    from llmq.worker.metrics import WorkerMetrics
    from llmq.worker.request_spans import RequestSpans

__all__ = ["WorkerContext"]


@dataclass
class WorkerContext:
    config: WorkerConfig
    model_name: str  # reported in `start` events and heartbeats
    max_num_seqs: int  # the engine's seats: a worker holds at most this many entries
    metrics: WorkerMetrics | None = None  # None: no metrics port
    max_num_batched_tokens: int = 1024  # the engine's tokens per step: what it can start
    keys: Keys = field(init=False)
    table: InFlightTable = field(default_factory=InFlightTable)
    inbox: Inbox = field(default_factory=Inbox)
    counters: HeartbeatCounters = field(default_factory=HeartbeatCounters)
    # NOTE: the stream reader counts as down until its first read, so a worker is not ready
    # before it has reached Redis once.
    state: ConnectionState = field(
        default_factory=lambda: ConnectionState(pending=("stream reader",)))
    connect: Callable[[], redis.Redis] = field(init=False)
    intake: IntakeWindow = field(init=False)
    spans: RequestSpans | None = None  # None: this process does not trace (broker/tracing.py)
    lanes: LaneRegistry = field(init=False)
    # The workers whose heartbeats are live, of every queue under the key prefix (the lease
    # keeper's registry read); the stream reader counts the ones that read this queue.
    live_worker_ids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.keys = Keys(self.config.prefix)
        self.intake = IntakeWindow(self.max_num_seqs, self.max_num_batched_tokens,
                                   self.config.interactive_headroom)
        self.lanes = LaneRegistry(self.keys, self.config.queue)
        # NOTE: socket timeouts well above the blocking reads' BLOCK slice, so only a server that
        # stopped answering times out.
        timeout = self.config.read_block_ms / 1000.0 + 10.0
        url = self.config.redis_url
        self.connect = lambda: connect_at_most_once(url, socket_timeout=timeout)

    @property
    def queue(self) -> str:
        return self.config.queue

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def queue_key(self) -> str:
        return self.keys.queue(self.config.queue)
