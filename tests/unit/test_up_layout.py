"""`llmq up --workers N`: one worker per core, each pinned to its own; `llmq worker --cpus`."""

from __future__ import annotations

import click
import pytest

from llmq.cli.up import plan_layout
from llmq.cli.worker import parse_cpus


def test_each_worker_gets_cores_of_its_own():
    # Given 4 usable cores
    cores = [0, 1, 2, 3]

    # Then 2 workers of 1 thread take a core each, 2 of 2 threads two each
    assert plan_layout(2, 1, cores) == [[0], [1]]
    assert plan_layout(4, 1, cores) == [[0], [1], [2], [3]]
    assert plan_layout(2, 2, cores) == [[0, 1], [2, 3]]


def test_more_workers_than_cores_are_left_to_the_os():
    # Given a container limited to cores 4 and 7
    cores = [4, 7]

    # Then 2 workers are pinned to those, and 3 (or 2 x 2 threads) are not pinned at all
    assert plan_layout(2, 1, cores) == [[4], [7]]
    assert plan_layout(3, 1, cores) is None
    assert plan_layout(2, 2, cores) is None


def test_worker_cpus_are_read_as_lists_and_ranges():
    assert parse_cpus("0") == {0}
    assert parse_cpus("2-3,5") == {2, 3, 5}
    assert parse_cpus(None) is None and parse_cpus("") is None
    with pytest.raises(click.BadParameter, match="expected cores"):
        parse_cpus("two")


def test_metrics_ports_are_base_plus_index_and_a_taken_one_is_a_one_line_error():
    import socket

    from llmq.cli.up import plan_metrics_ports

    # Given a port someone else listens on
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        taken = holder.getsockname()[1]

        # Then no base means no ports, a free base gives worker i BASE+i
        assert plan_metrics_ports(0, 3) == []
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            base = probe.getsockname()[1]
        ports = plan_metrics_ports(base, 1)
        assert ports == [base]
        # And a range that holds the taken port is refused before anything starts
        with pytest.raises(click.ClickException) as refused:
            plan_metrics_ports(taken - 1, 2)
        assert str(taken) in refused.value.message and "\n" not in refused.value.message
        with pytest.raises(click.ClickException, match="past 65535"):
            plan_metrics_ports(65535, 2)
