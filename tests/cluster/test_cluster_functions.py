"""The function library on a Redis Cluster: `llmq admin load-functions` loads it on every primary,
and `--check` names a primary that lacks it (valkey 8.1 and redis-server 7.0)."""

from __future__ import annotations

import contextlib

import pytest
from click.testing import CliRunner

from llmq.broker.functions import LIBRARY_VERSION, library_versions
from llmq.cli.main import cli
from tests.fixtures.redis_cluster import ClusterServers
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow]


def test_load_functions_puts_the_library_on_every_primary(cluster: ClusterServers):
    runner = CliRunner()
    rc = cluster.client()
    try:
        # Given a cluster none of whose primaries has the library (the fixture flushed them)
        assert [s.found for s in library_versions(rc)] == [0, 0, 0]
        # When the admin command runs with the cluster URL
        loaded = runner.invoke(cli, ["admin", "load-functions", "--redis-url", cluster.url])
        # Then every primary got it, one line each
        assert loaded.exit_code == 0, loaded.output
        assert loaded.output.count(f"loaded library 'llmq' version {LIBRARY_VERSION}") == 3
        assert [s.found for s in library_versions(rc)] == [LIBRARY_VERSION] * 3
        # And every replica, by replication (what a failover promotes keeps it)
        for node in cluster.live_nodes():
            with contextlib.closing(cluster.node_client(node)) as r:
                wait_for(lambda r=r: r.function_list(library="llmq"), 30,
                         f"the library on node {node.port}")
        # When one primary loses it (a new primary would lack it too)
        (first, *_) = cluster.masters()
        with contextlib.closing(cluster.node_client(first)) as r:
            r.function_flush()
        # Then `--check` names that primary and fails, and loading again fixes only it
        checked = runner.invoke(cli, ["admin", "load-functions", "--check",
                                      "--redis-url", cluster.url])
        assert checked.exit_code == 1
        assert f"on 127.0.0.1:{first.port} is missing" in checked.output
        again = runner.invoke(cli, ["admin", "load-functions", "--redis-url", cluster.url])
        assert again.exit_code == 0, again.output
        assert again.output.count("loaded library") == 1
    finally:
        rc.close()
