"""The chaos soak (bench/chaos.py) for two minutes on the tiny model: every invariant holds.

Three `llmq worker` processes and an AOF valkey-server serve a steady stream of requests while
workers are SIGKILLed, SIGSTOPped, SIGTERMed, Redis is killed with -9 and restarted, paused and
has its clients cut off, each kind at least once. Then every accepted request must have exactly
one terminal event for its final attempt, whose deltas concatenate to its text, nothing may be
left pending, and a request may be lost only within the AOF window of a Redis kill (and then
finishes once resubmitted). The 30-minute figures are in docs/operations.md ("Chaos soak").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.fixtures.redis_servers import require_binary

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _chaos_module():
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_two_minutes_of_chaos_break_no_invariant(tiny_model_path: Path, tmp_path: Path) -> None:
    require_binary("valkey")
    chaos = _chaos_module()
    # Given three workers, an AOF Redis and a producer at 3 requests/s
    config = chaos.ChaosConfig(duration=120.0, workers=3, seed=12, server="valkey",
                               model=str(tiny_model_path), work_dir=tmp_path)
    # When faults of every kind are injected for two minutes
    report = chaos.run_chaos(config)
    print(report.table())
    # Then every kind came up, requests flowed, and every invariant holds
    assert set(report.faults) == set(chaos.FAULTS), report.faults
    assert report.accepted > 100 and not report.refused, report.table()
    assert report.ok, f"{report.table()}\nworker logs: {report.log_dir}"
    assert sum(report.outcomes.values()) == report.accepted
