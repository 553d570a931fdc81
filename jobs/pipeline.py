"""DatasetJob: a dataset through a pipeline of stages on the pool, rows out in input order.

    job = DatasetJob(client, load_job("job.yaml"), on_tick=print_progress)
    job.run()        # every row in the output or the errors file, once

The rows run as the lines of one `OrderedRun` (broker/ordered_run.py), the runner behind
`llmq submit -f`: read and rendered as the run's window opens, never more than `chunk_rows`
(10,000 by default) ahead of the last row written, so memory stays bounded and the pool never
waits for one part of the dataset to finish before the next starts. A line's first request is
the row's first stage; when that ends, the row's next stage is rendered from its columns so far
and returned to the run as a follow-up request, queued ahead of new rows, so a row enters stage
2 as soon as stage 1 finishes it (on the stage's own queue when it names one). A stage whose
`when:` is false for the row is skipped (its columns null); the row's record is made when no
stage is left, and the run writes records strictly in input order. At most `max_in_flight`
requests are queued or running at a time.

Exactly once, across kills: every request id is derived from the job's name, the row number,
the stage and a hash of the request itself (`<job>.<row>.<stage>.<hash>`), so a rerun asks for
the same ids; the broker's idempotent submit turns a resubmitted id into "follow the request
already queued or done", and a later stage's request, made from the same earlier answer, gets
the same id again. The output and the errors file are written in input order (jobs/sinks.py),
so a rerun starts after the last row either holds and skips nothing it has not written.

Rows that cannot run (a missing column, a failing template, a request the wire format refuses,
a failed generation, JSON that does not parse) go to the errors file with their row number, the
stage and the reason; the rest of the job goes on. Near-duplicates (`dedup:`) are found before
generation over every row, the skipped prefix included, so a rerun drops the same ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from llmq.broker.client import Client
from llmq.broker.commands import build_submission
from llmq.broker.ordered_run import OrderedRun, Settled, Submit
from llmq.broker.transcript import Transcript
from llmq.jobs.progress import DatasetProgress
from llmq.jobs.sinks import ROW_COLUMN, RowWriter
from llmq.jobs.sources import BadRow, open_source
from llmq.jobs.spec import JobSpec, StageSpec
from llmq.jobs.templates import RowError, SpecError
from llmq.protocol import Done
from llmq.protocol.errors import ErrorCode, InvalidRequest

if TYPE_CHECKING:
    from llmq.jobs.dedup import NearDuplicates

__all__ = ["DatasetJob", "JobStopped", "request_id_for", "result_columns"]

DUPLICATE_COLUMN = "duplicate_of"
ROW_ERROR = "row_error"  # the error code of a row the job itself could not run


class JobStopped(Exception):  # noqa: N818 - a stop asked for, not an error
    """Raised out of `run()` when `stop_requested` turned true: the rows written stay, the
    requests queued keep running, and a rerun resumes (and follows them)."""


def result_columns(stage: StageSpec) -> list[str]:
    """The columns a stage adds to each row (null when its `when:` skipped the row)."""
    names = [stage.name, f"{stage.name}_finish_reason", f"{stage.name}_usage",
             f"{stage.name}_id"]
    return [*names, f"{stage.name}_parsed"] if stage.parse_json else names


def request_id_for(job_name: str, row: int, stage: str, body: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False,
                                       default=str).encode()).hexdigest()[:12]
    return f"{job_name}.{row}.{stage}.{digest}"


def default_job_name(output: str) -> str:
    return "ds-" + hashlib.sha256(os.path.abspath(output).encode()).hexdigest()[:10]


@dataclass
class _RowState:
    row: int  # source row number
    columns: dict[str, Any]  # the input row, then each stage's columns as it finishes
    stage: int = 0  # the stage running (index into the job's stages)
    request_id: str | None = None


@dataclass(frozen=True)
class _Record:
    index: int  # the line in the job's run
    error: bool  # True: for the errors file
    data: dict[str, Any]


class DatasetJob:
    def __init__(self, client: Client, spec: JobSpec, *,
                 on_tick: Callable[[DatasetProgress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.spec = spec
        self.name = spec.name or default_job_name(spec.output)
        self.on_tick = on_tick
        self.should_stop = should_stop
        self.writer = RowWriter(spec.output, spec.errors_path)
        self.progress = DatasetProgress(None, [stage.name for stage in spec.stages])
        self.finished_before = False  # an earlier run finished it: nothing was done
        self._states: dict[int, _RowState] = {}  # rows not written yet, by line index
        self._checked_columns = False

    def run(self) -> None:
        """Run every row not written yet; SpecError when the source or job cannot start."""
        spec = self.spec
        source = open_source(spec.source)
        self.progress.total_rows = source.num_rows
        if self.writer.finished_before:
            self.finished_before = True
            self.progress.phase = "done"
            return
        dedup = None
        if spec.dedup is not None:
            from llmq.jobs.dedup import NearDuplicates  # numpy only for jobs that dedup

            dedup = NearDuplicates(spec.dedup.threshold, spec.dedup.num_perm)
        frontier = self.writer.resume()
        self.progress.num_resumed = self.writer.num_rows + self.writer.num_errors
        self.progress.num_resumed_errors = self.writer.num_errors
        self._set_phase("running")
        try:
            lines = self._lines(source.rows(), frontier, dedup)
            OrderedRun(self.client, lines, self, max_in_flight=spec.max_in_flight,
                       max_unwritten=spec.chunk_rows).run()
            self._set_phase("writing output")
            self.writer.finish()
            self._set_phase("done")
        finally:
            self.writer.close()

    def _lines(self, rows: Iterator[dict[str, Any] | BadRow], frontier: int,
               dedup: NearDuplicates | None) -> Iterator[Submit | Settled[_Record]]:
        """The run's lines, one per row after `frontier`, rendered as the run takes them."""
        index = 0
        for number, row in enumerate(rows):
            item = self._admit(number, row, dedup)
            if item is None or number <= frontier:
                continue
            if isinstance(item, _RowState):
                self._states[index] = item
                outcome = self._advance(index, item, 0)
                yield outcome if isinstance(outcome, Submit) else Settled(outcome)
            else:
                yield Settled(_Record(index, item.error, item.data))
            index += 1

    def _admit(self, number: int, row: dict[str, Any] | BadRow,
               dedup: NearDuplicates | None) -> _RowState | _Record | None:
        """The row as a line to run, or its record; None when dedup drops it."""
        if isinstance(row, BadRow):
            return _Record(-1, True, self._error(number, "source", None, ROW_ERROR, row.reason))
        if dedup is None or self.spec.dedup is None:
            return _RowState(number, row)
        text = row.get(self.spec.dedup.column)
        if not isinstance(text, str):
            return _Record(-1, True, self._error(number, "dedup", None, ROW_ERROR,
                                                 f"dedup column {self.spec.dedup.column!r} is "
                                                 f"missing or not text"))
        earlier = dedup.first_seen(text, number)
        if earlier is None:
            return _RowState(number, {**row, DUPLICATE_COLUMN: None}
                             if self.spec.dedup.action == "flag" else row)
        self.progress.num_duplicates += 1
        if self.spec.dedup.action == "drop":
            return None
        columns = {**row, DUPLICATE_COLUMN: earlier}
        for stage in self.spec.stages:
            columns.update(dict.fromkeys(result_columns(stage)))
        return _Record(-1, False, {**columns, ROW_COLUMN: number})

    def _set_phase(self, phase: str) -> None:
        self.progress.phase = phase
        if self.on_tick is not None:
            self.on_tick(self.progress)

    def _check_columns(self, columns: dict[str, Any]) -> None:
        """Once, on the first row: no stage may overwrite an input column."""
        self._checked_columns = True
        for stage in self.spec.stages:
            clash = sorted(set(result_columns(stage)) & set(columns))
            if clash:
                raise SpecError(f"stage {stage.name!r} would overwrite the input column(s) "
                                f"{', '.join(clash)}: give the stage another name")

    def _advance(self, index: int, state: _RowState, first: int) -> Submit | _Record:
        """The row's request for the first stage from `first` on that runs, or its record."""
        if not self._checked_columns:
            self._check_columns(state.columns)
        for position in range(first, len(self.spec.stages)):
            stage = self.spec.stages[position]
            try:
                if stage.when is not None and not stage.when.holds(state.columns):
                    state.columns.update(dict.fromkeys(result_columns(stage)))
                    self.progress.stages[stage.name].num_skipped += 1
                    continue
                body = stage.template.render(state.columns)
                request_id = request_id_for(self.name, state.row, stage.name, body)
                body = {**body, "id": request_id, "stream": False}
                try:
                    build_submission(body)  # the worker's own decoder: this row's problem now
                except InvalidRequest as exc:
                    raise RowError(f"invalid request: {exc}") from None
            except RowError as exc:
                self.progress.stages[stage.name].num_failed += 1
                return _Record(index, True, self._error(state.row, stage.name, None, ROW_ERROR,
                                                        str(exc)))
            state.stage, state.request_id = position, request_id
            self.progress.stages[stage.name].num_running += 1
            return Submit(request_id, body, queue=stage.queue)
        return _Record(index, False, {**state.columns, ROW_COLUMN: state.row})

    @staticmethod
    def _error(row: int, stage: str, request_id: str | None, code: str,
               message: str) -> dict[str, Any]:
        return {ROW_COLUMN: row, "stage": stage, "id": request_id,
                "error": {"code": code, "message": message}}

    # -- the RunSink of the job's OrderedRun ---------------------------------------------------

    def finished(self, index: int, transcript: Transcript) -> _Record | Submit:
        state = self._states[index]
        stage = self.spec.stages[state.stage]
        counts = self.progress.stages[stage.name]
        counts.num_done += 1
        counts.num_running -= 1
        final = transcript.final
        if not isinstance(final, Done):
            counts.num_failed += 1
            code, message = ((final.code, final.message) if final is not None
                             else (ErrorCode.ENGINE_ERROR.value, "no result"))
            return _Record(index, True, self._error(state.row, stage.name,
                                                    transcript.request_id, code, message))
        counts.num_tokens += final.usage.completion_tokens
        columns = {stage.name: final.text, f"{stage.name}_finish_reason": final.finish_reason,
                   f"{stage.name}_usage": msgspec.to_builtins(final.usage),
                   f"{stage.name}_id": transcript.request_id}
        if stage.parse_json:
            try:
                columns[f"{stage.name}_parsed"] = json.loads(final.text)
            except json.JSONDecodeError as exc:
                counts.num_failed += 1
                hint = " (cut short by max_tokens)" if final.finish_reason == "length" else ""
                return _Record(index, True, self._error(
                    state.row, stage.name, transcript.request_id, "invalid_json",
                    f"the output is not JSON{hint}: {exc}"))
        state.columns.update(columns)
        return self._advance(index, state, state.stage + 1)

    def not_run(self, index: int, *, submitted: bool) -> _Record:
        raise AssertionError("a dataset job is never stopped (stop_requested is False)")

    def write(self, record: _Record) -> None:
        if record.error:
            self.writer.write_error(record.data)
            self.progress.num_errors += 1
        else:
            self.writer.write_row(record.data)
        self.progress.num_written += 1
        self._states.pop(record.index, None)  # NOTE: a written row's columns are not needed

    def tick(self, submitted: int) -> None:
        if self.on_tick is not None:
            self.on_tick(self.progress)
        # NOTE: not the run's own stop (stop_requested), which cancels what is queued: a
        # cancelled request's answer would be what a rerun follows for its row.
        if self.should_stop is not None and self.should_stop():
            raise JobStopped

    def stop_requested(self) -> bool:
        return False
