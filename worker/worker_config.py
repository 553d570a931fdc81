"""WorkerConfig: every knob of the worker process around the engine, checked at construction.

`llmq worker` flags map 1:1 onto the fields, each with its `LLMQ_*` variable; the engine's own
knobs are `EngineConfig`'s (worker/engine/config.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from llmq.broker.keys import DEFAULT_PREFIX, DEFAULT_QUEUE, Keys, validate_name
from llmq.broker.settings import DEFAULT_RESULT_MAXLEN, DEFAULT_RESULT_TTL
from llmq.worker.fair_share import parse_weights

__all__ = ["WorkerConfig", "default_worker_id"]


def default_worker_id() -> str:
    """host-pid-random: unique per process, readable in `XINFO CONSUMERS` and logs."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:64]
    return f"{host or 'worker'}-{os.getpid()}-{os.urandom(2).hex()}"


@dataclass
class WorkerConfig:
    redis_url: str | None = None  # None: LLMQ_REDIS_URL, else the embedded server of `llmq up`
    prefix: str = DEFAULT_PREFIX
    queue: str = DEFAULT_QUEUE
    worker_id: str = field(default_factory=default_worker_id)  # the consumer name
    lease_timeout: float = 30.0  # s without renewal before peers reclaim a live worker's entry
    renew_interval: float | None = None  # s between lease renewals; None: lease_timeout / 3
    # s without a heartbeat after which a worker is dead and peers take its entries at once
    heartbeat_timeout: float = 5.0
    claim_interval: float | None = None  # s between reclaim scans; None: heartbeat_interval
    drain_timeout: float = 20.0  # s to finish in-flight work after SIGTERM
    max_deliveries: int = 3  # deliveries before an entry is dead-lettered as poison
    result_ttl: int = DEFAULT_RESULT_TTL  # s a result stream lives after its last event
    result_maxlen: int = DEFAULT_RESULT_MAXLEN  # approximate cap of each result stream
    metrics_port: int = 0  # /metrics /healthz /readyz; 0: off
    read_block_ms: int = 500  # XREADGROUP / XREAD BLOCK slice
    flush_timeout: float = 5.0  # s to keep trying to write the last events when stopping
    # Prefix-cache affinity (worker/affinity_keeper.py): hand a request to the peer whose cache
    # holds at least `affinity_min_tokens` more of its prefix; an idle worker takes one that
    # waited there `affinity_steal_delay` s.
    affinity: bool = True
    affinity_steal_delay: float = 1.0
    affinity_min_tokens: int = 256
    # Fraction of max_num_seqs that batch-lane work never takes, kept for interactive requests
    # (worker/intake_window.py).
    interactive_headroom: float = 0.25
    # While entries wait unread, hold at most an even part of the queue's work among its live
    # workers (worker/even_share.py); off: each reads what its intake window allows.
    even_share: bool = True
    # Fair-share weights of tenants within a lane, `acme=2,bob=1`; unnamed tenants weigh 1
    # (worker/fair_share.py).
    tenant_weights: str = ""

    def __post_init__(self) -> None:
        Keys(self.prefix)
        validate_name("queue", self.queue)
        validate_name("worker_id", self.worker_id)
        if self.lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be > 0 s, got {self.lease_timeout}")
        if self.renew_interval is None:
            self.renew_interval = self.lease_timeout / 3
        if not 0 < self.renew_interval < self.lease_timeout:
            raise ValueError(f"renew_interval must be in (0, lease_timeout="
                             f"{self.lease_timeout}), got {self.renew_interval}")
        if self.heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat_timeout must be > 0 s, got {self.heartbeat_timeout}")
        if self.claim_interval is None:
            self.claim_interval = self.heartbeat_interval
        if self.claim_interval <= 0:
            raise ValueError(f"claim_interval must be > 0 s, got {self.claim_interval}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 s, got {self.drain_timeout}")
        if self.max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {self.max_deliveries}")
        if self.result_ttl < 1 or self.result_maxlen < 1:
            raise ValueError("result_ttl and result_maxlen must be >= 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.affinity_steal_delay < 0:
            raise ValueError(f"affinity_steal_delay must be >= 0 s, got "
                             f"{self.affinity_steal_delay}")
        if self.affinity_min_tokens < 1:
            raise ValueError(f"affinity_min_tokens must be >= 1, got {self.affinity_min_tokens}")
        if self.read_block_ms < 1:
            raise ValueError(f"read_block_ms must be >= 1, got {self.read_block_ms}")
        if not 0 <= self.interactive_headroom < 1:
            raise ValueError(f"interactive_headroom must be in [0, 1), got "
                             f"{self.interactive_headroom}")
        parse_weights(self.tenant_weights)  # ValueError naming the bad item

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats: five fit in the timeout, so a live worker's heartbeat
        never lapses on one slow beat."""
        return self.heartbeat_timeout / 5

    @property
    def takeover_bound(self) -> float:
        """The longest a SIGKILLed worker's requests wait before a peer takes them: its last
        beat's TTL runs out `heartbeat_timeout` after it, a peer's scan comes within
        `claim_interval`, and one more scan if the lease was renewed after that last beat."""
        assert self.claim_interval is not None
        return self.heartbeat_timeout + self.heartbeat_interval + 2 * self.claim_interval
