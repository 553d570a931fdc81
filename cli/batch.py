"""`llmq batch ...` and `llmq batch-worker`: whole OpenAI-format batch files as rq jobs.

    llmq batch submit requests.jsonl          # prints the batch id
    llmq batch status <id>                    # progress: completed / failed / total
    llmq batch results <id> -o out.jsonl      # output lines; errors to out.errors.jsonl
    llmq batch cancel <id>
    llmq batch list
    llmq batch-worker                         # runs the jobs (an rq worker on `llmq-batch`)

Where the files live: `batch submit` stores the input file in Redis (`<prefix>:batch:<id>:input`),
so a batch worker on any machine can run it; the job writes the output and error lines to Redis
lists next to it, and `batch results` writes them to local files. Everything expires with the
job (`--ttl`, 7 days by default, like OpenAI's batch files). The job itself is
`llmq.gateway.batch_job`, kept with `llmq.gateway.batch_store` beside the gateway's Batch API.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import click

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client
from llmq.broker.connection import translate_errors
from llmq.broker.exchange import send
from llmq.cli.helpers import echo_json, note, open_client, table
from llmq.cli.options import connection_kwargs, connection_options, redis_url_option
from llmq.gateway.batch_store import (
    FINAL_STATUSES,
    BatchStore,
    batch_status,
    batch_summary,
    new_batch_worker,
    rq_connection,
)
from llmq.protocol.errors import LLMQError

_DAY = 24 * 3600


def _store(client: Client) -> BatchStore:
    return BatchStore(rq_connection(client.redis), client)


def _fetch(client: Client, batch_id: str) -> Any:
    with translate_errors(client.url):
        return _store(client).fetch(batch_id)


def _when(unix: int | None) -> str:
    if not unix:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@click.group()
def batch() -> None:
    """Run OpenAI-format batch files as rq jobs (results in the OpenAI batch output format)."""


@batch.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--max-in-flight", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Unfinished requests the job keeps in the queue at a time.")
@click.option("--ttl", type=click.IntRange(min=60), default=7 * _DAY, show_default=True,
              help="Seconds the batch (input, results, job) is kept.")
@click.option("--timeout", type=click.IntRange(min=1), default=_DAY, show_default=True,
              help="Seconds the job may run (OpenAI's completion window is 24h).")
@connection_options
def submit_batch(file: str, max_in_flight: int, ttl: int, timeout: int, **kwargs: Any) -> None:
    """Queue FILE (OpenAI batch input JSONL) as one rq job; prints the batch id."""
    client = open_client(**connection_kwargs(kwargs))
    with open(file, "rb") as f:
        data = f.read()
    num_lines = sum(1 for line in data.splitlines() if line.strip())
    if not num_lines:
        raise click.BadParameter("the file has no lines", param_hint="FILE")
    batch_id = f"batch_{uuid.uuid4().hex}"
    with translate_errors(client.url):
        client.ensure_group()  # so `llmq status` shows the queue before any worker started
        send(client, BatchRecords(client.keys).store_input(batch_id, data, ttl))
        store = _store(client)
        store.enqueue(batch_id, queue=client.settings.queue, max_in_flight=max_in_flight,
                      ttl=ttl, timeout=timeout,
                      description=f"llmq batch {os.path.basename(file)}",
                      meta={"input_file": os.path.basename(file), "total": num_lines})
        has_workers = store.has_workers()
    click.echo(batch_id)
    if not has_workers:
        note("no batch worker is running: start one with `llmq batch-worker`")
    note(f"{num_lines} requests queued as {batch_id}; follow with `llmq batch status {batch_id}`")


@batch.command("status")
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="An OpenAI-style batch object.")
@connection_options
def status_batch(batch_id: str, as_json: bool, **kwargs: Any) -> None:
    """Show a batch's status and progress."""
    client = open_client(**connection_kwargs(kwargs))
    summary = batch_summary(_fetch(client, batch_id))
    if as_json:
        echo_json(summary)
        return
    counts = summary["request_counts"]
    rows = [["batch", summary["id"]],
            ["status", f"{summary['status']} (rq: {summary['rq_status']})"],
            ["requests", f"{counts['completed']} completed, {counts['failed']} failed, "
                         f"{counts['total']} total"],
            ["file", summary["input_file"]], ["queue", summary["queue"]],
            ["created", _when(summary["created_at"])]]
    for name in ("completed_at", "cancelled_at"):
        if summary[name]:
            rows.append([name.removesuffix("_at"), _when(summary[name])])
    if "error" in summary:
        rows.append(["error", summary["error"]])
    rows += [["error", error["message"]] for error in summary.get("errors", [])]
    for name, value in rows:
        click.echo(f"{name:<10} {value}")


def _wait_final(client: Client, batch_id: str, timeout: float | None) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        job = _fetch(client, batch_id)
        status = batch_status(job)
        if status in FINAL_STATUSES:
            return job
        if deadline is not None and time.monotonic() > deadline:
            raise LLMQError(f"batch {batch_id} is still {status} after {timeout:g}s")
        time.sleep(0.5)


