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
from llmq.broker.client import Client
from llmq.broker.exchange import send_async
from llmq.broker.keys import Keys
from llmq.broker.stream_options import StreamOptions
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
    _sync_client: Client | None = None
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
    def sync_client(self) -> Client:
        """A sync Client on `sync_redis`, for batches' records (from worker threads)."""
        if self._sync_client is None:
            self._sync_client = Client(connection=self.sync_redis,
                                       settings=self.settings.broker)
        return self._sync_client

    @property
    def keys(self) -> Keys:
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
        await send_async(self.client, StreamOptions(self.keys).remember(
            request_id, options, self.settings.broker.result_ttl))

    async def stream_options(self, request_id: str) -> dict[str, str] | None:
        """The options `remember_stream` kept; None for a request this tenant never made."""
        return await send_async(self.client, StreamOptions(self.keys).read(request_id))
