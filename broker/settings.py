"""BrokerSettings: where the broker is and how its keys live, checked once at construction.

Shared by the producer client, the worker and the CLI; every field has an `LLMQ_*` environment
variable (the names the deployment files use too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from llmq.broker.keys import DEFAULT_PREFIX, DEFAULT_QUEUE, Keys, validate_name

__all__ = ["DEFAULT_RESULT_MAXLEN", "DEFAULT_RESULT_TTL", "ENV_VARS", "BrokerSettings"]

DEFAULT_RESULT_TTL = 24 * 3600  # seconds a result stream lives after its last event
# NOTE: roughly one event per output token, so 10k keeps whole answers of any realistic length;
# `done` carries the full text anyway, so a trimmed stream only costs late readers the deltas.
DEFAULT_RESULT_MAXLEN = 10_000

ENV_VARS = {
    "redis_url": "LLMQ_REDIS_URL",
    "prefix": "LLMQ_PREFIX",
    "queue": "LLMQ_QUEUE",
    "result_ttl": "LLMQ_RESULT_TTL",
    "result_maxlen": "LLMQ_RESULT_MAXLEN",
}


@dataclass(frozen=True)
class BrokerSettings:
    redis_url: str | None = None  # None: `resolve_redis_url()` decides (embedded server)
    prefix: str = DEFAULT_PREFIX
    queue: str = DEFAULT_QUEUE
    result_ttl: int = DEFAULT_RESULT_TTL  # seconds; EXPIRE of a result stream after each write
    result_maxlen: int = DEFAULT_RESULT_MAXLEN  # approximate MAXLEN of a result stream

    def __post_init__(self) -> None:
        Keys(self.prefix)  # raises InvalidName with the rule
        validate_name("queue", self.queue)
        if self.result_ttl < 1:
            raise ValueError(f"result_ttl must be >= 1 second, got {self.result_ttl}")
        if self.result_maxlen < 1:
            raise ValueError(f"result_maxlen must be >= 1, got {self.result_maxlen}")

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BrokerSettings:
        """Settings from `LLMQ_*` variables; keyword overrides that are not None win."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_VARS[f.name], "").strip()
            if not raw:
                continue
            if f.name in ("result_ttl", "result_maxlen"):
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ValueError(
                        f"{ENV_VARS[f.name]} must be an integer, got {raw!r}") from None
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
