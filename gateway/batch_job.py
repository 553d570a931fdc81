"""The rq job behind `llmq batch`: fan a batch file into the request stream, gather, write.

rq is orchestration only. The job runs on an `llmq batch-worker` (an rq worker on the rq queue
`llmq-batch`); the tokens never pass through rq: requests go to `<prefix>:q:<queue>` like any
producer's, and the job reads their result streams like any consumer. Per job:

1. read the input file from `<prefix>:batch:<id>:input` and validate every line
   (`openai_batch.parse_line`); a bad line becomes an error line, the rest go on;
2. submit the valid lines with request ids `<batch_id>.<line>` (`<tenant>:<batch_id>.<line>` for
   a gateway tenant's batch) — idempotent, so an rq retry of the job does not queue a request
   twice — keeping at most `max_in_flight` unfinished at a time, so a large file does not flood
   the stream and a cancel leaves little to take back;
3. follow the results (`Client.follow_many`), with progress in the job's meta (OpenAI's names:
   `total`, `completed`, `failed`, and a `status`), saved every half second;
4. write the output and error lines, in input order, to the lists `<prefix>:batch:<id>:output`
   and `:errors` (TTL as the job's), from where `llmq batch results` writes the files.

Cancel (`<prefix>:batch:<id>:cancel` set by `llmq batch cancel` or the gateway): stop
submitting, cancel every unfinished request, wait a little for their `cancelled` answers, and
finish with what completed; the rest are error lines with code `batch_cancelled`.
The input is `<prefix>:batch:<id>:input` (`llmq batch submit`), or the uploaded file the gateway
names in `input_key`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec

from llmq.broker.client import Client
from llmq.broker.result_reader import FollowerGroup
from llmq.gateway.batch_store import RQ_URL_VAR
from llmq.gateway.openai_batch import (
    BatchLine,
    BatchLineError,
    error_record,
    failed_record,
    output_record,
    parse_line,
)
from llmq.protocol import Done

__all__ = ["BATCH_QUEUE", "BatchRun", "run_batch"]

logger = logging.getLogger(__name__)

BATCH_QUEUE = "llmq-batch"  # the rq queue `llmq batch-worker` serves
_SUBMIT_CHUNK = 256
_CANCEL_GRACE = 3.0  # s to wait for cancelled requests' final events
_META_INTERVAL = 0.5  # s between progress saves
_WRITE_CHUNK = 500
_json = msgspec.json.Encoder()


def run_batch(batch_id: str, prefix: str, queue: str, max_in_flight: int, ttl: int,
              tenant: str | None = None, input_key: str | None = None) -> dict[str, Any]:
    """rq entry point (arguments are JSON: the job is enqueued with rq's JSONSerializer)."""
    from rq import get_current_job

    job = get_current_job()
    assert job is not None, "run_batch runs inside an rq job"
    # NOTE: with rq on a Redis of its own (LLMQ_RQ_REDIS_URL), llmq's traffic goes to
    # LLMQ_REDIS_URL (a cluster, say); otherwise both share rq's connection.
    separate = bool(os.environ.get(RQ_URL_VAR, "").strip())
    client = (Client(prefix=prefix, queue=queue) if separate
              else Client(connection=job.connection, prefix=prefix, queue=queue))
    try:
        return BatchRun(client, batch_id, job, max_in_flight=max_in_flight, ttl=ttl,
                        tenant=tenant, input_key=input_key).run()
    finally:
        client.close()


class BatchRun:
    def __init__(self, client: Client, batch_id: str, job: Any, *, max_in_flight: int,
                 ttl: int, tenant: str | None = None, input_key: str | None = None) -> None:
        self.client = client
        self.keys = client.keys
        self.batch_id = batch_id
        self.job = job
        self.max_in_flight = max_in_flight
        self.ttl = ttl
        # NOTE: a tenant's requests live under `<tenant>:`, where only its key reaches them.
        self.id_prefix = f"{tenant}:" if tenant else ""
        self.input_key = input_key or self.keys.batch_input(batch_id)
        self.outputs: dict[int, dict[str, Any]] = {}  # line number -> output record
        self.errors: dict[int, dict[str, Any]] = {}  # line number -> error record
        self._saved_at = 0.0

    def request_id(self, number: int) -> str:
        return f"{self.id_prefix}{self.batch_id}.{number}"

    def public_id(self, request_id: str) -> str:
        """The id a batch output line shows: without the tenant."""
        return request_id.removeprefix(self.id_prefix)

    # -- the job ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        lines = self._read_lines()
        self._save(status="in_progress", total=len(lines), in_progress_at=int(time.time()),
                   force=True)
        valid = self._validate(lines)
        cancelled = self._fan_out_and_gather(valid)
        self._save(status="finalizing", force=True)
        self._write_results()
        status = "cancelled" if cancelled else "completed"
        self._save(status=status, force=True, **{f"{status}_at": int(time.time())})
        logger.info("batch %s %s: %d completed, %d failed", self.batch_id, status,
                    len(self.outputs), len(self.errors))
        return {"status": status, "total": len(lines), "completed": len(self.outputs),
                "failed": len(self.errors)}

    def _read_lines(self) -> list[tuple[int, str]]:
        data = self.client.redis.get(self.input_key)
        if data is None:
            raise RuntimeError(f"the input of batch {self.batch_id} is gone (expired?)")
        text = data.decode("utf-8", errors="replace")
        return [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]

    def _validate(self, lines: list[tuple[int, str]]) -> list[BatchLine]:
        valid, seen = [], {}
        for number, text in lines:
            try:
                line = parse_line(text, number)
            except BatchLineError as exc:
                self._error(number, exc.custom_id, "invalid_request", f"line {number}: {exc}")
                continue
            if line.custom_id in seen:
                self._error(number, line.custom_id, "duplicate_custom_id",
                            f"line {number}: custom_id {line.custom_id!r} is already used on "
                            f"line {seen[line.custom_id]}")
                continue
            seen[line.custom_id] = number
            valid.append(line)
        return valid

    def _fan_out_and_gather(self, valid: list[BatchLine]) -> bool:
        """Submit with a bounded window and gather; True if the batch was cancelled."""
        gatherer = self.client.follow_many()
        try:
            return self._fan_out(gatherer, valid)
        finally:
            gatherer.close()

    def _fan_out(self, gatherer: FollowerGroup, valid: list[BatchLine]) -> bool:
        by_request_id: dict[str, BatchLine] = {}
        next_line = 0
        while True:
            if self._cancel_requested():
                self._cancel(gatherer, by_request_id, valid[next_line:])
                return True
            while next_line < len(valid) and len(gatherer) < self.max_in_flight:
                room = min(_SUBMIT_CHUNK, self.max_in_flight - len(gatherer))
                chunk = valid[next_line:next_line + room]
                bodies = [{**line.request, "id": self.request_id(line.number), "stream": False}
                          for line in chunk]
                gatherer.add(self.client.submit_many(bodies))
                by_request_id.update((self.request_id(line.number), line) for line in chunk)
                next_line += len(chunk)
                self._save(submitted=next_line)
            if not gatherer:
                return False
            for transcript in gatherer.poll(block_ms=250):
                self._finished(by_request_id[transcript.request_id], transcript)
            self._save()

    def _finished(self, line: BatchLine, transcript: Any) -> None:
        final = transcript.final
        request_id = self.public_id(transcript.request_id)
        if isinstance(final, Done):
            if final.finish_reason == "cancelled":
                self._error(line.number, line.custom_id, "batch_cancelled",
                            "the request was cancelled", request_id)
            else:
                model = transcript.start.model if transcript.start is not None else ""
                self.outputs[line.number] = output_record(line, request_id, final, model)
        else:
            self.errors[line.number] = failed_record(line, request_id, final)

    def _cancel(self, gatherer: FollowerGroup, by_request_id: dict[str, BatchLine],
                not_submitted: list[BatchLine]) -> None:
        self._save(status="cancelling", force=True)
        for request_id in gatherer.pending_ids():
            self.client.cancel(request_id)
        deadline = time.monotonic() + _CANCEL_GRACE
        while gatherer and time.monotonic() < deadline:
            for transcript in gatherer.poll(block_ms=250):
                self._finished(by_request_id[transcript.request_id], transcript)
        for request_id in gatherer.pending_ids():
            line = by_request_id[request_id]
            self._error(line.number, line.custom_id, "batch_cancelled",
                        "the batch was cancelled before this request finished",
                        self.public_id(request_id))
        for line in not_submitted:
            self._error(line.number, line.custom_id, "batch_cancelled",
                        "the batch was cancelled before this request was submitted")

    def _cancel_requested(self) -> bool:
        return bool(self.client.redis.exists(self.keys.batch_cancel(self.batch_id)))

    def _error(self, number: int, custom_id: str | None, code: str, message: str,
               request_id: str | None = None) -> None:
        self.errors[number] = error_record(request_id or self.public_id(self.request_id(number)),
                                           number, custom_id, code, message)

    # -- progress and results ---------------------------------------------------------------------

    def _save(self, *, force: bool = False, **fields: Any) -> None:
        now = time.monotonic()
        self.job.meta.update(fields)
        if force or now - self._saved_at >= _META_INTERVAL:
            self.job.meta.update(completed=len(self.outputs), failed=len(self.errors))
            self.job.save_meta()
            self._saved_at = now

    def _write_results(self) -> None:
        pipe = self.client.redis.pipeline(transaction=True)
        for key, records in ((self.keys.batch_output(self.batch_id), self.outputs),
                             (self.keys.batch_errors(self.batch_id), self.errors)):
            pipe.delete(key)  # an rq retry of the job rewrites them whole
            lines = [_json.encode(records[n]) for n in sorted(records)]
            for start in range(0, len(lines), _WRITE_CHUNK):
                pipe.rpush(key, *lines[start:start + _WRITE_CHUNK])
            pipe.expire(key, self.ttl)
        pipe.execute()
