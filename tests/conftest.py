"""Shared fixtures: real Redis-compatible servers and model files, each in its own module."""

pytest_plugins = [
    "tests.fixtures.redis_servers",
    "tests.fixtures.redis_cluster",
    "tests.fixtures.models",
    "tests.fixtures.acl_server",
]
