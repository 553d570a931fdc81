"""ReadMux: which result streams a client follows, from where, and who gets each entry (no IO)."""

from __future__ import annotations

from llmq.broker.multiplex import ReadMux, parse_entry_id


def entry(entry_id: str, text: str = "x") -> list:
    return [entry_id.encode(), [b"json", text.encode()]]


def test_followers_fill_lanes_of_at_most_keys_per_lane_and_share_a_stream() -> None:
    # Given a mux whose lanes hold two streams each
    mux = ReadMux(keys_per_lane=2)
    # When five streams are followed, one of them twice
    subs = [mux.subscribe(f"r:{i}", object())[0] for i in range(5)]
    again, _ = mux.subscribe("r:0", object())
    # Then three lanes read them (two connections' worth, plus one), and a stream read twice
    # stays in one lane
    assert [len(lane) for lane in mux.lanes] == [2, 2, 1]
    assert again.lane is subs[0].lane
    assert len(mux) == 5 and mux.num_subscriptions == 6


def test_a_read_names_every_stream_of_its_lane_from_the_least_advanced_follower() -> None:
    mux = ReadMux()
    first, _ = mux.subscribe("r:a", "sink-a")
    mux.subscribe("r:b", "sink-b")
    first.position = parse_entry_id("5-1")
    second, _ = mux.subscribe("r:a", "sink-a2")  # a second follower, from the start
    command = mux.read_command(mux.lanes[0], 5000)
    assert command == ["XREAD", "COUNT", 512, "BLOCK", 5000, "STREAMS", "r:a", "r:b",
                       "0-0", "0-0"]
    assert mux.lanes[0].reading


def test_a_stream_followed_during_a_read_asks_for_the_read_to_be_woken() -> None:
    # Given a lane whose read is in flight
    mux = ReadMux()
    mux.subscribe("r:a", "a")
    lane = mux.lanes[0]
    mux.read_command(lane, 5000)
    # When another stream is followed, Then its lane must be woken (the read does not name it)
    _, wake = mux.subscribe("r:b", "b")
    assert wake and lane.uncovered
    # And a stream the read already names needs no wake-up
    _, wake = mux.subscribe("r:a", "a2")
    assert not wake
    # And after the read ends, the next one names both
    mux.dispatch(lane, None)
    assert not lane.reading and "r:b" in mux.read_command(lane, None)


def test_a_lane_whose_last_follower_left_sends_no_read() -> None:
    # Given a lane whose reader saw a follower, which then leaves before the read is built
    mux = ReadMux()
    subscription, _ = mux.subscribe("r:a", "a")
    lane = mux.lanes[0]
    mux.unsubscribe(subscription)
    # When the reader builds its read, Then there is none (an XREAD naming no stream is a
    # syntax error on Redis 7, which used to fail the lane's next followers) and the lane is
    # not reading
    assert mux.read_command(lane, 5000) is None
    assert not lane.reading
    # And a stream followed again is read as usual
    mux.subscribe("r:b", "b")
    assert mux.read_command(lane, 5000) == ["XREAD", "COUNT", 512, "BLOCK", 5000, "STREAMS",
                                            "r:b", "0-0"]


def test_each_follower_gets_each_entry_once_in_resp2_and_resp3_shapes() -> None:
    mux = ReadMux()
    early, _ = mux.subscribe("r:a", "early")
    late, _ = mux.subscribe("r:a", "late")
    early.position = parse_entry_id("1-0")  # it has seen the first entry already
    lane = mux.lanes[0]
    mux.read_command(lane, None)
    resp2 = [[b"r:a", [entry("1-0", "one"), entry("2-0", "two")]]]
    out = dict(mux.dispatch(lane, resp2))
    assert [e.entry_id for e in out["early"]] == ["2-0"]
    assert [e.entry_id for e in out["late"]] == ["1-0", "2-0"]
    assert out["late"][0].fields == {"json": b"one"}
    # RESP3: a map of stream -> entries; entries already handed over are not handed again
    mux.read_command(lane, None)
    resp3 = {b"r:a": [entry("2-0", "two"), entry("3-0", "three")]}
    out = dict(mux.dispatch(lane, resp3))
    assert [e.entry_id for e in out["early"]] == ["3-0"] == [e.entry_id for e in out["late"]]


def test_an_unsubscribed_stream_is_dropped_and_its_late_entries_go_nowhere() -> None:
    mux = ReadMux()
    sub, _ = mux.subscribe("r:a", "a")
    lane = mux.lanes[0]
    mux.read_command(lane, None)
    mux.unsubscribe(sub)
    assert mux.dispatch(lane, [[b"r:a", [entry("1-0")]]]) == []
    assert len(mux) == 0 and len(lane) == 0


def test_a_failed_read_resumes_from_the_last_entry_handed_over() -> None:
    mux = ReadMux()
    mux.subscribe("r:a", "a")
    lane = mux.lanes[0]
    mux.read_command(lane, 5000)
    mux.dispatch(lane, [[b"r:a", [entry("7-2")]]])
    mux.read_command(lane, 5000)
    mux.read_failed(lane)  # e.g. the connection was reset
    assert mux.read_command(lane, 5000)[-1] == "7-2"
