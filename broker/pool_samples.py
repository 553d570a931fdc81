"""PoolSamples: the dashboard's chart samples in one capped Redis stream, as exchanges.

    <prefix>:dash:series   stream   one PoolSample per interval, JSON in field `json`, entry id
                                    `<interval start in ms>-0`, capped (MAXLEN ~) to the window

Redis refuses an entry id at or below the stream's last one, so of the gateway replicas that
offer a sample for one interval exactly one lands: no lock, no leader (gateway/pool_series.py
computes the samples).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import redis

from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys

__all__ = ["PoolSample", "PoolSamples"]

logger = logging.getLogger(__name__)


class PoolSample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One point of every chart; stored as JSON in the `json` field of a series entry."""

    t: int  # unix ms: the start of the interval
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    lag: int = 0  # unread requests over every queue
    ttft_p50_ms: float | None = None  # None: no request finished within the last minute
    ttft_p95_ms: float | None = None  # (TTFT after admission: first scheduled to first token)
    queue_p50_ms: float | None = None  # arrival in the stream to first scheduled
    queue_p95_ms: float | None = None
    itl_p50_ms: float | None = None  # mean gap between tokens
    itl_p95_ms: float | None = None
    e2e_p50_ms: float | None = None  # arrival in the stream to the terminal event
    e2e_p95_ms: float | None = None
    kv_usage: float | None = None  # mean fraction of KV blocks in use over live workers
    kv_usage_max: float | None = None
    preemptions_per_s: float = 0.0


_sample_decoder = msgspec.json.Decoder(PoolSample)
_json = msgspec.json.Encoder()


class PoolSamples:
    """`maxlen`: the samples the stream keeps (about)."""

    def __init__(self, keys: Keys, maxlen: int) -> None:
        self.key = keys.dashboard_series()
        self.maxlen = maxlen

    def offer(self, sample: PoolSample) -> Exchange[bool]:
        """Add the sample under its interval's id; False when another replica was first."""
        def parse(replies: list[Any]) -> bool:
            (reply,) = replies
            if isinstance(reply, redis.ResponseError):
                if "equal or smaller" in str(reply):
                    return False
                raise reply
            if isinstance(reply, Exception):
                raise reply
            return True

        return Exchange(lambda pipe: pipe.xadd(self.key, {"json": _json.encode(sample)},
                                               id=f"{sample.t}-0", maxlen=self.maxlen,
                                               approximate=True),
                        parse, raise_on_error=False)

    def since(self, start_ms: int) -> Exchange[list[PoolSample]]:
        """The samples from `start_ms` on, oldest first (unreadable ones skipped)."""
        def parse(replies: list[Any]) -> list[PoolSample]:
            samples = []
            for _, fields in replies[0]:
                try:
                    samples.append(_sample_decoder.decode(fields.get(b"json")))
                except (msgspec.DecodeError, TypeError):
                    logger.warning("skipping an unreadable dashboard sample in %s", self.key)
            return samples

        return Exchange(lambda pipe: pipe.xrange(self.key, f"{start_ms}-0"), parse)
