"""GatewaySettings: what `llmq serve` is configured with, checked once at construction.

Every field is a flag of `llmq serve` with an `LLMQ_*` environment variable (cli/serve.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.broker.settings import BrokerSettings
from llmq.gateway.api_keys import ApiKeys

__all__ = ["GatewaySettings"]

_DAY = 24 * 3600


@dataclass(frozen=True)
class GatewaySettings:
    api_keys: ApiKeys
    broker: BrokerSettings = field(default_factory=BrokerSettings.from_env)
    max_queue: int = 10_000  # unread requests in a queue above which new ones get 429
    request_timeout: float = 600.0  # seconds a request may take before the gateway gives up
    max_file_bytes: int = 64 << 20  # largest file `POST /v1/files` accepts
    # NOTE: a request's payload is at most 1 MiB on the wire (msgpack); its JSON, with escapes
    # and token id arrays, can be a few times that.
    max_body_bytes: int = 4 << 20  # largest request body any other route reads
    file_ttl: int = 7 * _DAY  # seconds uploaded files, batches and their results are kept
    batch_max_in_flight: int = 1024  # unfinished requests one batch keeps queued at a time
    max_connections: int = 64  # Redis connections for calls (the result reader adds its own)
    dashboard_interval: float = 10.0  # seconds between the dashboard's chart samples
    disconnect_grace: float = 30.0  # seconds a dropped stream waits for a resume, then cancels
    metrics_require_key: bool = False  # /metrics answers without a key unless set

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_file_bytes", "max_body_bytes", "file_ttl",
                     "batch_max_in_flight", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.disconnect_grace < 0:
            raise ValueError(f"disconnect_grace must be >= 0, got {self.disconnect_grace}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if not 1.0 <= self.dashboard_interval <= 300.0:
            raise ValueError(f"dashboard_interval must be within 1-300 s, got "
                             f"{self.dashboard_interval}")
