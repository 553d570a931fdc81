"""What the tenant tests share: acme and bob, users made from `llmq acl tenant`, and their keys."""

from __future__ import annotations

import pytest
import redis
from click.testing import CliRunner

from llmq.broker.functions import ensure_functions
from llmq.cli.main import cli
from tests.fixtures.acl_server import PASSWORDS
from tests.integration.worker_harness import KEYS

TENANTS = {"acme": "acme-password", "bob": "bob-password"}


@pytest.fixture
def tenants(acl_server):
    """acme and bob as users made from `llmq acl tenant`'s output; yields the port."""
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    ensure_functions(admin)  # as the first worker would, before anyone submits
    for name, password in TENANTS.items():
        result = CliRunner().invoke(cli, ["acl", "tenant", name, "--password", password])
        assert result.exit_code == 0, result.output
        rule = result.stdout.strip().split()
        assert rule[:2] == ["user", name]
        admin.execute_command("ACL", "SETUSER", *rule[1:])
    try:
        yield port
    finally:
        admin.flushall()
        for name in TENANTS:
            admin.execute_command("ACL", "DELUSER", name)
        admin.close()


def url(port: int, tenant: str) -> str:
    return f"redis://{tenant}:{TENANTS[tenant]}@127.0.0.1:{port}/0"


Q, CANCEL, SUB = KEYS.queue("default"), KEYS.cancel("default"), KEYS.submissions("default")
LANES = KEYS.lanes("default")
OWN_LANE = {"stream": KEYS.lane_stream("default", "batch:acme"),
            "records": KEYS.lane_submissions("default", "batch:acme")}
