"""StreamFollower (the cancel and control streams every worker reads) on a real server."""

from __future__ import annotations

import redis

from llmq.broker import replies
from llmq.worker.stream_follower import READ_COUNT, StreamFollower
from llmq.worker.worker_config import WorkerConfig
from llmq.worker.worker_context import WorkerContext
from tests.integration.worker_harness import wait_for

KEY = "llmq:cancel:{default}"


class Recorder(StreamFollower):
    """Records the entries it handles and how many each read brought."""

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, KEY, name="test follower", block_ms=200)
        self.entry_ids: list[str] = []
        self.pages: list[int] = []  # entries per read

    def before_read(self) -> None:
        self.pages.append(0)

    def handle(self, entry_id: str, fields: replies.Fields) -> None:
        self.entry_ids.append(entry_id)
        self.pages[-1] += 1


def test_a_flood_of_entries_is_read_in_pages(redis_server, redis_client: redis.Redis) -> None:
    # Given a follower blocked on the stream
    redis_client.xadd(KEY, {"json": "{}"})
    ctx = WorkerContext(WorkerConfig(redis_url=redis_server.url, worker_id="w"), "tiny", 4)
    follower = Recorder(ctx)
    follower.start()
    try:
        wait_for(lambda: len(follower.pages) >= 2, 5, "the follower to block")
        # When far more entries than one page arrive at once
        total = 4 * READ_COUNT + 10
        pipe = redis_client.pipeline(transaction=True)
        for i in range(total):
            pipe.xadd(KEY, {"json": f'{{"id": "r{i}"}}'})
        pipe.execute()
        # Then it handles every one, once, in order
        wait_for(lambda: len(follower.entry_ids) == total, 10, "every entry")
        assert follower.entry_ids == sorted(follower.entry_ids, key=lambda e: tuple(
            int(p) for p in e.split("-")))
        # And no read brought more than a page
        assert max(follower.pages) == READ_COUNT
    finally:
        follower.stop()
        follower.join(5)
        follower.client.close()
