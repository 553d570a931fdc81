"""Clients that follow thousands of requests on a few connections, through Redis failures.

No worker here: the tests write the events a worker would, with the broker's own encoders, and
count the client's connections in CLIENT LIST (named with `client_name`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis

from llmq.broker import AsyncClient, Client
from llmq.broker.commands import queue_event
from llmq.broker.keys import Keys
from llmq.protocol import Delta, Done, Event, Start, Timings, Usage
from llmq.protocol.errors import ResultTimeout

pytestmark = pytest.mark.redis

KEYS = Keys()


def events_of(request_id: str, words: list[str]) -> list[Event]:
    out: list[Event] = [Start(request_id=request_id, attempt=1, worker="w", prompt_tokens=1)]
    out += [Delta(request_id=request_id, attempt=1, seq=i, text=w, token_ids=[i])
            for i, w in enumerate(words)]
    out.append(Done(request_id=request_id, attempt=1, finish_reason="stop", text="".join(words),
                    usage=Usage(1, len(words)), timings=Timings(0.0, 0.0, 0.0, None)))
    return out


def write(r: redis.Redis, events: list[Event]) -> None:
    pipe = r.pipeline(transaction=False)
    for event in events:
        queue_event(pipe, KEYS, event, "json", result_ttl=60, result_maxlen=1000)
    pipe.execute()


def connections(r: redis.Redis, name: str) -> int:
    return sum(1 for c in r.client_list() if c.get("name") == name)


def test_a_thousand_async_followers_share_a_handful_of_connections(
        redis_server: Any, redis_client: redis.Redis) -> None:
    ids = [f"many-{i}" for i in range(1000)]
    seen: list[int] = []

    async def scenario() -> list[str]:
        async with AsyncClient(redis_server.url, client_name="many") as client:
            async def follow(request_id: str) -> str:
                return "".join([e.text async for e in client.events(request_id, timeout=60)
                                if isinstance(e, Delta)])

            # Given a thousand followers waiting for requests nobody has answered yet
            tasks = [asyncio.create_task(follow(i)) for i in ids]
            await asyncio.sleep(0.5)
            seen.append(connections(redis_client, "many"))
            # When every request is answered
            for start in range(0, len(ids), 100):
                await asyncio.to_thread(write, redis_client, [
                    e for i in ids[start:start + 100] for e in events_of(i, ["a", i])])
            texts = await asyncio.gather(*tasks)
            seen.append(connections(redis_client, "many"))
            return texts

    texts = asyncio.run(scenario())
    # Then every follower got its whole answer
    assert texts == [f"a{i}" for i in ids]
    # And the client held a handful of connections throughout, not one per follower
    assert max(seen) <= 4, seen


def test_threads_following_with_one_sync_client_share_its_reader(
        redis_server: Any, redis_client: redis.Redis) -> None:
    ids = [f"thread-{i}" for i in range(200)]
    results: dict[str, str] = {}
    with Client(redis_server.url, client_name="threads") as client:
        def follow(request_id: str) -> None:
            results[request_id] = client.result(request_id, timeout=60).text

        threads = [threading.Thread(target=follow, args=(i,)) for i in ids]
        for thread in threads:
            thread.start()
        write(redis_client, [e for i in ids for e in events_of(i, [i, "!"])])
        for thread in threads:
            thread.join(60)
        assert connections(redis_client, "threads") <= 4
    assert results == {i: f"{i}!" for i in ids}


def test_a_stream_followed_while_the_reader_waits_is_picked_up_at_once(
        redis_server: Any, redis_client: redis.Redis) -> None:
    async def scenario() -> str:
        async with AsyncClient(redis_server.url) as client:
            # Given a reader blocked on a request that stays silent
            silent = asyncio.create_task(client.result("silent", timeout=30))
            await asyncio.sleep(0.3)
            # When another request is followed and answered
            write(redis_client, events_of("late", ["on", " time"]))
            # Then its answer arrives within a timeout well under the reader's 5 s read
            done = await client.result("late", timeout=2)
            silent.cancel()
            return done.text

    assert asyncio.run(scenario()) == "on time"


def test_followers_survive_their_connections_being_killed(
        redis_server: Any, redis_client: redis.Redis) -> None:
    async def scenario() -> list[str]:
        async with AsyncClient(redis_server.url, client_name="victim") as client:
            tasks = [asyncio.create_task(client.result(f"kill-{i}", timeout=30))
                     for i in range(20)]
            write(redis_client, [events_of(f"kill-{i}", ["x"])[0] for i in range(20)])
            await asyncio.sleep(0.3)
            # When every connection of the client is killed mid-follow
            killed = redis_client.client_kill_filter(_type="normal", skipme=True)
            assert killed >= 1
            # Then the followers resume from where they were and finish
            write(redis_client, [e for i in range(20) for e in events_of(f"kill-{i}", ["x"])[1:]])
            return [d.text for d in await asyncio.gather(*tasks)]

    assert asyncio.run(scenario()) == ["x"] * 20


def test_followers_and_submits_survive_a_server_restart(
        redis_server: Any, redis_client: redis.Redis) -> None:
    with Client(redis_server.url) as client:
        client.submit("before", request_id="restart-1")
        result: dict[str, Any] = {}

        def follow() -> None:
            try:
                result["text"] = client.result("restart-1", timeout=60).text
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        write(redis_client, events_of("restart-1", ["a"])[:2])
        thread = threading.Thread(target=follow)
        thread.start()
        # When the server restarts (the AOF keeps the stream) under a follower
        redis_server.restart()
        # Then the client submits again and the follower finishes, no error surfaced
        assert client.submit("after", request_id="restart-2") == "restart-2"
        r = redis.Redis.from_url(redis_server.url)
        write(r, events_of("restart-1", ["a"])[2:])
        r.close()
        thread.join(60)
    assert result == {"text": "a"}


def test_a_timeout_still_ends_a_follower_while_the_server_is_gone(
        redis_server: Any, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            await client.ping()
            redis_server.stop()
            try:
                with pytest.raises(ResultTimeout):
                    await client.result("never", timeout=1.0)
            finally:
                redis_server.restart()

    asyncio.run(scenario())
