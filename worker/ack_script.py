"""The calls of `llmq_ack`: a batch's dead letters and acks, in the request stream's slot.

`llmq_ack` is a function of the llmq library (broker/functions.py, where its code and the NOTE on
why it fences are), loaded by the admin at deploy, so the worker user needs no EVAL or SCRIPT.
The result writer (worker/result_writer.py) calls it after the batch's events: in the same
MULTI/EXEC on one server, on its own on a cluster once the events are on their nodes. It acks
only the entries still pending under this worker, and returns the ones a peer owns now, which
the writer logs and leaves to that peer.
"""

from __future__ import annotations

from typing import Any

from llmq.broker.functions import ACK_FUNCTION
from llmq.broker.keys import GROUP

__all__ = ["ACK_FUNCTION", "ACK_SLICE", "ack_calls", "ack_fcall_args", "ack_script_args"]

# Lua's unpack has a stack limit in the thousands: ack in slices well below it.
ACK_SLICE = 500


def ack_script_args(consumer: str, entry_ids: list[str],
                    dead_letters: list[dict[str, bytes]]) -> list[Any]:
    """`llmq_ack`'s arguments after its keys."""
    args: list[Any] = [GROUP, consumer, len(entry_ids), *entry_ids]
    for fields in dead_letters:
        args.append(len(fields))
        for name, value in fields.items():
            args += [name, value]
    return args


def ack_calls(keys: list[str], consumer: str, ack_ids: list[str],
              dead_letters: list[dict[str, bytes]]) -> list[tuple[list[str], list[Any]]]:
    """`llmq_ack`'s (keys, args) for a batch's acks and dead letters, in slices of ACK_SLICE
    acks (the dead letters go with the first); none when there is nothing to ack or add.
    `keys`: the request stream, hand-back counts, dead-letter stream and submissions keys."""
    calls = []
    for start in range(0, max(len(ack_ids), 1), ACK_SLICE):
        ids = ack_ids[start:start + ACK_SLICE]
        letters = dead_letters if start == 0 else []
        if not ids and not letters:
            break
        calls.append((keys, ack_script_args(consumer, ids, letters)))
    return calls


def ack_fcall_args(keys: list[str], args: list[Any]) -> list[Any]:
    """What follows FCALL for one of `ack_calls`' (keys, args): the function, the keys, the args."""
    return [ACK_FUNCTION, len(keys), *keys, *args]
