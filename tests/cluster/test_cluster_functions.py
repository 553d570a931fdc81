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


def test_a_tenants_lane_entry_is_handed_over_and_taken_on_a_cluster(cluster: ClusterServers):
    """The hand-over functions' keys (a tenant's lane stream, a worker's tickets and summary,
    the hand-back counts) all hash to the queue's slot: one FCALL each, on its primary."""
    from llmq.broker import Client
    from llmq.broker.affinity_handover import AffinityHandover
    from llmq.broker.functions import ensure_functions
    from llmq.broker.keys import GROUP, Keys
    from llmq.broker.work_lanes import BATCH, work_lane

    keys = Keys()
    lane = work_lane(keys, "default", BATCH, "acme")
    rc = cluster.client()
    try:
        ensure_functions(rc)
        # Given tenant acme's batch request, read by wb, and wa's summary
        with Client(cluster.url) as client:
            (request_id,) = client.submit_many([{"prompt": "Hi", "id": "acme:1",
                                                 "lane": "batch"}])
        ((_, ((entry_id, _),)),) = rc.xreadgroup(GROUP, "wb", {lane.stream: ">"}, count=1)
        rc.set(keys.affinity_summary("default", "wa"), b"\x01" * 8, px=5000)
        handover = AffinityHandover(keys, "default")
        # When wb hands it to wa, wa renews it and wb takes it back
        entry = entry_id.decode()
        assert handover.hand_over(rc, "wb", "wa", "01" * 8, [entry], 16, lane) == ([entry], [])
        assert handover.renew(rc, "wa") == 1
        (taken,) = handover.take(rc, "wa", "wb", handover.tickets(rc, "wa", 8))
        # Then it is wb's again, on acme's lane stream, as the same delivery
        assert (taken.entry.entry_id, taken.attempt, taken.lane) == (entry, 1, lane)
        assert request_id == "acme:1"
    finally:
        rc.close()
