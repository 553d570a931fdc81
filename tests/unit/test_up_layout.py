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