@batch.command("results")
@click.argument("batch_id")
@click.option("-o", "--output", default="-", show_default=True,
              type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Output file (OpenAI batch output JSONL).")
@click.option("--errors", "errors_path", default=None,
              type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Error file (default: <output>.errors.jsonl next to -o).")
@click.option("--wait", is_flag=True, help="Wait until the batch has finished.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --wait: give up after this many seconds.")
@connection_options
def results_batch(batch_id: str, output: str, errors_path: str | None, wait: bool,
                  timeout: float | None, **kwargs: Any) -> None:
    """Write a finished batch's output (and error) lines to files."""
    client = open_client(**connection_kwargs(kwargs))
    job = _wait_final(client, batch_id, timeout) if wait else _fetch(client, batch_id)
    summary = batch_summary(job)
    status = summary["status"]
    if status == "failed":
        raise LLMQError(f"batch {batch_id} failed: {summary.get('error', 'see its rq job')}")
    if status not in FINAL_STATUSES:
        counts = summary["request_counts"]
        raise LLMQError(f"batch {batch_id} is {status} ({counts['completed'] + counts['failed']}"
                        f"/{counts['total']} done): wait for it, or add --wait")
    outputs, errors = send(client, BatchRecords(client.keys).results(batch_id))
    if errors_path is None and output != "-" and errors:
        stem = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
        errors_path = f"{stem}.errors.jsonl"
    _write_lines(output, outputs)
    if errors_path is not None:
        _write_lines(errors_path, errors)
    where = "" if output == "-" else f" to {output}"
    error_note = (f", {len(errors)} error line(s) to {errors_path}" if errors_path
                  else f", {len(errors)} error line(s) (write them with --errors FILE)"
                  if errors else "")
    note(f"batch {batch_id} {status}: {len(outputs)} result line(s){where}{error_note}")


def _write_lines(path: str, lines: list[bytes]) -> None:
    with click.open_file(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line.decode() + "\n")


@batch.command("cancel")
@click.argument("batch_id")
@click.option("--wait", is_flag=True, help="Wait until the job has stopped.")
@connection_options
def cancel_batch(batch_id: str, wait: bool, **kwargs: Any) -> None:
    """Stop a batch: no more requests are submitted, unfinished ones are cancelled."""
    client = open_client(**connection_kwargs(kwargs))
    job = _fetch(client, batch_id)
    status = batch_status(job)
    if status in FINAL_STATUSES:
        note(f"batch {batch_id} is already {status}: nothing to cancel")
        return
    with translate_errors(client.url):
        status = _store(client).cancel(job)
    if status == "cancelled":
        click.echo(f"cancelled batch {batch_id} (it had not started)")
        return
    click.echo(f"cancelling batch {batch_id}: no more requests are submitted and unfinished "
               "ones are cancelled")
    if wait:
        job = _wait_final(client, batch_id, None)
        counts = batch_summary(job)["request_counts"]
        click.echo(f"batch {batch_id} {batch_status(job)}: {counts['completed']} completed, "
                   f"{counts['failed']} failed or cancelled")


@batch.command("list")
@click.option("--json", "as_json", is_flag=True, help="One batch object per line.")
@connection_options
def list_batches(as_json: bool, **kwargs: Any) -> None:
    """List the batches rq still keeps (queued, running and finished ones)."""
    client = open_client(**connection_kwargs(kwargs))
    with translate_errors(client.url):
        store = _store(client)
        jobs = store.fetch_many(store.all_ids())
    summaries = sorted((batch_summary(j) for j in jobs),
                       key=lambda s: s["created_at"] or 0, reverse=True)
    if as_json:
        for summary in summaries:
            echo_json(summary)
        return
    if not summaries:
        click.echo("no batches")
        return
    click.echo(table(["BATCH", "STATUS", "DONE", "FILE", "CREATED"], [
        [s["id"], s["status"],
         f"{s['request_counts']['completed'] + s['request_counts']['failed']}"
         f"/{s['request_counts']['total']}", s["input_file"], _when(s["created_at"])]
        for s in summaries]))


@click.command("batch-worker")
@click.option("--burst", is_flag=True, help="Exit once the batch queue is empty.")
@click.option("--name", default=None, help="rq worker name (default: rq's).")
@redis_url_option
def batch_worker(burst: bool, name: str | None, redis_url: str | None) -> None:
    """Run batch jobs: an rq worker on the rq queue `llmq-batch` (no model, no torch)."""
    client = Client(redis_url)
    client.ping()  # one clear line now, rather than rq's traceback later
    store = _store(client)
    # NOTE: the jobs (run_batch, in rq's work horse) find llmq's Redis in the environment.
    os.environ["LLMQ_REDIS_URL"] = client.url
    # NOTE: with rq's scheduler: it requeues a retried batch once its backoff has passed.
    new_batch_worker(store, name).work(burst=burst, logging_level="INFO", with_scheduler=True)
