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
   `failed`, and a `status`), saved every half second together with the checkpoint: the record
   of every line that finished since (`BatchRecords.save_lines`) and the run's lease;
4. write the output and error lines, in input order, to the lists `<prefix>:batch:<id>:output`
   and `:errors` (TTL as the job's), from where `llmq batch results` writes the files.

Surviving the batch worker: a run starts from the checkpoint, so an rq retry (the job is
enqueued with retries and backoff) or another batch worker taking over an abandoned batch
(`BatchStore.rescue_abandoned`: the job is `started` but its lease has lapsed) keeps every line
already recorded, resubmits the rest under the same ids (which follows the requests an earlier
run queued, finished or not), and writes each `custom_id` once. A batch still running at its
deadline (created + its completion window) ends `expired` with what it has: the lines without a
result get error lines with code `batch_expired`.

Steps 2 and 3, and the order of the lines, are the `OrderedRun`'s (broker/ordered_run.py, the
runner `llmq submit -f` uses too); `BatchRun` is its adapter, and its Redis keys are
`llmq.broker.batch_records`'.

Validation, as OpenAI's: the batch ends `failed`, nothing run, with `errors` in the job's meta
(OpenAI's `errors.data`: `code`, `message`, `param`, `line`) when the file is empty or not JSONL
(`invalid_json_line`), when a line's `url` is not the gateway batch's `endpoint`
(`invalid_url`), when a line names a model no live worker of the queue serves
(`model_not_found`, the gateway's rule: `pool_view.names_model`), or when no line can run.
Other invalid lines (a bad field) become error lines and the rest run.

Cancel (`<prefix>:batch:<id>:cancel` set by `llmq batch cancel` or the gateway): stop
submitting, cancel every unfinished request, wait a little for their `cancelled` answers, and
finish with what completed; the rest are error lines with code `batch_cancelled`.
The input is `<prefix>:batch:<id>:input` (`llmq batch submit`), or the uploaded file the gateway
names in `input_key`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client, client_for_rq_job
from llmq.broker.exchange import send
from llmq.broker.ordered_run import OrderedRun, RunEnd, Settled, Submit
from llmq.broker.transcript import Transcript
from llmq.gateway.openai_batch import (
    INVALID_JSON,
    BatchLine,
    BatchLineError,
    batch_error,
    error_record,
    failed_record,
    output_record,
    parse_line,
)
from llmq.gateway.pool_view import adapters_of, names_model
from llmq.protocol import Done

__all__ = ["BATCH_QUEUE", "LEASE_MS", "BatchRun", "checkpointed_results", "load_checkpoint",
           "run_batch"]

logger = logging.getLogger(__name__)

BATCH_QUEUE = "llmq-batch"  # the rq queue `llmq batch-worker` serves
_CANCEL_GRACE = 3.0  # s to wait for cancelled requests' final events
_META_INTERVAL = 0.5  # s between progress saves (and checkpoints, and lease renewals)
_MAX_ERRORS = 100  # entries of a failed batch's `errors` kept (they live in the job's meta)
LEASE_MS = 15_000  # a run's lease lapses this long after its last renewal
_OUTPUT, _ERROR = b"o", b"e"  # how a checkpointed record says which file it belongs in
_json = msgspec.json.Encoder()


def run_batch(batch_id: str, prefix: str, queue: str, max_in_flight: int, ttl: int,
              tenant: str | None = None, input_key: str | None = None,
              deadline: float | None = None) -> dict[str, Any]:
    """rq entry point (arguments are JSON: the job is enqueued with rq's JSONSerializer)."""
    from rq import get_current_job

    job = get_current_job()
    assert job is not None, "run_batch runs inside an rq job"
    client = client_for_rq_job(job.connection, prefix=prefix, queue=queue)
    try:
        return BatchRun(client, batch_id, job, max_in_flight=max_in_flight, ttl=ttl,
                        tenant=tenant, input_key=input_key, deadline=deadline).run()
    finally:
        client.close()


Record = tuple[bool, bytes]  # (an output line, else an error line; the JSON line)


def load_checkpoint(client: Client, batch_id: str) -> dict[int, Record]:
    """The records a batch's runs have checkpointed, by run line index."""
    records = BatchRecords(client.keys)
    saved: dict[int, Record] = {}
    cursor = 0
    while True:
        cursor, page = send(client, records.saved_lines(batch_id, cursor))
        saved.update({index: (data[:1] == _OUTPUT, data[1:]) for index, data in page.items()})
        if cursor == 0:
            return saved


def checkpointed_results(client: Client, batch_id: str) -> tuple[list[bytes], list[bytes]]:
    """(output lines, error lines) of what a batch's checkpoint has, in input order."""
    saved = sorted(load_checkpoint(client, batch_id).items())
    return ([line for _, (is_output, line) in saved if is_output],
            [line for _, (is_output, line) in saved if not is_output])


class BatchRun:
    """The batch adapter of the `OrderedRun` (its `RunSink`): OpenAI batch lines in, output
    and error lines out, progress in the rq job's meta."""

    def __init__(self, client: Client, batch_id: str, job: Any, *, max_in_flight: int,
                 ttl: int, tenant: str | None = None, input_key: str | None = None,
                 deadline: float | None = None) -> None:
        self.client = client
        self.records_store = BatchRecords(client.keys)
        self.batch_id = batch_id
        self.job = job
        self.max_in_flight = max_in_flight
        self.ttl = ttl
        # NOTE: a tenant's requests live under `<tenant>:`, where only its key reaches them.
        self.id_prefix = f"{tenant}:" if tenant else ""
        self.input_key = input_key or client.keys.batch_input(batch_id)
        self.lines: list[tuple[int, str | None]] = []  # per run line: (number, custom_id)
        self._batch_lines: dict[int, BatchLine] = {}  # run line -> its request, when valid
        self._invalid: list[tuple[int, str, str]] = []  # (number, code, message) refused
        self.deadline = deadline  # unix s: past it the batch ends `expired`
        self.records: dict[int, Record] = {}  # run line -> its record, as they become known
        self._unsaved: dict[int, bytes] = {}  # records not checkpointed yet
        self.token = uuid.uuid4().hex  # this run's lease
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
        self._hold_lease()
        lines = self._read_lines()
        saved = self._load_checkpoint()
        run_lines = self._validate(lines)
        # NOTE: the models are checked on a first run only: a batch that has started does not
        # fail later because the workers serving its model are gone for a moment.
        refused = self._file_errors(check_models=not saved)
        if refused:
            return self._fail(refused, len(lines))
        run_lines = self._resume(run_lines, saved)
        if self.records:
            logger.warning("batch %s resumes: %d of %d lines recorded already", self.batch_id,
                           len(self.records), len(lines))
        self._save(status="in_progress", total=len(lines), force=True,
                   in_progress_at=self.job.meta.get("in_progress_at") or int(time.time()))
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.time())
        end = OrderedRun(self.client, run_lines, self, max_in_flight=self.max_in_flight,
                         timeout=timeout, cancel_grace=_CANCEL_GRACE).run()
        if end is RunEnd.TIMED_OUT:
            for index in range(len(self.lines)):
                if index not in self.records:
                    if index in self._batch_lines:  # queued, maybe running: nobody waits now
                        self.client.cancel(self.request_id(self.lines[index][0]))
                    self._settle(index, self._error(
                        index, "batch_expired",
                        "the batch's completion window ended before this request finished"))
        self._save(status="finalizing", finalizing_at=int(time.time()), force=True)
        outputs = [line for _, (is_output, line) in sorted(self.records.items()) if is_output]
        errors = [line for _, (is_output, line) in sorted(self.records.items()) if not is_output]
        send(self.client, self.records_store.write_results(self.batch_id, outputs, errors,
                                                           self.ttl))
        status = {RunEnd.COMPLETED: "completed", RunEnd.CANCELLED: "cancelled",
                  RunEnd.TIMED_OUT: "expired"}[end]
        self._save(status=status, force=True, **{f"{status}_at": int(time.time())})
        send(self.client, self.records_store.release_lease(self.batch_id))
        logger.info("batch %s %s: %d completed, %d failed", self.batch_id, status,
                    self.completed, self.failed)
        return {"status": status, "total": len(lines), "completed": self.completed,
                "failed": self.failed}

    def _file_errors(self, *, check_models: bool) -> list[dict[str, Any]]:
        """Why the whole batch cannot run, as OpenAI's validation says it (`errors.data`): a
        file that is not JSONL, a line for another endpoint than the batch's, a model no worker
        of the queue serves, or no line that could run; [] when it can."""
        if not self.lines:
            return [batch_error("empty_file", "the batch input file has no lines")]
        errors = [batch_error(code, message, number)
                  for number, code, message in self._invalid if code == INVALID_JSON]
        endpoint = self.job.meta.get("endpoint")  # a gateway batch's; `llmq batch` mixes both
        served = self._served_models() if check_models else []
        for line in self._batch_lines.values():
            if endpoint and line.url != endpoint:
                errors.append(batch_error(
                    "invalid_url", f"line {line.number}: the url {line.url} is not the "
                    f"batch's endpoint {endpoint}", line.number, "url"))
            if served and not any(names_model(line.model, name) for name in served):
                errors.append(batch_error(
                    "model_not_found", f"line {line.number}: the model `{line.model}` does not "
                    f"exist or no worker of queue {self.client.settings.queue!r} serves it "
                    f"(served: {', '.join(served)})", line.number, "body.model"))
        if not errors and not self._batch_lines:  # every line refused: nothing would run
            errors = [batch_error(code, message, number)
                      for number, code, message in self._invalid]
        return errors[:_MAX_ERRORS]

    def _served_models(self) -> list[str]:
        """The models the live workers of the batch's queue serve; [] when none is live, and
        then nothing is checked: the requests wait for workers as any producer's do."""
        workers = [w for w in self.client.workers()
                   if w.queue == self.client.settings.queue and w.model]
        # a LoRA adapter a worker lists is served as a model of its own (pool_view.py)
        return sorted({w.model for w in workers} | {a for w in workers for a in adapters_of(w)})

    def _fail(self, errors: list[dict[str, Any]], total: int) -> dict[str, Any]:
        """End the batch `failed` before anything ran, with OpenAI's `errors` list."""
        self.completed = self.failed = 0
        self._save(status="failed", total=total, failed_at=int(time.time()),
                   errors=errors, force=True)
        send(self.client, self.records_store.release_lease(self.batch_id))
        logger.warning("batch %s failed validation: %s", self.batch_id, errors[0]["message"])
        return {"status": "failed", "total": total, "completed": 0, "failed": 0}

    def _hold_lease(self) -> None:
        send(self.client, self.records_store.hold_lease(self.batch_id, self.token, LEASE_MS))

    def _load_checkpoint(self) -> dict[int, Record]:
        return load_checkpoint(self.client, self.batch_id)

    def _resume(self, run_lines: list[Submit | Settled[Record]], saved: dict[int, Record]
                ) -> list[Submit | Settled[Record]]:
        """The lines with their checkpointed records settled: those are not run again."""
        for index, record in saved.items():
            if index < len(run_lines) and isinstance(run_lines[index], Submit):
                run_lines[index] = Settled(self._settle(index, record, save=False))
        return run_lines

    def _read_lines(self) -> list[tuple[int, str]]:
        data = send(self.client, self.records_store.input(self.input_key))
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
                self._invalid.append((number, exc.code, f"line {number}: {exc}"))
                self.lines.append((number, exc.custom_id))
                index = len(self.lines) - 1
                run_lines.append(Settled(self._settle(index, self._error(
                    index, "invalid_request", f"line {number}: {exc}"), save=False)))
                continue
            self.lines.append((number, line.custom_id))
            if line.custom_id in seen:
                index = len(self.lines) - 1
                run_lines.append(Settled(self._settle(index, self._error(
                    index, "duplicate_custom_id",
                    f"line {number}: custom_id {line.custom_id!r} is already used on line "
                    f"{seen[line.custom_id]}"), save=False)))
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
        return False, _json.encode(error_record(
            request_id or self.public_id(self.request_id(number)), number, custom_id, code,
            message))

    def _settle(self, index: int, record: Record, *, save: bool = True) -> Record:
        """Line `index` has its record: counted, kept, and checkpointed when `save`."""
        self.records[index] = record
        if record[0]:
            self.completed += 1
        else:
            self.failed += 1
        if save:
            self._unsaved[index] = (_OUTPUT if record[0] else _ERROR) + record[1]
        return record

    # -- the RunSink of the OrderedRun ------------------------------------------------------------

    def finished(self, index: int, transcript: Transcript) -> Record:
        return self._settle(index, self._record_of(index, transcript))

    def _record_of(self, index: int, transcript: Transcript) -> Record:
        line = self._batch_lines[index]
        final = transcript.final
        request_id = self.public_id(transcript.request_id)
        if isinstance(final, Done):
            if final.finish_reason == "cancelled":
                return self._error(index, "batch_cancelled", "the request was cancelled",
                                   request_id)
            model = transcript.start.model if transcript.start is not None else ""
            return True, _json.encode(output_record(line, request_id, final, model))
        assert final is not None
        return False, _json.encode(failed_record(line, request_id, final))

    def not_run(self, index: int, *, submitted: bool) -> Record:
        when = "finished" if submitted else "was submitted"
        return self._settle(index, self._error(
            index, "batch_cancelled", f"the batch was cancelled before this request {when}"))

    def write(self, record: Record) -> None:
        """Nothing to do: records are kept by line as they end (`self.records`), and written
        in input order once the run is over."""

    def tick(self, submitted: int) -> None:
        self._save(submitted=submitted)

    def stop_requested(self) -> bool:
        if send(self.client, self.records_store.cancel_requested(self.batch_id)):
            self._save(status="cancelling", force=True)
            return True
        return False

    # -- progress ---------------------------------------------------------------------------------

    def _save(self, *, force: bool = False, **fields: Any) -> None:
        now = time.monotonic()
        self.job.meta.update(fields)
        if force or now - self._saved_at >= _META_INTERVAL:
            # NOTE: the checkpoint before the meta: progress shown is never ahead of it.
            if self._unsaved:
                send(self.client, self.records_store.save_lines(self.batch_id, self._unsaved,
                                                                self.ttl))
                self._unsaved = {}
            self._hold_lease()
            self.job.meta.update(completed=self.completed, failed=self.failed)
            self.job.save_meta()
            self._saved_at = now
