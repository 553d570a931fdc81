"""PoolView: what the gateway knows of the pool, read from Redis and kept for a second.

Workers' heartbeats say which models are served and on which queues; a request is routed to a
queue whose live workers serve the model it names (the configured queue first). A LoRA adapter
in a worker's adapter directory (heartbeat `loras_available`) is served as a model of its own,
as vLLM serves adapters: `model: "<adapter>"` routes to that worker's queue, and the worker runs
the request under the adapter (worker/engine/input_processor.py). Before it is
queued the gateway answers:

    503  no live worker at all (nothing would ever answer)
    404  no live worker serves the model named
    429  the queue holds more unread requests than `max_queue` (with Retry-After)

Every replica reads the same heartbeats and queue lag, so they all answer alike; a negative
answer from a view older than a moment is checked against a fresh read first. `refresh_forever()`
keeps the view fresh in the background, so a request's path has no Redis reads for routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from llmq.broker.aio import AsyncClient
from llmq.gateway.errors import APIError
from llmq.protocol import WorkerHeartbeat
from llmq.protocol.errors import LLMQError

__all__ = ["PoolView", "ServedModel", "names_model"]

logger = logging.getLogger(__name__)

_TTL = 1.0  # seconds a view of the workers or of a queue's lag is used
_RECHECK_AFTER = 0.2  # a negative answer from a view older than this is read again
_RETRY_AFTER_S = 2


def adapters_of(worker: WorkerHeartbeat) -> list[str]:
    """The LoRA adapters the worker's heartbeat lists as available."""
    return [name for name in worker.loras_available.split(",") if name]


def names_model(wanted: str | None, served: str) -> bool:
    """Whether a request's `model` names the model a worker serves, the one rule for every
    endpoint (chat, completions, responses, batch lines, GET /v1/models/{id}).

    As vLLM does, an absent or empty `model` means whatever the queue serves; otherwise it must
    be a served name, the `id` /v1/models lists (the worker's heartbeat `model`), compared
    without case so `smollm2-135m-instruct` finds `SmolLM2-135M-Instruct`.
    """
    return not wanted or wanted.lower() == served.lower()


@dataclass(frozen=True)
class ServedModel:
    name: str
    queues: tuple[str, ...]
    created: int  # unix s: when the oldest worker serving it started
    parent: str | None = None  # a LoRA adapter: the base model it runs on


class PoolView:
    def __init__(self, client: AsyncClient, default_queue: str, max_queue: int) -> None:
        self.client = client
        self.default_queue = default_queue
        self.max_queue = max_queue
        self._workers: list[WorkerHeartbeat] = []
        self._workers_at = -1e9
        self._lag: dict[str, tuple[float, int]] = {}
        self._lock = asyncio.Lock()

    async def refresh_forever(self, interval: float = _TTL / 2) -> None:
        """Re-read the workers and the lag of the queues routed to, every `interval` s."""
        while True:
            try:
                await self.workers(max_age=0)
                for queue in list(self._lag):
                    await self._queue_lag(queue, max_age=0)
            except LLMQError as exc:  # the request path reads again and reports it
                logger.debug("refreshing the pool view failed: %s", exc)
            await asyncio.sleep(interval)

    async def workers(self, *, max_age: float = _TTL) -> list[WorkerHeartbeat]:
        if time.monotonic() - self._workers_at > max_age:
            async with self._lock:  # one read for every request that finds the view stale
                if time.monotonic() - self._workers_at > max_age:
                    self._workers = await self.client.workers()
                    self._workers_at = time.monotonic()
        return self._workers

    async def models(self) -> list[ServedModel]:
        """The base models, then the LoRA adapters (with their base model as `parent`)."""
        served: dict[tuple[str, str | None], tuple[set[str], int]] = {}
        for worker in await self.workers():
            if not worker.model:
                continue
            for key in [(worker.model, None)] + [(a, worker.model) for a in adapters_of(worker)]:
                queues, created = served.get(key, (set(), worker.started_ms))
                queues.add(worker.queue)
                served[key] = (queues, min(created, worker.started_ms))
        return [ServedModel(name, tuple(sorted(queues)), created // 1000, parent)
                for (name, parent), (queues, created)
                in sorted(served.items(), key=lambda item: (item[0][1] is not None, item[0]))]

    async def route(self, model: str | None) -> str:
        """The queue for a request naming `model` (None: any); APIError 503/404/429 if none."""
        queue = self._pick(await self.workers(), model)
        if queue is None:
            queue = self._pick(await self.workers(max_age=_RECHECK_AFTER), model)
        if queue is None:
            if not self._workers:
                raise APIError(503, "no worker is serving: start one (`llmq worker`, or "
                               "`llmq up`)", "server_error", code="no_workers",
                               headers={"Retry-After": str(_RETRY_AFTER_S)})
            served = ", ".join(m.name for m in await self.models()) or "none"
            raise APIError(404, f"the model `{model}` does not exist or no worker serves it "
                           f"(served: {served})", "invalid_request_error",
                           param="model", code="model_not_found")
        lag = await self._queue_lag(queue)
        if lag > self.max_queue:
            raise APIError(429, f"queue {queue!r} has {lag} requests waiting, more than the "
                           f"gateway's --max-queue {self.max_queue}: retry later",
                           "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(_RETRY_AFTER_S)})
        return queue

    def _pick(self, workers: list[WorkerHeartbeat], model: str | None) -> str | None:
        queues = {w.queue for w in workers
                  if names_model(model, w.model) or model in adapters_of(w)}
        if not queues:
            return None
        return self.default_queue if self.default_queue in queues else sorted(queues)[0]

    async def _queue_lag(self, queue: str, *, max_age: float = _TTL) -> int:
        seen = self._lag.get(queue)
        if seen is None or time.monotonic() - seen[0] > max_age:
            stats = await self.client.stats(queue)
            lag = stats.lag if stats.lag is not None else stats.length - stats.pending
            self._lag[queue] = seen = (time.monotonic(), lag)
        return seen[1]
