"""`llmq run --rq`, `llmq run status ID` and `llmq run list`: dataset jobs on rq, followed.

    llmq run job.yaml --rq          # prints the job id (run-<name>); a batch worker runs it
    llmq run status run-NAME        # state, stage, rows done/total, per-stage counts, ETA
    llmq run status run-NAME --json
    llmq run list                   # recent jobs, run here or on rq
    llmq run cancel run-NAME        # a queued job never runs; a running one stops (either kind)

A dataset job on rq is one rq job on the queue `llmq-batch`, with the batches' retries
(gateway/batch_store.py); what it runs is `llmq.jobs.queued.run_dataset_job`. Its id is the
job's (`run-<name>`), so submitting the same job again while it is queued or running is refused,
and once it has ended, queues a rerun (which resumes). Status and list read the broker's job
store (broker/job_progress.py), which both `llmq run` in the foreground and the rq job update.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from llmq.broker.client import Client
from llmq.broker.connection import translate_errors
from llmq.broker.exchange import send
from llmq.broker.job_progress import FINAL_STATES, JobProgress, JobRecord
from llmq.cli.helpers import echo_json, note, open_client, table
from llmq.cli.options import connection_kwargs, connection_options
from llmq.gateway.batch_store import (
    FINAL_STATUSES,
    RETRY_INTERVALS,
    BatchStore,
    batch_status,
    rq_connection,
)
from llmq.protocol.errors import BrokerUnavailable, LLMQError

if TYPE_CHECKING:
    from llmq.jobs.spec import JobSpec

__all__ = ["cancel_job", "enqueue", "job_status", "list_jobs", "refuse_if_running_elsewhere"]


def _store(client: Client) -> BatchStore:
    return BatchStore(rq_connection(client.redis), client)


def refuse_if_running_elsewhere(client: Client, job_id: str, *, on_rq: bool) -> None:
    """Two runs of one job would write one output twice: refuse to start one (here or on rq)
    while the job is queued or running on rq, or running in a CLI that still says so."""
    with translate_errors(client.url):
        try:
            job = _rq_job(client, job_id)
        except BrokerUnavailable:  # on a cluster with no rq Redis configured: no rq jobs
            job = None
        status = None if job is None else batch_status(job)
        if status is not None and status not in FINAL_STATUSES:
            raise click.ClickException(
                f"{job_id} is already {status.replace('_', ' ')} on rq: follow it with `llmq "
                f"run status {job_id}`, or stop it with `llmq run cancel {job_id}`")
        record = send(client, JobProgress(client.keys).get(job_id)) if on_rq else None
    if record is not None and record.runner == "cli" and _state(record, None) == "running":
        raise click.ClickException(
            f"{job_id} is running in a CLI (updated {_when(record.updated)}): stop it first "
            f"(`llmq run cancel {job_id}`)")


def enqueue(client: Client, spec: JobSpec, data: dict[str, Any], base_dir: str,
            timeout: int) -> None:
    """Queue the job (its mapping, validated as `spec`) for a batch worker; print its id."""
    from rq import Retry

    from llmq.jobs.published import job_id_for, job_name_for
    from llmq.jobs.queued import run_dataset_job

    try:
        json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise click.ClickException(f"the job file holds a value rq cannot carry as JSON "
                                   f"({exc}): quote it as a string") from None
    job_id, name = job_id_for(spec), job_name_for(spec)
    refuse_if_running_elsewhere(client, job_id, on_rq=True)
    with translate_errors(client.url):
        client.ensure_group()  # so `llmq status` shows the queue before any worker started
        store = _store(client)
        earlier = _rq_job(client, job_id)
        if earlier is not None:
            earlier.delete()  # ended: the new job is its rerun (it resumes)
        store.queue.enqueue_call(
            run_dataset_job, job_id=job_id, timeout=timeout, result_ttl=timeout,
            failure_ttl=timeout, description=f"llmq run {name}",
            kwargs={"job_id": job_id, "job": data, "base_dir": base_dir,
                    "prefix": client.keys.prefix, "queue": client.settings.queue},
            retry=Retry(max=len(RETRY_INTERVALS), interval=RETRY_INTERVALS),
            meta={"status": "queued", "kind": "dataset", "total": 0, "completed": 0,
                  "failed": 0, "queue": client.settings.queue, "input_file": spec.source.path,
                  "output": spec.output, "created_at": int(time.time())})
        send(client, JobProgress(client.keys).clear_stop(job_id))
        send(client, JobProgress(client.keys).save(JobRecord(
            id=job_id, name=name, state="queued", stage="queued", runner="rq",
            source=spec.source.path, output=spec.output, started=time.time())))
        has_workers = store.has_workers()
    click.echo(job_id)
    if not has_workers:
        note("no batch worker is running: start one with `llmq batch-worker` (where the "
             "job's paths are readable)")
    note(f"queued as {job_id}; follow with `llmq run status {job_id}`")


def _when(unix: float) -> str:
    if not unix:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _state(record: JobRecord, rq_status: str | None) -> str:
    """The record's state, corrected by what rq knows and by the record's age."""
    if record.state not in FINAL_STATES and rq_status in ("failed", "stopped", "canceled"):
        return "failed"
    if record.is_stale():
        return "stale"  # `running`, but its run stopped saying so a while ago: it died
    return record.state


def _rq_job(client: Client, job_id: str) -> Any:
    try:
        return _store(client).fetch(job_id)
    except LLMQError:
        return None  # run in a CLI, or rq has expired it


def _rq_status(client: Client, job_id: str) -> str | None:
    job = _rq_job(client, job_id)
    if job is None:
        return None
    status = job.get_status(refresh=False)
    return str(getattr(status, "value", status))


def _find(client: Client, job_id: str) -> tuple[str, JobRecord]:
    """(the job id, its record): JOB_ID as given, or a job's name; LLMQError when unknown."""
    store = JobProgress(client.keys)
    record = send(client, store.get(job_id))
    if record is None and not job_id.startswith("run-"):
        job_id = f"run-{job_id}"
        record = send(client, store.get(job_id))
    if record is None:
        raise LLMQError(f"unknown dataset job {job_id}: no such job in the job store "
                        "(`llmq run list` shows the known ones)")
    return job_id, record


