"""Fixtures the CLI tests share: one valkey-server and one tiny-model `llmq worker` per module.

A module tunes its worker with a module-level `SERVE` dict of `serve()`'s keyword arguments
(worker_id, queue, fault, max_num_seqs); each test uses its own request ids, so nothing is
flushed between tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from tests.e2e.cli_harness import serve
from tests.e2e.gateway_harness import GatewayProcess


@pytest.fixture(scope="module")
def url(request: pytest.FixtureRequest, valkey_server, tiny_model_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL, with the module's worker serving (ready) until the module ends."""
    options = dict(getattr(request.module, "SERVE", {}))
    worker_id = options.pop("worker_id", request.module.__name__.rpartition(".")[2])
    worker = serve(valkey_server.url, tiny_model_path, tmp_path_factory.mktemp("logs"),
                   worker_id, **options)
    yield valkey_server.url
    worker.stop()


@pytest.fixture
def r(url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client of the module's server (bytes replies)."""
    client = redis.Redis.from_url(url)
    yield client
    client.close()


# NOTE: for the gateway modules, each of which defines its own `pool` (a GatewayProcess in front
# of its workers); these two follow whichever `pool` the requesting module has.
@pytest.fixture(scope="module")
def client(pool: GatewayProcess) -> openai.OpenAI:
    """The official SDK on the module's gateway."""
    return pool.openai()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The model the module's pool serves, as /v1/models names it."""
    return client.models.list().data[0].id
