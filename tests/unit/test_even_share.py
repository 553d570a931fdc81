"""How much of a queue's work one worker holds while peers read it too: an even part, never at
the cost of leaving work unread (tests/integration/test_work_conservation.py runs it on two
workers)."""

from __future__ import annotations

from llmq.worker.even_share import PEER_STALL_S, EvenShare


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _share(clock: Clock | None = None) -> EvenShare:
    return EvenShare(clock or Clock())


def test_a_burst_on_two_workers_is_held_half_each() -> None:
    # Given two workers of a queue, one of which has read 20 of a 64-request burst
    share = _share()
    share.observe(num_workers=2, lag=44, pending=20, group_reads=120, own_reads=60)
    # Then it may take 12 more (32 in all), however large its window, and none past that
    assert share.room(num_held=20, floor=16) == 12
    assert share.room(num_held=32, floor=16) == 0
    # and three workers would hold 22 each (64 / 3, rounded up: nothing is left over)
    share.observe(num_workers=3, lag=44, pending=20, group_reads=120, own_reads=60)
    assert share.room(num_held=20, floor=16) == 2


def test_under_light_load_the_intake_window_still_reads() -> None:
    # Given 3 entries in a two-worker queue (a share of 2)
    share = _share()
    share.observe(num_workers=2, lag=1, pending=2, group_reads=10, own_reads=5)
    # Then a worker holding 2 may still read up to its window of 16
    assert share.room(num_held=2, floor=16) == 14


def test_alone_or_with_unknown_counts_there_is_no_share() -> None:
    share = _share()
    share.observe(num_workers=1, lag=60, pending=4, group_reads=64, own_reads=64)
    assert share.room(num_held=40, floor=16) is None
    # lag unknown (an XDEL past the group's last read) or no entries-read (before Redis 7)
    share.observe(num_workers=2, lag=None, pending=4, group_reads=64, own_reads=32)
    assert share.room(num_held=40, floor=16) is None
    share.observe(num_workers=2, lag=60, pending=4, group_reads=None, own_reads=32)
    assert share.room(num_held=40, floor=16) is None


def test_entries_no_peer_takes_are_taken_after_the_stall_time() -> None:
    # Given a worker at its share, beside a live peer that has stopped reading (its seats full)
    clock = Clock()
    share = _share(clock)
    share.observe(num_workers=2, lag=24, pending=40, group_reads=40, own_reads=32)
    assert share.room(num_held=32, floor=16) == 0
    # When the entries wait and the peer reads none of them for just under the stall time
    clock.now += PEER_STALL_S - 0.1
    share.observe(num_workers=2, lag=24, pending=40, group_reads=40, own_reads=32)
    assert share.room(num_held=32, floor=16) == 0
    # Then at the stall time this worker reads them
    clock.now += 0.1
    share.observe(num_workers=2, lag=24, pending=40, group_reads=40, own_reads=32)
    assert share.room(num_held=32, floor=16) is None


def test_a_peer_that_keeps_reading_keeps_the_share() -> None:
    clock = Clock()
    share = _share(clock)
    share.observe(num_workers=2, lag=30, pending=34, group_reads=34, own_reads=32)
    for peer_reads in range(3, 10):
        clock.now += PEER_STALL_S / 2
        # the peer reads one more each time (this worker read none)
        share.observe(num_workers=2, lag=33 - peer_reads, pending=31 + peer_reads,
                      group_reads=32 + peer_reads, own_reads=32)
        assert share.room(num_held=32, floor=16) == 0


def test_a_burst_after_a_quiet_spell_is_shared_at_once() -> None:
    # Given a pool that has read nothing for a minute
    clock = Clock()
    share = _share(clock)
    share.observe(num_workers=2, lag=0, pending=0, group_reads=10, own_reads=5)
    clock.now += 60
    share.observe(num_workers=2, lag=0, pending=0, group_reads=10, own_reads=5)
    # When a burst of 64 lands, this worker's first read taking one
    share.observe(num_workers=2, lag=63, pending=1, group_reads=11, own_reads=6)
    # Then the peers' quiet minute does not count as a stall: the share holds
    assert share.room(num_held=1, floor=16) == 31


def test_a_pool_of_slow_steps_waits_for_its_peers_a_few_steps() -> None:
    # Given workers whose steps take up to 3 s (a 1B model's prefill on one core): a peer with
    # a full window reads again only after its next step
    clock = Clock()
    share = _share(clock)
    share.observe(num_workers=2, lag=30, pending=34, group_reads=34, own_reads=32, step_s=3.0)
    # When the peer has read nothing for two such steps, the share holds
    clock.now += 2 * 3.0
    share.observe(num_workers=2, lag=30, pending=34, group_reads=34, own_reads=32, step_s=3.0)
    assert share.room(num_held=32, floor=16) == 0
    # and only after three it is lifted
    clock.now += 3.0
    share.observe(num_workers=2, lag=30, pending=34, group_reads=34, own_reads=32, step_s=3.0)
    assert share.room(num_held=32, floor=16) is None
