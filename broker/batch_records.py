"""BatchRecords: what llmq keeps in Redis of an OpenAI-format batch, as exchanges.

    <prefix>:batch:{<batch_id>}:input    list    the input file `llmq batch submit` stored, in
                                                 pieces (broker/pieced_bytes.py), TTL
    <prefix>:batch:{<batch_id>}:output   list    output lines in input order, TTL
    <prefix>:batch:{<batch_id>}:errors   list    error lines in input order, TTL
    <prefix>:batch:{<batch_id>}:cancel   string  the cancel flag the batch's job checks, TTL
    <prefix>:batch:{<batch_id>}:lines    hash    checkpoint: run line index -> finished record, TTL
    <prefix>:batch:{<batch_id>}:lease    string  the running job's token, PX, renewed as it runs
    <prefix>:batches:{<tenant>}          zset    a gateway tenant's batch ids by creation time

The job itself (its status and progress) is rq's: gateway/batch_store.py. A batch's output and
errors share the batch's slot, so a job (or its rq retry) rewrites them in one transaction.

The checkpoint is what lets a batch survive its worker: each line's record is saved under its
index as it finishes (an output line is stored as `o<json>`, an error line as `e<json>`), so a
rerun of the job (an rq retry, or another batch worker taking over an abandoned one) keeps those
and resubmits only the rest, under the same request ids. Saving by index makes it exactly once
whatever happens: two runs of one batch write the same record to the same field. The lease says
a run is alive; a batch whose job is `started` in rq but holds no lease was abandoned.
"""

from __future__ import annotations

from typing import Any

from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys
from llmq.broker.pieced_bytes import parse_pieces, queue_read_pieces, queue_store_pieces
from llmq.protocol import as_str

__all__ = ["BatchRecords"]

_WRITE_CHUNK = 500  # lines per RPUSH
_CANCEL_FLAG = b"1"


def _none(_: list[Any]) -> None:
    return None


