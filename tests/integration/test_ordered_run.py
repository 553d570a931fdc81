"""OrderedRun, the runner under `llmq submit -f` and the batch job, against real servers.

No worker: a thread plays one, reading the group and answering the requests it holds in reverse
order, so the records can only come out in input order if the runner puts them there.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis

from llmq.broker import Client
from llmq.broker.keys import GROUP, Keys
from llmq.broker.ordered_run import OrderedRun, RunEnd, Settled, Submit
from llmq.broker.transcript import Transcript
from llmq.protocol import Done, Start, Timings, Usage
from tests.integration.producer_harness import write_events

pytestmark = pytest.mark.redis

KEYS = Keys()
BATCH_LANE = KEYS.lane_stream("default", "batch")


class Sink:
    """Records as strings: `ok:<id>`, `not_run:<index>:<submitted>`, or a settled one."""

    def __init__(self, *, stop_once_submitted: bool = False) -> None:
        self.written: list[str] = []
        self.submitted = 0
        self.stop_once_submitted = stop_once_submitted

    def finished(self, index: int, transcript: Transcript) -> str:
        return f"ok:{transcript.request_id}"

    def not_run(self, index: int, *, submitted: bool) -> str:
        return f"not_run:{index}:{submitted}"

    def write(self, record: str) -> None:
        self.written.append(record)

    def tick(self, submitted: int) -> None:
        self.submitted = submitted

    def stop_requested(self) -> bool:
        return self.stop_once_submitted and self.submitted > 0


class FakeWorker(threading.Thread):
    """Reads what the group delivers and answers each batch newest first; notes how many
    requests were waiting unanswered at most."""

    def __init__(self, url: str, *, batch: int = 100) -> None:
        super().__init__(daemon=True)
        self.redis = redis.Redis.from_url(url)
        self.batch = batch
        self.stop = threading.Event()
        self.most_waiting = 0
        self.answered = 0
        self.answer_order: list[str] = []  # request ids, as answered

    def run(self) -> None:
        with Client(connection=self.redis) as client:
            client.ensure_group()  # a real worker creates it too, before its first read
        # NOTE: a run's requests are batch work, on the queue's batch lane (work_lanes.py)
        try:
            self.redis.xgroup_create(BATCH_LANE, GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass  # BUSYGROUP: the client made it
        while not self.stop.is_set():
            reply = self.redis.xreadgroup(GROUP, "fake", {BATCH_LANE: ">"},
                                          count=self.batch, block=100)
            if not reply:
                continue
            entries = reply[0][1]
            # NOTE: up to a second for the rest of a submission to arrive, so a batch holds
            # several requests to answer out of order even when a loaded machine delivers them
            # one by one (a fixed 0.2 s wait left every batch one request long once, and the
            # run's requests ended in input order)
            deadline = time.monotonic() + 1.0
            while len(entries) < 2 and time.monotonic() < deadline:
                more = self.redis.xreadgroup(GROUP, "fake", {BATCH_LANE: ">"},
                                             count=self.batch - len(entries), block=50)
                entries += more[0][1] if more else []
            waiting = self.redis.xlen(BATCH_LANE) - self.answered
            self.most_waiting = max(self.most_waiting, waiting)
            for entry_id, fields in reversed(entries):
                request_id = json.loads(fields[b"json"]).get("id") or entry_id.decode()
                # NOTE: noted before the answer is written: the run may end on that answer
                # and the test read the order before this thread went on
                self.answer_order.append(request_id)
                write_events(self.redis, [
                    Start(request_id, 1, "w", 1, "tiny"),
                    Done(request_id, 1, "stop", "hi", Usage(1, 1), Timings(0, 0, 0, None))])
                self.redis.xack(BATCH_LANE, GROUP, entry_id)
                self.answered += 1


def _lines(n: int, *, settled: tuple[int, ...] = ()) -> list[Submit | Settled[str]]:
    return [Settled(f"settled:{i}") if i in settled
            else Submit(f"r-{i}", {"id": f"r-{i}", "prompt": "Hi", "max_tokens": 2})
            for i in range(n)]


@pytest.fixture
def worker(redis_server: Any, redis_client: redis.Redis) -> Any:
    fake = FakeWorker(redis_server.url, batch=3)
    fake.start()
    yield fake
    fake.stop.set()
    fake.join(5)


def test_records_come_in_input_order_whatever_order_requests_end(
        redis_server: Any, worker: FakeWorker) -> None:
    # Given 10 lines, two of them settled before the run (say, invalid), answered newest first
    sink = Sink()
    with Client(redis_server.url) as client:
        run = OrderedRun(client, _lines(10, settled=(0, 4)), sink)
        # When they run
        assert run.run() is RunEnd.COMPLETED
    # Then they ended out of order, and the sink got every record in input order
    answered = [int(request_id.removeprefix("r-")) for request_id in worker.answer_order]
    assert sorted(answered) == [1, 2, 3, 5, 6, 7, 8, 9] and answered != sorted(answered)
    assert sink.written == [f"settled:{i}" if i in (0, 4) else f"ok:r-{i}" for i in range(10)]


def test_at_most_max_in_flight_requests_wait_at_a_time(redis_server: Any,
                                                       worker: FakeWorker) -> None:
    sink = Sink()
    with Client(redis_server.url) as client:
        assert OrderedRun(client, _lines(12), sink, max_in_flight=2).run() is RunEnd.COMPLETED
    assert len(sink.written) == 12
    assert worker.most_waiting <= 2


def test_a_stop_cancels_and_records_the_rest_as_not_run(redis_server: Any,
                                                        redis_client: redis.Redis) -> None:
    # Given 3 lines, 2 at a time, no worker answering, and a stop asked once the first 2 are
    # queued
    sink = Sink(stop_once_submitted=True)
    with Client(redis_server.url) as client:
        # When they run
        end = OrderedRun(client, _lines(3), sink, max_in_flight=2, cancel_grace=0.2).run()
    # Then the run says so, the queued requests were cancelled, the rest never queued
    assert end is RunEnd.CANCELLED
    assert sink.written == ["not_run:0:True", "not_run:1:True", "not_run:2:False"]
    assert redis_client.exists(KEYS.cancel_flag("r-0"), KEYS.cancel_flag("r-1")) == 2
    assert not redis_client.exists(KEYS.cancel_flag("r-2"))


def test_lines_are_taken_as_the_window_opens_never_far_ahead_of_the_output(
        redis_server: Any, worker: FakeWorker) -> None:
    # Given 30 lines from a generator (a dataset job renders its rows as they are taken), at
    # most 4 requests in flight and 6 lines taken ahead of the output
    sink = Sink()
    ahead_when_taken: list[int] = []

    def lines() -> Any:
        for number, line in enumerate(_lines(30)):
            ahead_when_taken.append(number - len(sink.written))
            yield line

    with Client(redis_server.url) as client:
        # When they run
        run = OrderedRun(client, lines(), sink, max_in_flight=4, max_unwritten=6)
        assert run.run() is RunEnd.COMPLETED
    # Then every record came, in input order, and no line was taken 6 ahead of the output:
    # the run held a window's worth of rows, not the input, with no pause between parts of it
    assert sink.written == [f"ok:r-{i}" for i in range(30)]
    assert max(ahead_when_taken) < 6


def test_a_bounded_window_is_refilled_in_steps_not_a_request_at_a_time(
        redis_server: Any, worker: FakeWorker) -> None:
    # Given 100 lines, 32 in flight at most, answered a few at a time
    submitted: list[int] = []  # the count of lines submitted, each time it changed

    class CountingSink(Sink):
        def tick(self, submitted_now: int) -> None:
            if not submitted or submitted[-1] != submitted_now:
                submitted.append(submitted_now)

    sink = CountingSink()
    with Client(redis_server.url) as client:
        # When they run
        assert OrderedRun(client, _lines(100), sink, max_in_flight=32).run() is RunEnd.COMPLETED
    # Then the window was filled, then refilled an eighth of it (4) or more at a time, but for
    # the last few: each refill wakes the result reader and re-sends its read of every stream
    # followed, a cost of the window's size, so a refill per answer made the client's CPU per
    # request grow with the window
    assert len(sink.written) == 100
    refills = [b - a for a, b in zip(submitted, submitted[1:], strict=False)]
    assert submitted[0] == 32 and submitted[-1] == 100
    assert all(refill >= 4 for refill in refills[:-1]), refills
