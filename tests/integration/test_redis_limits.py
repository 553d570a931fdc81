"""deploy/redis.conf's cap on one command argument, and llmq's large writes within it.

The server runs deploy/redis.conf + deploy/acl.conf (tests/fixtures/acl_server.py) on both
server kinds; llmq's clients log in as the `gateway` user, as `llmq serve` and
`llmq batch-worker` do.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.broker.file_store import FileStore
from llmq.broker.pieced_bytes import PIECE_BYTES
from tests.fixtures.acl_server import PASSWORDS, acl_url

pytestmark = pytest.mark.redis

MAX_BULK = 16 << 20  # deploy/redis.conf's proto-max-bulk-len


@pytest.fixture
def gateway_client(acl_server) -> Iterator[Client]:
    port, _ = acl_server
    client = Client(acl_url(port, "gateway"))
    try:
        yield client
    finally:
        client.close()
        admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
        admin.flushall()
        admin.close()


def test_one_argument_past_the_cap_is_refused(acl_server) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    try:
        # Given the server runs deploy/redis.conf
        assert int(admin.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == MAX_BULK
        # When a client sends one argument past it, Then the server refuses it unread
        with pytest.raises((redis.ConnectionError, redis.ResponseError)):
            admin.set("llmq:big", b"x" * (MAX_BULK + 1))
        # And serves the next command
        admin.connection_pool.disconnect()
        assert admin.ping() and not admin.exists("llmq:big")
    finally:
        admin.close()


def test_files_and_batch_inputs_larger_than_the_cap_are_stored_whole(
        gateway_client: Client) -> None:
    # Given a file larger than one argument may be (as --max-file-bytes allows)
    data = bytes(range(256)) * ((MAX_BULK + PIECE_BYTES) // 256)
    assert len(data) > MAX_BULK
    files = FileStore(gateway_client.keys, "alice")
    # When the gateway stores it as an upload, Then it reads back byte for byte
    send(gateway_client, files.create("file-1", data, {"id": "file-1"}, 60, 1))
    assert send(gateway_client, files.content({"id": "file-1"})) == data
    send(gateway_client, files.delete("file-1"))
    # And so does a batch input
    records = BatchRecords(gateway_client.keys)
    send(gateway_client, records.store_input("b1", data, 60))
    assert send(gateway_client, records.input(gateway_client.keys.batch_input("b1"))) == data


def test_the_batch_checkpoint_works_as_the_gateway_user(gateway_client: Client) -> None:
    records = BatchRecords(gateway_client.keys)
    # Given a batch run that checkpoints lines as they finish, under its lease
    send(gateway_client, records.hold_lease("b1", "run-1", 15_000))
    saved = {i: b"o" + f'{{"custom_id": "c{i}"}}'.encode() for i in range(1200)}
    send(gateway_client, records.save_lines("b1", dict(list(saved.items())[:700]), 60))
    send(gateway_client, records.save_lines("b1", dict(list(saved.items())[500:]), 60))
    # Then a later run reads every line once, by its index
    found: dict[int, bytes] = {}
    cursor = 0
    while True:
        cursor, page = send(gateway_client, records.saved_lines("b1", cursor))
        found.update(page)
        if cursor == 0:
            break
    assert found == saved
    # And the lease says who runs it until released
    assert send(gateway_client, records.lease_holder("b1")) == "run-1"
    send(gateway_client, records.release_lease("b1"))
    assert send(gateway_client, records.lease_holder("b1")) is None


def test_a_file_stored_whole_before_the_pieces_still_reads(acl_server,
                                                          gateway_client: Client) -> None:
    # Given a file an older gateway stored as one string
    admin = redis.Redis(port=acl_server[0], username="admin", password=PASSWORDS["admin"])
    admin.set(gateway_client.keys.file("alice", "old-1"), b"line\n")
    admin.close()
    files = FileStore(gateway_client.keys, "alice")
    # Then it reads as it was, and a missing one is None
    assert send(gateway_client, files.content({"id": "old-1"})) == b"line\n"
    assert send(gateway_client, files.content({"id": "gone"})) is None
