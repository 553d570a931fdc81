"""Large byte strings kept as a list of pieces, so no command argument llmq sends is large.

deploy/redis.conf caps one argument, and one string value, at `proto-max-bulk-len 16mb` (not
Redis's 512 MB): the server reads and copies a huge argument while every other client waits (a
400 MB FCALL blocked all clients for seconds). llmq's own arguments are far below the cap (a
request's payload is at most 1 MiB), except uploaded files and batch inputs, up to
`--max-file-bytes` (64 MiB by default). Those are stored as a list of `PIECE_BYTES` pieces: one
RPUSH per piece, in the caller's transaction, so a reader sees all of it or none; reading is
LRANGE and a join.

A value written before the pieces (a plain string) still reads: the read asks for both shapes,
and the one of the wrong type answers WRONGTYPE.
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["PIECE_BYTES", "parse_pieces", "queue_read_pieces", "queue_store_pieces"]

PIECE_BYTES = 4 << 20  # a quarter of proto-max-bulk-len


def queue_store_pieces(pipe: Any, key: str, data: bytes, ttl: int) -> None:
    """Queue `data` at `key` (replacing it) as a list of pieces, kept `ttl` s: run it in a
    transaction."""
    view = memoryview(data)
    pipe.delete(key)
    for start in range(0, max(len(view), 1), PIECE_BYTES):
        pipe.rpush(key, bytes(view[start:start + PIECE_BYTES]))
    pipe.expire(key, ttl)


def queue_read_pieces(pipe: Any, key: str) -> None:
    """Queue the two reads `parse_pieces` takes (on an exchange with raise_on_error=False)."""
    pipe.lrange(key, 0, -1)
    pipe.get(key)  # a plain string stored before the pieces


def parse_pieces(replies: list[Any]) -> bytes | None:
    """The value from the two replies of `queue_read_pieces`; None when there is none."""
    pieces, whole = replies
    if not isinstance(pieces, redis.ResponseError):
        if pieces:
            return b"".join(pieces)
        if isinstance(whole, redis.ResponseError):  # WRONGTYPE from a list: cannot be
            raise whole
        return None
    if isinstance(whole, redis.ResponseError):
        raise whole
    return whole if whole is None else bytes(whole)
