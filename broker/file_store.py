"""FileStore: a gateway tenant's files in Redis, as exchanges (`llmq.broker.exchange`).

    <prefix>:file:{<tenant>}:<file_id>        the uploaded bytes, in pieces (broker/
                                              pieced_bytes.py), TTL
    <prefix>:file:{<tenant>}:<file_id>:meta   its record (name, purpose, size, times; for a
                                              batch's output or error file: the batch), TTL
    <prefix>:files:{<tenant>}                 the tenant's file ids by creation time

A file, its record and the index share the tenant's slot, so each write is one transaction.
A batch's output and error files are records only: their content is the batch's lists
(`BatchRecords`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmq.broker.batch_records import BatchRecords
from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys
from llmq.broker.pieced_bytes import parse_pieces, queue_read_pieces, queue_store_pieces
from llmq.protocol import as_str

__all__ = ["FileMeta", "FileStore"]

FileMeta = dict[str, str]  # a file's record, as stored (every value a string)
_LIST_LIMIT = 10_000  # file ids a listing reads


def _none(_: list[Any]) -> None:
    return None


class FileStore:
    def __init__(self, keys: Keys, tenant: str) -> None:
        self.keys = keys
        self.tenant = tenant

    def create(self, file_id: str, data: bytes, meta: Mapping[str, str | int], ttl: int,
               created_at: int) -> Exchange[None]:
        """Store an upload, its record and its place in the index, all for `ttl` s."""
        def queue(pipe: Any) -> None:
            queue_store_pieces(pipe, self.keys.file(self.tenant, file_id), data, ttl)
            self._queue_record(pipe, file_id, meta, ttl, created_at)
            pipe.expire(self.keys.tenant_files(self.tenant), ttl)

        return Exchange(queue, _none, transaction=True)

    def record(self, file_id: str, meta: Mapping[str, str | int], ttl: int,
               created_at: int) -> Exchange[None]:
        """A record without content of its own (a batch's output or error file)."""
        return Exchange(lambda pipe: self._queue_record(pipe, file_id, meta, ttl, created_at),
                        _none, transaction=True)

    def _queue_record(self, pipe: Any, file_id: str, meta: Mapping[str, str | int], ttl: int,
                      created_at: int) -> None:
        pipe.hset(self.keys.file_meta(self.tenant, file_id), mapping=dict(meta))
        pipe.expire(self.keys.file_meta(self.tenant, file_id), ttl)
        pipe.zadd(self.keys.tenant_files(self.tenant), {file_id: created_at})

    def meta(self, file_id: str) -> Exchange[FileMeta | None]:
        """The file's record; None when the tenant has none of that id (or it expired)."""
        return Exchange(lambda pipe: pipe.hgetall(self.keys.file_meta(self.tenant, file_id)),
                        lambda replies: _meta(replies[0]))

    def metas(self, file_ids: list[str]) -> Exchange[list[FileMeta | None]]:
        """`meta` of each id, in one round trip."""
        def queue(pipe: Any) -> None:
            for file_id in file_ids:
                pipe.hgetall(self.keys.file_meta(self.tenant, file_id))

        return Exchange(queue, lambda replies: [_meta(raw) for raw in replies])

    def content(self, meta: FileMeta) -> Exchange[bytes | None]:
        """The file's bytes (a batch's file: its lines); None when they have expired."""
        if "batch" in meta:
            records = BatchRecords(self.keys)
            lines = (records.output(meta["batch"]) if meta["kind"] == "output"
                     else records.errors(meta["batch"]))
            return Exchange(lines.queue,
                            lambda replies: b"".join(line + b"\n"
                                                     for line in lines.parse(replies)))
        key = self.keys.file(self.tenant, meta["id"])
        return Exchange(lambda pipe: queue_read_pieces(pipe, key), parse_pieces,
                        raise_on_error=False)

    def delete(self, file_id: str) -> Exchange[None]:
        """The file, its record and its place in the index gone."""
        def queue(pipe: Any) -> None:
            pipe.delete(self.keys.file(self.tenant, file_id),
                        self.keys.file_meta(self.tenant, file_id))
            pipe.zrem(self.keys.tenant_files(self.tenant), file_id)

        return Exchange(queue, _none, transaction=True)

    def ids(self) -> Exchange[list[str]]:
        """The tenant's file ids, newest first (records may have expired since)."""
        return Exchange(lambda pipe: pipe.zrevrange(self.keys.tenant_files(self.tenant), 0,
                                                    _LIST_LIMIT - 1),
                        lambda replies: [as_str(i) for i in replies[0]])


def _meta(raw: Any) -> FileMeta | None:
    return {as_str(k): as_str(v) for k, v in raw.items()} if raw else None
