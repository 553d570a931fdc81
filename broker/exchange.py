"""Exchange: one round trip to Redis described without IO, sent by either client.

An exchange is the commands queued on a pipeline and how their replies are read, the pattern of
`llmq.broker.commands`, packed into one value so that a store (files, batch records, dead
letters, the dashboard's samples...) describes each of its operations once and both the sync
`Client` and the `AsyncClient` send it, with their retries and error translation:

    exchange = FileStore(keys, tenant).meta(file_id)   # no IO yet
    meta = await send_async(client, exchange)          # or send(sync_client, exchange)

Only modules of llmq.broker talk to Redis (docs/architecture.md); the gateway and the CLI build
exchanges with the broker's stores and send them with these two functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from llmq.broker.aio import AsyncClient
    from llmq.broker.client import Client

__all__ = ["Exchange", "send", "send_async"]

T = TypeVar("T")


@dataclass(frozen=True)
class Exchange(Generic[T]):
    """Commands for one pipeline and the reading of their replies.

    queue:  queues the commands on a (sync or asyncio) redis-py pipeline; never awaits.
    parse:  the replies, in order, -> the answer (raises for a reply it cannot accept).
    transaction: MULTI/EXEC around the commands: all of them or none.
    raise_on_error: False hands a failed command's error to `parse` as its reply.
    """

    queue: Callable[[Any], None]
    parse: Callable[[list[Any]], T]
    transaction: bool = False
    raise_on_error: bool = True


def send(client: Client, exchange: Exchange[T]) -> T:
    """The exchange's answer, sent through `client.call` (retried, errors translated)."""
    def once() -> T:
        pipe = client.redis.pipeline(transaction=exchange.transaction)
        exchange.queue(pipe)
        return exchange.parse(pipe.execute(raise_on_error=exchange.raise_on_error))

    return client.call(once)


async def send_async(client: AsyncClient, exchange: Exchange[T]) -> T:
    """`send` on the asyncio client."""
    async def once() -> T:
        pipe = client.redis.pipeline(transaction=exchange.transaction)
        exchange.queue(pipe)
        return exchange.parse(await pipe.execute(raise_on_error=exchange.raise_on_error))

    return await client.call(once)
