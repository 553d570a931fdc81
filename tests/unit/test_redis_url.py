"""The URL forms of docs/protocol.md section 13: one server, a Cluster, Sentinel."""

from __future__ import annotations

import pytest

from llmq.broker.redis_url import RedisURL
from llmq.protocol.errors import BrokerUnavailable


def test_a_cluster_url_names_its_seed_nodes_and_user() -> None:
    url = RedisURL.parse("redis+cluster://worker:s%40cret@n1:7000,n2:7001,n3/")
    assert url.kind == "cluster"
    assert url.nodes == [("n1", 7000), ("n2", 7001), ("n3", 6379)]
    assert (url.username, url.password, url.tls) == ("worker", "s@cret", False)


def test_a_sentinel_url_names_sentinels_master_and_database() -> None:
    url = RedisURL.parse("rediss+sentinel://gw:pw@s1:26379,s2/llmq/2?sentinel_password=x")
    assert (url.kind, url.master_name, url.db, url.tls) == ("sentinel", "llmq", 2, True)
    assert url.nodes == [("s1", 26379), ("s2", 26379)]
    assert url.sentinel_auth == {"password": "x"}


def test_plain_urls_are_one_server() -> None:
    url = RedisURL.parse("redis://producer:pw@host:6380/0")
    assert (url.kind, url.nodes, url.username) == ("single", [("host", 6380)], "producer")
    assert RedisURL.parse("unix:///tmp/r.sock").kind == "single"


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://s1:26379/", "no master name"),
    ("redis+cluster://n1:port/", "not host:port"),
    ("redis+cluster://n1:7000/3", "only database 0"),
    ("redis+cluster:///", "no host:port"),
    ("localhost:6379", "no scheme"),
])
def test_malformed_urls_are_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(BrokerUnavailable, match=why):
        RedisURL.parse(url)
