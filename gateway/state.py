"""GatewayState: what every route of one gateway process shares (settings, clients, pool view,
the dashboard's series).

Nothing here outlives a restart: the only state that matters is in Redis (requests, their
results, the stream options of each request, files, batches), so replicas are interchangeable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.aio import AsyncClient
from llmq.broker.commands import as_str
from llmq.gateway.batch_store import rq_connection
from llmq.gateway.errors import APIError
from llmq.gateway.metrics import GatewayMetrics
from llmq.gateway.pool_series import PoolSeries
from llmq.gateway.pool_view import PoolView
from llmq.gateway.settings import GatewaySettings
from llmq.protocol.errors import LLMQError

__all__ = ["GatewayState", "json_response"]

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(_json.encode(payload), status, headers, media_type="application/json")


@dataclass
class GatewayState:
    settings: GatewaySettings
    client: AsyncClient
    pool: PoolView
    sync_redis: redis.Redis  # llmq's, for batches (files, results), used from worker threads
    series: PoolSeries  # the dashboard's charts
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    _rq_redis: redis.Redis | None = None
    # True once the server is stopping: streams it ends then were not left by their clients,
    # so their requests keep running (to be resumed on another replica), not cancelled.
    shutting_down: Callable[[], bool] = lambda: False

    @classmethod
    def of(cls, request: Request) -> GatewayState:
        return request.app.state.gateway

    @property
    def rq_redis(self) -> redis.Redis:
        """rq's Redis (`rq_connection`): llmq's own unless it is a cluster."""
        if self._rq_redis is None:
            self._rq_redis = rq_connection(self.sync_redis)
        return self._rq_redis

    @property
    def keys(self) -> Any:
        return self.client.keys

    def tenant(self, request: Request) -> str:
        """The caller's tenant; APIError 401 without a valid key."""
        tenant = self.settings.api_keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            raise APIError(401, "missing or unknown API key: send `Authorization: Bearer <key>`",
                           "invalid_request_error", code="invalid_api_key")
        return tenant

    async def cancel(self, request_id: str, queue: str) -> None:
        """Cancel a request on one queue; a failure is logged, not raised."""
        try:
            await self.client.cancel(request_id, queue=queue)
        except LLMQError as exc:
            logger.warning("could not cancel request %s: %s", request_id, exc)

    async def cancel_everywhere(self, request_id: str) -> None:
        """Cancel a request on every queue (a request id alone does not say which it is on)."""
        for queue in await self.queues():
            await self.cancel(request_id, queue)

    async def queues(self) -> list[str]:
        """The pool's queues (the configured one before any has a consumer group)."""
        return await self.client.queues() or [self.settings.broker.queue]

    async def remember_stream(self, request_id: str, options: dict[str, Any]) -> None:
        """How to stream the request, for a resume on any replica (kept as long as results)."""
        key = self.keys.stream_options(request_id)
        ttl = self.settings.broker.result_ttl

        async def write() -> None:
            pipe = self.client.redis.pipeline(transaction=False)
            pipe.hset(key, mapping=options)
            pipe.expire(key, ttl)
            await pipe.execute()

        await self.client.call(write)

    async def stream_options(self, request_id: str) -> dict[str, str] | None:
        """The options `remember_stream` kept; None for a request this tenant never made."""
        raw = await self.client.call(lambda: self.client.redis.hgetall(
            self.keys.stream_options(request_id)))
        return {as_str(k): as_str(v) for k, v in raw.items()} if raw else None
