"""The worker's configuration, fault hooks and in-flight table: no Redis, no model."""

from __future__ import annotations

import pytest

from llmq.worker.inflight_table import InFlight, InFlightTable
from llmq.worker.worker_config import WorkerConfig
from tests.fixtures.faults import Faults


def test_renewals_default_from_the_lease_and_scans_from_the_heartbeat() -> None:
    config = WorkerConfig(lease_timeout=30.0, worker_id="w")
    assert (config.renew_interval, config.heartbeat_interval, config.claim_interval) == (
        10.0, 1.0, 1.0)


def test_a_killed_workers_requests_are_taken_within_ten_seconds_by_default() -> None:
    # heartbeat timeout 5 s + a beat + two scans: the bound the SIGKILL test checks against
    assert WorkerConfig(worker_id="w").takeover_bound == 8.0 < 10


@pytest.mark.parametrize("kwargs, field", [
    ({"lease_timeout": 0}, "lease_timeout"),
    ({"lease_timeout": 3, "renew_interval": 3}, "renew_interval"),
    ({"max_deliveries": 0}, "max_deliveries"),
    ({"drain_timeout": -1}, "drain_timeout"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"queue": "bad queue"}, "queue"),
    ({"worker_id": "a{b}"}, "worker_id"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{"worker_id": "w", **kwargs})


def test_default_worker_ids_are_unique_and_valid() -> None:
    a, b = WorkerConfig(), WorkerConfig()
    assert a.worker_id != b.worker_id


def test_fault_hooks_parse_and_are_off_by_default() -> None:
    assert not Faults.from_env("").active
    faults = Faults.from_env("slow_step:25, raise_in_step:BOOM,crash_after_terminal")
    assert faults.slow_step_s == 0.025 and faults.crash_after_terminal
    assert faults.is_poison(["a BOOM b"]) and not faults.is_poison(["fine"])
    with pytest.raises(ValueError, match="unknown fault hook"):
        Faults.from_env("explode")


def test_inflight_table_cancel_fence_and_room() -> None:
    table = InFlightTable()
    assert table.add(InFlight("1-0", "req", 1, "json"))
    assert not table.add(InFlight("1-0", "req", 2, "json"))  # one entry, one record
    table.add(InFlight("2-0", "other", 1, "json"))
    assert table.request_cancel("req") == ["1-0"] and table.get("1-0").cancel_requested
    assert table.fence(["2-0", "9-9"]) == ["2-0"] and table.fence(["2-0"]) == []
    assert table.live_entry_ids() == ["1-0"]
    # a fenced entry is a peer's now: it no longer waits to start here
    assert table.num_not_started() == 1
    table.mark_started(["1-0", "9-9"])
    assert table.get("1-0").started and table.num_not_started() == 0