def _rows(record: JobRecord) -> str:
    total = "?" if record.rows_total is None else str(record.rows_total)
    return f"{record.rows_done}/{total}"


@click.command("status")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="The job's record as one JSON line.")
@connection_options
def job_status(job_id: str, as_json: bool, **kwargs: Any) -> None:
    """Show a dataset job's state and progress (JOB_ID: run-<name>, or the name)."""
    client = open_client(**connection_kwargs(kwargs))
    with translate_errors(client.url):
        job_id, record = _find(client, job_id)
        rq_status = _rq_status(client, job_id)
    state = _state(record, rq_status)
    if as_json:
        from msgspec import to_builtins

        echo_json({**to_builtins(record), "state": state, "rq_status": rq_status})
        return
    rows = [["job", f"{record.id} ({record.runner or '?'})"],
            ["state", state + (f" (rq: {rq_status})" if rq_status else "")],
            ["stage", record.stage or "-"],
            ["rows", f"{_rows(record)} done, {record.rows_failed} to the errors file"
                     + (f", {record.duplicates} near-duplicates" if record.duplicates else "")]]
    for stage in record.stages:
        rows.append([f"  {stage.name}", f"{stage.done} done, {stage.failed} failed, "
                                        f"{stage.skipped} skipped, {stage.running} running, "
                                        f"{stage.tokens} tokens"])
    if state == "running":
        eta = "" if record.eta_s is None else f", ETA {_clock(record.eta_s)}"
        rows.append(["rate", f"{record.tokens_per_s:.0f} tokens/s{eta}"])
    rows += [["source", record.source], ["output", record.output],
             ["started", _when(record.started)], ["updated", _when(record.updated)]]
    if record.message:
        rows += [["message", line] for line in record.message.splitlines()]
    for name, value in rows:
        click.echo(f"{name:<10} {value}")


@click.command("list")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One job record per line.")
@connection_options
def list_jobs(limit: int, as_json: bool, **kwargs: Any) -> None:
    """List recent dataset jobs (in a CLI or on rq), the last updated first."""
    client = open_client(**connection_kwargs(kwargs))
    store = JobProgress(client.keys)
    with translate_errors(client.url):
        records = send(client, store.many(send(client, store.recent_ids(limit))))
    if as_json:
        from msgspec import to_builtins

        for record in records:
            echo_json({**to_builtins(record), "state": _state(record, None)})
        return
    if not records:
        click.echo("no dataset jobs")
        return
    click.echo(table(["JOB", "STATE", "STAGE", "ROWS", "ERRORS", "RUNNER", "UPDATED"], [
        [r.id, _state(r, None), r.stage, _rows(r), r.rows_failed, r.runner, _when(r.updated)]
        for r in records]))


@click.command("cancel")
@click.argument("job_id")
@connection_options
def cancel_job(job_id: str, **kwargs: Any) -> None:
    """Stop a dataset job (JOB_ID: run-<name>, or the name), on rq or in a CLI.

    A queued job never runs. A running one stops within seconds: the rows written stay, the
    requests it queued still finish, and running it again resumes."""
    client = open_client(**connection_kwargs(kwargs))
    store = JobProgress(client.keys)
    with translate_errors(client.url):
        job_id, record = _find(client, job_id)
        job = _rq_job(client, job_id)
        if job is not None and job.get_status() in ("queued", "deferred", "scheduled"):
            job.cancel()  # never started, or waits for a retry: rq drops it
            job.meta.update(status="cancelled", cancelled_at=int(time.time()))
            job.save_meta()
            record.state, record.stage = "cancelled", "cancelled"
            send(client, store.save(record))
            click.echo(f"cancelled {job_id} (it was not running)")
            return
        state = _state(record, None if job is None else _rq_status(client, job_id))
        if state in (*FINAL_STATES, "stale"):
            note(f"{job_id} is {state}: nothing to cancel")
            return
        send(client, store.request_stop(job_id))
    click.echo(f"stopping {job_id}: it stops within seconds; the rows written stay, and "
               "running it again resumes")
