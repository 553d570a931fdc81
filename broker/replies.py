"""Redis replies as concrete types, read once here at the broker boundary.

redis-py types a reply loosely: every string as `bytes | str` (it cannot know whether the client
decodes responses), a method that serves both the sync and the asyncio client as
`X | Awaitable[X]`, a pipeline's replies as `list[Any]`, and a dedicated connection's
`read_response()` as `Any`. llmq's clients never decode responses (msgpack payloads must stay
bytes), so the readers here take a reply as an `object`, check its shape, and return what the rest
of llmq works with: text and entry ids as `str`, an entry's fields as `{name: bytes}`, counts as
`int`, XINFO / XPENDING rows as named tuples. A reply of any other shape is a `ProtocolError`
naming the command, instead of an AttributeError somewhere in a caller.

Both RESP2 and RESP3 (`?protocol=3` URLs) shapes are read, parsed by redis-py or raw.

    entries = replies.entries(client.xrange(key))          # [StreamEntry(entry_id, fields)]
    for entry_id, fields in replies.read_entries(client.xread({key: last_id})):
        ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from llmq.protocol.errors import ProtocolError

__all__ = [
    "ConsumerInfo",
    "Fields",
    "GroupInfo",
    "PendingEntry",
    "PendingSummary",
    "StreamEntry",
    "array",
    "blob",
    "blobs",
    "consumers",
    "entries",
    "group",
    "groups",
    "integer",
    "last_generated_id",
    "optional_blob",
    "optional_text",
    "optional_texts",
    "pending_entries",
    "pending_summary",
    "read_entries",
    "read_streams",
    "server_time_ms",
    "string_hash",
    "text",
    "texts",
]

Fields = dict[str, bytes]  # an entry's fields: names decoded, values as Redis holds them


class StreamEntry(NamedTuple):
    entry_id: str
    fields: Fields  # {} for an entry deleted or trimmed while pending (XCLAIM, XAUTOCLAIM)


class GroupInfo(NamedTuple):
    """One row of XINFO GROUPS."""

    name: str
    consumers: int
    pending: int  # entries read by a consumer and not yet acked
    last_delivered_id: str
    lag: int | None  # entries not read yet; None when Redis cannot tell (after an XDEL)
    entries_read: int | None = None  # entries delivered to the group so far (Redis 7)


class ConsumerInfo(NamedTuple):
    """One row of XINFO CONSUMERS."""

    name: str
    pending: int
    idle_ms: int  # since its last read or claim


class PendingEntry(NamedTuple):
    """One row of XPENDING <key> <group> <start> <end> <count>."""

    entry_id: str
    consumer: str
    idle_ms: int  # since its last delivery
    times_delivered: int


class PendingSummary(NamedTuple):
    """XPENDING <key> <group> without a range."""

    num_pending: int
    min_id: str | None  # the oldest pending entry; None when nothing is pending
    max_id: str | None


# -- scalars --------------------------------------------------------------------------------------


def text(reply: object, command: str = "reply") -> str:
    """A bulk string reply (an entry id from XADD or FCALL, a value of GET) as text."""
    if isinstance(reply, bytes):
        return reply.decode("utf-8", "replace")
    if isinstance(reply, str):
        return reply
    raise _unexpected(command, "a string", reply)


def optional_text(reply: object, command: str = "reply") -> str | None:
    """A bulk string reply that may be nil (GET, HGET of a missing key or field)."""
    return None if reply is None else text(reply, command)


def blob(reply: object, command: str = "reply") -> bytes:
    """A bulk string reply as the bytes Redis holds (a payload, a file's content, a JSON line)."""
    if isinstance(reply, bytes):
        return reply
    if isinstance(reply, str):
        return reply.encode()  # a client that decodes responses: back to the bytes Redis holds
    raise _unexpected(command, "a string", reply)


def optional_blob(reply: object, command: str = "reply") -> bytes | None:
    """A bulk string reply that may be nil (GET of a missing key), as bytes."""
    return None if reply is None else blob(reply, command)


def blobs(reply: object, command: str = "reply") -> list[bytes]:
    """An array of strings (LRANGE) as bytes, in order."""
    return [blob(item, command) for item in array(reply, command)]


def integer(reply: object, command: str = "reply") -> int:
    """An integer reply (XLEN, DEL, EXISTS, XTRIM); also a count sent as a bulk string."""
    if isinstance(reply, int):
        return int(reply)  # NOTE: int(), so a True from a boolean callback counts as 1
    if isinstance(reply, bytes | str):
        try:
            return int(reply)
        except ValueError:
            pass
    raise _unexpected(command, "an integer", reply)


def _optional_integer(reply: object, command: str) -> int | None:
    return None if reply is None else integer(reply, command)


def texts(reply: object, command: str = "reply") -> list[str]:
    """An array or set of strings (SMEMBERS, ZRANGE, SCAN's keys) as a list of text."""
    return [text(item, command) for item in array(reply, command)]


def optional_texts(reply: object, command: str = "reply") -> list[str | None]:
    """An array of strings with nils (HMGET, MGET), in order."""
    return [optional_text(item, command) for item in array(reply, command)]


def server_time_ms(reply: object) -> int:
    """TIME's (seconds, microseconds) as unix milliseconds of the server's clock."""
    items = array(reply, "TIME")
    if len(items) != 2:
        raise _unexpected("TIME", "(seconds, microseconds)", reply)
    seconds, micros = (integer(item, "TIME") for item in items)
    return seconds * 1000 + micros // 1000


def string_hash(reply: object, command: str = "HGETALL") -> dict[str, str]:
    """A hash (HGETALL, HSCAN's page) with text values; {} for a missing key."""
    return {text(name, command): text(value, command) for name, value in _pairs(reply, command)}


# -- streams --------------------------------------------------------------------------------------


def entries(reply: object, command: str = "XRANGE") -> list[StreamEntry]:
    """The entries of XRANGE, XREVRANGE or XCLAIM (without JUSTID); [] for nil.

    A nil in place of an entry (XCLAIM on Redis before 7.0, for an entry deleted while pending)
    names no entry and is left out: to the caller that entry was not claimed.
    """
    if reply is None:
        return []
    out = []
    for raw in array(reply, command):
        entry = _entry(raw, command)
        if entry is not None:
            out.append(entry)
    return out


def read_entries(reply: object, command: str = "XREAD") -> list[StreamEntry]:
    """The entries of an XREAD or XREADGROUP reply that names one stream; [] for nil."""
    streams = read_streams(reply, command)
    if len(streams) > 1:
        raise _unexpected(command, "one stream", [key for key, _ in streams])
    return streams[0][1] if streams else []


def read_streams(reply: object, command: str = "XREAD") -> list[tuple[str, list[StreamEntry]]]:
    """(stream key, its entries) of an XREAD or XREADGROUP reply over any number of streams.

    Reads a RESP2 array of [key, entries] or a RESP3 map key -> entries, as redis-py parsed it
    (some of its parsers wrap a stream's entries once more) or raw from a connection's
    `read_response()` (fields as a flat [name, value, ...] array). Nil (nothing arrived, or
    the read was woken) is [].
    """
    if not reply:
        return []
    if isinstance(reply, Mapping):
        pairs: list[tuple[object, object]] = list(reply.items())
    else:
        pairs = []
        for item in array(reply, command):
            pair = array(item, command)
            if len(pair) != 2:
                raise _unexpected(command, "[key, entries]", item)
            pairs.append((pair[0], pair[1]))
    out = []
    for key, raw_entries in pairs:
        batch = array(raw_entries, command) if raw_entries is not None else []
        if len(batch) == 1 and _is_entry_list(batch[0]):
            batch = array(batch[0], command)  # RESP3, as redis-py wraps it: [[entries]]
        out.append((text(key, command), entries(batch, command)))
    return out


def _is_entry_list(value: object) -> bool:
    """Whether `value` is a list of entries rather than one entry (an id, then its fields)."""
    return isinstance(value, list | tuple) and (not value or isinstance(value[0], list | tuple))


def _entry(raw: object, command: str) -> StreamEntry | None:
    pair = array(raw, command) if raw is not None else None
    if not pair or pair[0] is None:
        return None
    if len(pair) < 2:
        raise _unexpected(command, "an entry [id, fields]", raw)
    entry_id, fields = pair[0], pair[1]
    if isinstance(entry_id, bytes) and (one := _one_field(fields)) is not None:
        return StreamEntry(entry_id.decode("utf-8", "replace"), one)
    return StreamEntry(text(entry_id, command), _fields(fields, command))


def _one_field(raw: object) -> Fields | None:
    """The usual entry's fields, one name and its bytes (an llmq record's json or msgpack),
    read without the general path's calls: a follower reads one per token. None otherwise."""
    if isinstance(raw, list) and len(raw) == 2:
        name, value = raw
    elif isinstance(raw, dict) and len(raw) == 1:
        ((name, value),) = raw.items()
    else:
        return None
    if isinstance(name, bytes) and isinstance(value, bytes):
        return {name.decode("utf-8", "replace"): value}
    return None


def _fields(raw: object, command: str) -> Fields:
    return {text(name, command): blob(value, command) for name, value in _pairs(raw, command)}


# -- XINFO and XPENDING ---------------------------------------------------------------------------


def groups(reply: object) -> list[GroupInfo]:
    """The rows of XINFO GROUPS."""
    out = []
    for row in array(reply, "XINFO GROUPS"):
        info = _mapping(row, "XINFO GROUPS")
        out.append(GroupInfo(
            name=text(info.get("name"), "XINFO GROUPS"),
            consumers=integer(info.get("consumers", 0), "XINFO GROUPS"),
            pending=integer(info.get("pending", 0), "XINFO GROUPS"),
            last_delivered_id=text(info.get("last-delivered-id", "0-0"), "XINFO GROUPS"),
            lag=_optional_integer(info.get("lag"), "XINFO GROUPS"),
            entries_read=_optional_integer(info.get("entries-read"), "XINFO GROUPS")))
    return out


def group(reply: object, name: str) -> GroupInfo | None:
    """The row of XINFO GROUPS for the group `name`; None when the stream has no such group."""
    return next((g for g in groups(reply) if g.name == name), None)


def consumers(reply: object) -> list[ConsumerInfo]:
    """The rows of XINFO CONSUMERS."""
    out = []
    for row in array(reply, "XINFO CONSUMERS"):
        info = _mapping(row, "XINFO CONSUMERS")
        out.append(ConsumerInfo(name=text(info.get("name"), "XINFO CONSUMERS"),
                                pending=integer(info.get("pending", 0), "XINFO CONSUMERS"),
                                idle_ms=integer(info.get("idle", 0), "XINFO CONSUMERS")))
    return out


def last_generated_id(reply: object) -> str | None:
    """XINFO STREAM's last-generated-id; None when the reply has none."""
    return optional_text(_mapping(reply, "XINFO STREAM").get("last-generated-id"),
                         "XINFO STREAM")


def pending_entries(reply: object) -> list[PendingEntry]:
    """The rows of XPENDING with a range, parsed by redis-py (dicts) or raw (arrays)."""
    out = []
    for row in array(reply, "XPENDING"):
        if isinstance(row, Mapping):
            values: list[object] = [row.get("message_id"), row.get("consumer"),
                                    row.get("time_since_delivered"), row.get("times_delivered")]
        else:
            values = array(row, "XPENDING")
        if len(values) != 4:
            raise _unexpected("XPENDING", "[id, consumer, idle, deliveries]", row)
        entry_id, consumer, idle, delivered = values
        out.append(PendingEntry(text(entry_id, "XPENDING"), text(consumer, "XPENDING"),
                                integer(idle, "XPENDING"), integer(delivered, "XPENDING")))
    return out


def pending_summary(reply: object) -> PendingSummary:
    """XPENDING without a range, parsed by redis-py (a dict) or raw (an array)."""
    if isinstance(reply, Mapping):
        values: list[object] = [reply.get("pending"), reply.get("min"), reply.get("max")]
    else:
        values = array(reply, "XPENDING")[:3]
    if len(values) != 3:
        raise _unexpected("XPENDING", "[count, min, max, consumers]", reply)
    count, min_id, max_id = values
    return PendingSummary(integer(count, "XPENDING"), optional_text(min_id, "XPENDING"),
                          optional_text(max_id, "XPENDING"))


# -- shapes ---------------------------------------------------------------------------------------


def array(reply: object, command: str = "reply") -> list[object]:
    """An array reply (a script's table, a pipeline's replies) as a list of replies to read."""
    if isinstance(reply, list):
        return reply
    if isinstance(reply, tuple | set):
        return list(reply)
    raise _unexpected(command, "an array", reply)


def _pairs(reply: object, command: str) -> Iterable[tuple[object, object]]:
    """The (name, value) pairs of a map reply: a dict (RESP3, or parsed by redis-py) or a flat
    [name, value, ...] array (RESP2 raw); nil has none."""
    if reply is None:
        return ()
    if isinstance(reply, Mapping):
        return reply.items()
    flat = array(reply, command)
    if len(flat) % 2:
        raise _unexpected(command, "[name, value, ...] pairs", reply)
    return zip(flat[0::2], flat[1::2], strict=True)


def _mapping(reply: object, command: str) -> dict[str, object]:
    """A map reply with its names as text."""
    return {text(name, command): value for name, value in _pairs(reply, command)}


def _unexpected(command: str, wanted: str, reply: object) -> ProtocolError:
    shown = repr(reply)
    return ProtocolError(f"{command}: expected {wanted} from Redis, got "
                         f"{shown[:120]}{'...' if len(shown) > 120 else ''}")
