"""Deleting a gone worker's consumer only while it holds nothing, in one server-side step.

`XGROUP DELCONSUMER` drops the consumer's pending entries with it: they stay in the stream but
are pending nowhere, below the group's last-delivered id, so no worker reads or reclaims them
again and retention later trims them (answered `lost_payload`, a request accepted and never
run). Checking "nothing pending" and then deleting from the client leaves a window: a worker
that was only paused (SIGSTOP, a long GC, a stalled host) loses its heartbeat, wakes, and
reads an entry between the check and the delete (seen in a 30-minute chaos soak). The library
function below does both at once, so a consumer is deleted only if it holds nothing at that
instant; a live worker's next XREADGROUP creates it again.
"""

from __future__ import annotations

from typing import Any

from llmq.broker import replies
from llmq.broker.keys import GROUP
from llmq.broker.library_part import script_function

__all__ = ["DROP_IDLE_CONSUMER_FUNCTION", "LIBRARY_PART", "drop_idle_consumer"]

DROP_IDLE_CONSUMER_FUNCTION = "llmq_drop_idle_consumer"

# KEYS[1] the stream; ARGV the group, the consumer. Replies 1 when deleted, 0 when it holds an
# entry (left as it is).
_DROP_IDLE_CONSUMER = """\
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# The cleanup's part of the llmq function library (broker/functions.py appends it).
LIBRARY_PART = script_function(DROP_IDLE_CONSUMER_FUNCTION, _DROP_IDLE_CONSUMER)


def drop_idle_consumer(client: Any, stream: str, consumer: str) -> bool:
    """Delete `consumer` of the workers' group on `stream` if it holds no entry; whether it
    was deleted."""
    reply = client.fcall(DROP_IDLE_CONSUMER_FUNCTION, 1, stream, GROUP, consumer)
    return bool(replies.integer(reply, "FCALL"))
