"""The worker's periodic log line: figures every 10 s while busy, nothing while idle."""

from __future__ import annotations

import logging

import pytest

from llmq.worker.engine.engine_core import EngineStats
from llmq.worker.stats_log import EngineStatsLog


def stats(running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=0.431,
                       prefix_cache_hit_rate=0.12, num_preemptions=0)


def test_one_line_every_ten_seconds_while_busy_and_none_while_idle(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmq.worker.stats")
    log = EngineStatsLog(now=0.0)
    # Given a worker checked every 0.25 s, generating 600 tokens/s and finishing 5 req/s
    lines = []
    for tick in range(1, 81):  # 20 s
        now = tick * 0.25
        line = log.observe(now, stats(running=32, waiting=12), generated=int(now * 600),
                           finished=int(now * 5))
        if line:
            lines.append(line)
    # Then there is one line per 10 s, with throughput, running, waiting, KV use and hits
    assert lines == [
        "generation 600.0 tok/s, finished 5.0 req/s, running 32, waiting 12, KV cache 43.1%, "
        "prefix cache hit rate 12.0%"] * 2
    assert len(caplog.records) == 2
    # And when the worker is idle (nothing generated, nothing held), nothing is logged
    for tick in range(81, 200):
        assert log.observe(tick * 0.25, stats(), generated=12000, finished=100) is None
