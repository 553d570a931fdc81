"""The rq job behind `llmq batch` and the Batch API: a batch file through the queue, in order.

rq is orchestration only. The job runs on an `llmq batch-worker` (an rq worker on the rq queue
`llmq-batch`); the tokens never pass through rq: requests go to `<prefix>:q:<queue>` like any
producer's, and the job reads their result streams like any consumer. Per job:

1. read the input file from `<prefix>:batch:<id>:input` and validate every line
   (`openai_batch.parse_line`); a bad line becomes an error line, the rest go on;
2. submit the valid lines with request ids `<batch_id>.<line>` (`<tenant>:<batch_id>.<line>` for
   a gateway tenant's batch) — idempotent, so an rq retry of the job does not queue a request
   twice — keeping at most `max_in_flight` unfinished at a time, so a large file does not flood
   the stream and a cancel leaves little to take back;
3. follow the results, with progress in the job's meta (OpenAI's names: `total`, `completed`,
   `failed`, and a `status`), saved every half second;
4. write the output and error lines, in input order, to the lists `<prefix>:batch:<id>:output`
   and `:errors` (TTL as the job's), from where `llmq batch results` writes the files.

Steps 2 and 3, and the order of the lines, are the `OrderedRun`'s (broker/ordered_run.py, the
runner `llmq submit -f` uses too); `BatchRun` is its adapter, and its Redis keys are
`llmq.broker.batch_records`'.

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

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.broker.ordered_run import OrderedRun, RunEnd, Settled, Submit
from llmq.broker.transcript import Transcript
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
_CANCEL_GRACE = 3.0  # s to wait for cancelled requests' final events
_META_INTERVAL = 0.5  # s between progress saves
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


Record = tuple[bool, dict[str, Any]]  # (an output line, else an error line; the line)


class BatchRun:
    """The batch adapter of the `OrderedRun` (its `RunSink`): OpenAI batch lines in, output
    and error lines out, progress in the rq job's meta."""

    def __init__(self, client: Client, batch_id: str, job: Any, *, max_in_flight: int,
                 ttl: int, tenant: str | None = None, input_key: str | None = None) -> None:
        self.client = client
        self.records = BatchRecords(client.keys)
        self.batch_id = batch_id
        self.job = job
        self.max_in_flight = max_in_flight
        self.ttl = ttl
        # NOTE: a tenant's requests live under `<tenant>:`, where only its key reaches them.
        self.id_prefix = f"{tenant}:" if tenant else ""
        self.input_key = input_key or client.keys.batch_input(batch_id)
        self.lines: list[tuple[int, str | None]] = []  # per run line: (number, custom_id)
        self._batch_lines: dict[int, BatchLine] = {}  # run line -> its request, when valid
        self.outputs: list[bytes] = []  # output lines, in input order
        self.errors: list[bytes] = []  # error lines, in input order
        self.completed = 0  # lines with an output record (counted as they end)
        self.failed = 0  # lines with an error record
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
        run = OrderedRun(self.client, self._validate(lines), self,
                         max_in_flight=self.max_in_flight, cancel_grace=_CANCEL_GRACE)
        cancelled = run.run() is RunEnd.CANCELLED
        self._save(status="finalizing", force=True)
        send(self.client, self.records.write_results(self.batch_id, self.outputs, self.errors,
                                                     self.ttl))
        status = "cancelled" if cancelled else "completed"
        self._save(status=status, force=True, **{f"{status}_at": int(time.time())})
        logger.info("batch %s %s: %d completed, %d failed", self.batch_id, status,
                    self.completed, self.failed)
        return {"status": status, "total": len(lines), "completed": self.completed,
                "failed": self.failed}

    def _read_lines(self) -> list[tuple[int, str]]:
        data = send(self.client, self.records.input(self.input_key))
        if data is None:
            raise RuntimeError(f"the input of batch {self.batch_id} is gone (expired?)")
        text = data.decode("utf-8", errors="replace")
        return [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]

    def _validate(self, lines: list[tuple[int, str]]) -> list[Submit | Settled[Record]]:
        """Each line a request to run, or its error line when it cannot run."""
        run_lines: list[Submit | Settled[Record]] = []
        seen: dict[str, int] = {}
        for number, text in lines:
            try:
                line = parse_line(text, number)
            except BatchLineError as exc:
                self.lines.append((number, exc.custom_id))
                run_lines.append(Settled(self._error(len(self.lines) - 1, "invalid_request",
                                                     f"line {number}: {exc}")))
                continue
            self.lines.append((number, line.custom_id))
            if line.custom_id in seen:
                run_lines.append(Settled(self._error(
                    len(self.lines) - 1, "duplicate_custom_id",
                    f"line {number}: custom_id {line.custom_id!r} is already used on line "
                    f"{seen[line.custom_id]}")))
                continue
            seen[line.custom_id] = number
            self._batch_lines[len(self.lines) - 1] = line
            request_id = self.request_id(number)
            run_lines.append(Submit(request_id, {**line.request, "id": request_id,
                                                 "stream": False}))
        return run_lines

    def _error(self, index: int, code: str, message: str,
               request_id: str | None = None) -> Record:
        number, custom_id = self.lines[index]
        self.failed += 1
        return False, error_record(request_id or self.public_id(self.request_id(number)),
                                   number, custom_id, code, message)

    # -- the RunSink of the OrderedRun ------------------------------------------------------------

    def finished(self, index: int, transcript: Transcript) -> Record:
        line = self._batch_lines[index]
        final = transcript.final
        request_id = self.public_id(transcript.request_id)
        if isinstance(final, Done):
            if final.finish_reason == "cancelled":
                return self._error(index, "batch_cancelled", "the request was cancelled",
                                   request_id)
            model = transcript.start.model if transcript.start is not None else ""
            self.completed += 1
            return True, output_record(line, request_id, final, model)
        assert final is not None
        self.failed += 1
        return False, failed_record(line, request_id, final)

    def not_run(self, index: int, *, submitted: bool) -> Record:
        if submitted:
            return self._error(index, "batch_cancelled",
                               "the batch was cancelled before this request finished")
        return self._error(index, "batch_cancelled",
                           "the batch was cancelled before this request was submitted")

    def write(self, record: Record) -> None:
        is_output, line = record
        (self.outputs if is_output else self.errors).append(_json.encode(line))

    def tick(self, submitted: int) -> None:
        self._save(submitted=submitted)

    def stop_requested(self) -> bool:
        if send(self.client, self.records.cancel_requested(self.batch_id)):
            self._save(status="cancelling", force=True)
            return True
        return False

    # -- progress ---------------------------------------------------------------------------------

    def _save(self, *, force: bool = False, **fields: Any) -> None:
        now = time.monotonic()
        self.job.meta.update(fields)
        if force or now - self._saved_at >= _META_INTERVAL:
            self.job.meta.update(completed=self.completed, failed=self.failed)
            self.job.save_meta()
            self._saved_at = now
