"""startup_gc (worker/startup_gc.py): no cyclic collection while a worker starts, its heap frozen
after, collection as it was before."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from llmq.worker.startup_gc import startup_gc


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every collection CPython runs while the test does."""
    seen: list[int] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    was_enabled = gc.isenabled()
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()  # the test's frozen objects back where collections walk them
        if was_enabled:
            gc.enable()


def make_cycles(count: int) -> list[list[Any]]:
    cycles = []
    for _ in range(count):
        node: list[Any] = []
        node.append(node)
        cycles.append(node)
    return cycles


def test_a_start_runs_no_collection_and_freezes_what_it_made(collections: list[int]) -> None:
    # Given collection on
    gc.enable()
    frozen_before = gc.get_freeze_count()

    # When a start makes far more objects than a collection waits for
    with startup_gc():
        kept = make_cycles(20 * gc.get_threshold()[0])

    # Then no collection ran meanwhile, what it made is frozen, and collection is on again
    assert collections == []
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    assert gc.isenabled()


def test_collection_left_off_stays_off(collections: list[int]) -> None:
    # Given collection turned off by the caller
    gc.disable()

    # When a start runs
    with startup_gc():
        make_cycles(10)

    # Then it is still off
    assert not gc.isenabled()
