"""StreamOptions: how the gateway streams a request, kept so any replica can resume it.

    <prefix>:sse:{<request_id>}   hash   endpoint, usage chunk, keep on disconnect...; TTL

In the request's slot, beside its result stream, and kept as long as the results are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys
from llmq.protocol import as_str

__all__ = ["StreamOptions"]


class StreamOptions:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def remember(self, request_id: str, options: Mapping[str, Any], ttl: int
                 ) -> Exchange[None]:
        key = self.keys.stream_options(request_id)

        def queue(pipe: Any) -> None:
            pipe.hset(key, mapping=dict(options))
            pipe.expire(key, ttl)

        return Exchange(queue, lambda _: None)

    def read(self, request_id: str) -> Exchange[dict[str, str] | None]:
        """The options `remember` kept; None when there are none (expired, or never made)."""
        def parse(replies: list[Any]) -> dict[str, str] | None:
            raw = replies[0]
            return {as_str(k): as_str(v) for k, v in raw.items()} if raw else None

        return Exchange(lambda pipe: pipe.hgetall(self.keys.stream_options(request_id)), parse)
