"""The ack (`llmq_ack`) only releases entries the worker still owns (docs/reliability.md,
scenario 14)."""

from __future__ import annotations

import pytest
import redis

from llmq.broker.functions import ensure_functions
from llmq.broker.keys import GROUP, Keys
from llmq.worker.ack_script import ack_fcall_args, ack_script_args

pytestmark = pytest.mark.redis

KEYS = [Keys().queue("default"), Keys().handbacks("default"), Keys().dlq("default"),
        Keys().submissions("default")]
KEY = KEYS[0]


def test_a_stale_owner_cannot_ack_an_entry_a_peer_reclaimed(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.flushall()
    r.xgroup_create(KEY, GROUP, id="0", mkstream=True)
    kept = r.xadd(KEY, {"json": '{"prompt":"a"}'})
    taken = r.xadd(KEY, {"json": '{"prompt":"b"}'})
    # Given two entries read by worker A, one of which peer B reclaimed while A stalled
    r.xreadgroup(GROUP, "A", {KEY: ">"})
    r.xclaim(KEY, GROUP, "B", 0, [taken])
    ensure_functions(r)

    def ack_owned(keys: list[str], args: list) -> list[str]:
        return r.fcall(*ack_fcall_args(keys, args))

    # When A finishes both and acks them
    refused = ack_owned(keys=KEYS, args=ack_script_args("A", [kept, taken], []))
    # Then only its own entry is acked; the reclaimed one stays pending under B, reported back
    assert refused == [taken]
    pending = r.xpending_range(KEY, GROUP, min="-", max="+", count=10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(taken, "B")]
    # And B, the owner, can ack it
    assert ack_owned(keys=KEYS, args=ack_script_args("B", [taken], [])) == []
    assert r.xpending(KEY, GROUP)["pending"] == 0