class BatchRecords:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    # -- the input ------------------------------------------------------------------------------

    def store_input(self, batch_id: str, data: bytes, ttl: int) -> Exchange[None]:
        return Exchange(lambda pipe: queue_store_pieces(pipe, self.keys.batch_input(batch_id),
                                                        data, ttl), _none, transaction=True)

    def input(self, key: str) -> Exchange[bytes | None]:
        """The input file at `key`: `keys.batch_input(batch_id)`, or the gateway file a
        tenant's batch names (`keys.file(tenant, file_id)`); None once it has expired."""
        return Exchange(lambda pipe: queue_read_pieces(pipe, key), parse_pieces,
                        raise_on_error=False)

    # -- cancelling -----------------------------------------------------------------------------

    def request_cancel(self, batch_id: str, ttl: int) -> Exchange[None]:
        return Exchange(lambda pipe: pipe.set(self.keys.batch_cancel(batch_id), _CANCEL_FLAG,
                                              ex=ttl), _none)

    def cancel_requested(self, batch_id: str) -> Exchange[bool]:
        return Exchange(lambda pipe: pipe.exists(self.keys.batch_cancel(batch_id)),
                        lambda replies: bool(replies[0]))

    # -- the checkpoint and the lease -----------------------------------------------------------

    def save_lines(self, batch_id: str, records: dict[int, bytes], ttl: int) -> Exchange[None]:
        """Records of finished lines, by run line index (`o`/`e` + the JSON line)."""
        def queue(pipe: Any) -> None:
            key = self.keys.batch_lines(batch_id)
            items = list(records.items())
            for start in range(0, len(items), _WRITE_CHUNK):
                pipe.hset(key, mapping=dict(items[start:start + _WRITE_CHUNK]))
            pipe.expire(key, ttl)

        return Exchange(queue, _none)

    def saved_lines(self, batch_id: str, cursor: int = 0
                    ) -> Exchange[tuple[int, dict[int, bytes]]]:
        """One HSCAN page of the checkpoint: (next cursor, 0 when done; {index: record})."""
        def parse(replies: list[Any]) -> tuple[int, dict[int, bytes]]:
            next_cursor, page = replies[0]
            return int(next_cursor), {int(k): bytes(v) for k, v in page.items()}

        return Exchange(lambda pipe: pipe.hscan(self.keys.batch_lines(batch_id), cursor,
                                                count=_WRITE_CHUNK), parse)

    def hold_lease(self, batch_id: str, token: str, ttl_ms: int) -> Exchange[None]:
        return Exchange(lambda pipe: pipe.set(self.keys.batch_lease(batch_id), token,
                                              px=ttl_ms), _none)

    def lease_holder(self, batch_id: str) -> Exchange[str | None]:
        """The token of the run that holds the batch; None when no run is alive."""
        return Exchange(lambda pipe: pipe.get(self.keys.batch_lease(batch_id)),
                        lambda replies: None if replies[0] is None else as_str(replies[0]))

    def release_lease(self, batch_id: str) -> Exchange[None]:
        return Exchange(lambda pipe: pipe.delete(self.keys.batch_lease(batch_id)), _none)

    # -- rq's started registry (a batch worker rescuing an abandoned batch) -----------------------

    def registry_members(self, registry_key: str) -> Exchange[list[str]]:
        """The `<job id>:<execution id>` members of one of rq's job registries."""
        return Exchange(lambda pipe: pipe.zrange(registry_key, 0, -1),
                        lambda replies: [as_str(m) for m in replies[0]])

    def cap_ttl(self, key: str, seconds: int) -> Exchange[None]:
        """Shorten `key`'s TTL to at most `seconds` (a longer one only: EXPIRE ... LT)."""
        return Exchange(lambda pipe: pipe.expire(key, seconds, lt=True), _none)

    def lapse(self, registry_key: str, member: str) -> Exchange[None]:
        """Mark an execution's heartbeat as lapsed long ago, for rq's cleanup to act on it."""
        return Exchange(lambda pipe: pipe.zadd(registry_key, {member: 1}, xx=True), _none)

    # -- the results ----------------------------------------------------------------------------

    def write_results(self, batch_id: str, outputs: list[bytes], errors: list[bytes],
                      ttl: int) -> Exchange[None]:
        """Both lists replaced whole (an rq retry of the job rewrites them), kept `ttl` s."""
        def queue(pipe: Any) -> None:
            for key, lines in ((self.keys.batch_output(batch_id), outputs),
                               (self.keys.batch_errors(batch_id), errors)):
                pipe.delete(key)
                for start in range(0, len(lines), _WRITE_CHUNK):
                    pipe.rpush(key, *lines[start:start + _WRITE_CHUNK])
                pipe.expire(key, ttl)

        return Exchange(queue, _none, transaction=True)

    def output(self, batch_id: str) -> Exchange[list[bytes]]:
        return Exchange(lambda pipe: pipe.lrange(self.keys.batch_output(batch_id), 0, -1),
                        lambda replies: list(replies[0]))

    def errors(self, batch_id: str) -> Exchange[list[bytes]]:
        return Exchange(lambda pipe: pipe.lrange(self.keys.batch_errors(batch_id), 0, -1),
                        lambda replies: list(replies[0]))

    def results(self, batch_id: str) -> Exchange[tuple[list[bytes], list[bytes]]]:
        """(output lines, error lines) a finished batch wrote, in one round trip."""
        output, errors = self.output(batch_id), self.errors(batch_id)

        def queue(pipe: Any) -> None:
            output.queue(pipe)
            errors.queue(pipe)

        return Exchange(queue, lambda replies: (output.parse(replies[:1]),
                                                errors.parse(replies[1:])))

    # -- a gateway tenant's index ---------------------------------------------------------------

    def index(self, tenant: str, batch_id: str, created_at: int, ttl: int) -> Exchange[None]:
        def queue(pipe: Any) -> None:
            pipe.zadd(self.keys.tenant_batches(tenant), {batch_id: created_at})
            pipe.expire(self.keys.tenant_batches(tenant), ttl)

        return Exchange(queue, _none)

    def tenant_batch_ids(self, tenant: str) -> Exchange[list[str]]:
        """The tenant's batch ids, newest first (rq may have dropped some since)."""
        return Exchange(lambda pipe: pipe.zrevrange(self.keys.tenant_batches(tenant), 0, -1),
                        lambda replies: [as_str(i) for i in replies[0]])
