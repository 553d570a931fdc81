"""A thousand at once: streaming requests through one `llmq serve`, and `llmq bench -c 1000`.

The tiny model and 3-token answers keep this to seconds of engine time: what is under test is the
gateway and the clients, which must answer every request on a bounded number of connections.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from llmq.gateway.app import CLIENT_NAME
from tests.e2e.cli_harness import llmq, ok, serve
from tests.e2e.gateway_harness import GatewayProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

N = 1000


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory
         ) -> Iterator[tuple[GatewayProcess, str]]:
    logs = tmp_path_factory.mktemp("gateway-load")
    worker = serve(valkey_server.url, tiny_model_path, logs, "gw-load-w1")
    gateway = GatewayProcess(valkey_server.url, logs)
    try:
        yield gateway.start(), valkey_server.url
    finally:
        gateway.stop()
        worker.stop()


class ConnectionWatch:
    """The most connections the gateway held at once, sampled from CLIENT LIST meanwhile."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            held = sum(1 for c in self.redis.client_list() if c.get("name") == CLIENT_NAME)
            self.most = max(self.most, held)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.redis.close()


def test_a_thousand_concurrent_streams_through_one_gateway(pool) -> None:
    gateway, url = pool

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model="tiny-llama.gguf", prompt=f"Request {i}", max_tokens=3, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, tokens = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    async def scenario() -> list[tuple[str, int] | BaseException]:
        async with gateway.async_openai(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(N)),
                                        return_exceptions=True)

    # When a thousand clients stream at once
    with ConnectionWatch(url) as watch:
        results = asyncio.run(scenario())
    # Then every one got its whole answer
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == [], failures[:3]
    assert all(tokens == 3 and text for text, tokens in results)
    # And the gateway held a bounded number of Redis connections, not one per stream
    assert 0 < watch.most <= 64 + 8 + 4, watch.most


def test_llmq_bench_with_a_thousand_in_flight(pool) -> None:
    _, url = pool
    result = ok(llmq("bench", "-n", str(N), "-c", str(N), "--prompt-len", "4",
                     "--output-len", "2", "--json", url=url))
    figures = json.loads(result.stdout)
    assert figures["completed"] == N and figures["failed"] == 0 and figures["errors"] == []
