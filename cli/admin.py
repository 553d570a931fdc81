"""`llmq admin ...`: utility calls to the workers of a queue over `<prefix>:ctl:{<queue>}`.

    llmq admin reset-prefix-cache | sleep [--level 2] | wake | profile start|stop | stats
               | load-lora NAME | unload-lora NAME [--worker ID] [--timeout S] [--json]
    llmq admin load-functions [--check] [--replace]   # the function library, every primary

Each command sends one call (broker/control.py) and prints every worker's answer, one line per
worker. It exits 1 when a worker answered with an error, or when an expected worker (the one
named, or every live worker of the queue) did not answer in time. The control keys are
admin-only (deploy/acl.conf), and so is loading the function library: connect as the admin user.
"""

from __future__ import annotations

from typing import Any

import click

from llmq.broker.connection import describe_connection, translate_errors
from llmq.broker.control import call_workers
from llmq.broker.functions import (
    LIBRARY_NAME,
    LIBRARY_VERSION,
    FunctionLibraryMissing,
    ensure_functions,
    library_versions,
    missing_message,
)
from llmq.cli.helpers import echo_json, note, open_client
from llmq.cli.options import Command, connection_kwargs, connection_options


def _call_options(fn: Command) -> Command:
    fn = click.option("--json", "as_json", is_flag=True, help="One JSON object per answer.")(fn)
    fn = click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0,
                      show_default=True, help="Seconds to wait for the answers.")(fn)
    fn = click.option("--worker", default=None, metavar="ID",
                      help="Only this worker (default: every live worker of the queue).")(fn)
    return connection_options(fn)


def _call(method: str, args: dict[str, Any], worker: str | None, timeout: float,
          as_json: bool, kwargs: dict[str, Any]) -> None:
    client = open_client(**connection_kwargs(kwargs))
    queue = client.settings.queue
    expected = {worker} if worker else {w.worker_id for w in client.workers()
                                        if w.queue == queue}
    if not expected:
        note(f"no live worker serves queue {queue!r}: listening {timeout:g} s for any answer")
    replies = call_workers(client, method, args, worker=worker, expected=expected,
                           timeout=timeout)
    for reply in replies:
        if as_json:
            echo_json(reply)
        elif reply.ok:
            shown = " ".join(f"{k}={v}" for k, v in (reply.result or {}).items())
            click.echo(f"{reply.worker}: ok {shown}".rstrip())
        else:
            click.echo(f"{reply.worker}: error {reply.error}")
    missing = sorted(expected - {r.worker for r in replies})
    if missing:
        note(f"no answer within {timeout:g} s from: {', '.join(missing)}")
    if missing or not replies or not all(r.ok for r in replies):
        raise SystemExit(1)


@click.group()
def admin() -> None:
    """Utility calls to the workers: prefix cache, sleep and wake, profiler, stats."""


@admin.command("reset-prefix-cache")
@_call_options
def reset_prefix_cache(worker: str | None, timeout: float, as_json: bool, **kwargs: Any) -> None:
    """Forget every cached prefix (refused by a worker that is running requests)."""
    _call("reset_prefix_cache", {}, worker, timeout, as_json, kwargs)


@admin.command()
@click.option("--level", type=click.Choice(["1", "2"]), default="1", show_default=True,
              help="1: free the KV cache; 2: the model weights too.")
@_call_options
def sleep(level: str, worker: str | None, timeout: float, as_json: bool, **kwargs: Any) -> None:
    """Stop reading, hand in-flight requests to peers, free memory until `llmq admin wake`."""
    _call("sleep", {"level": int(level)}, worker, timeout, as_json, kwargs)


@admin.command()
@_call_options
def wake(worker: str | None, timeout: float, as_json: bool, **kwargs: Any) -> None:
    """Reallocate what sleep freed and read requests again."""
    _call("wake_up", {}, worker, timeout, as_json, kwargs)


@admin.command()
@click.argument("action", type=click.Choice(["start", "stop"]))
@click.option("--dir", "trace_dir", default=None, metavar="PATH",
              help="Folder for the trace, on the worker's machine (default: its temp folder).")
@_call_options
def profile(action: str, trace_dir: str | None, worker: str | None, timeout: float,
            as_json: bool, **kwargs: Any) -> None:
    """Start the torch profiler, or stop it and print where each worker wrote its trace."""
    args: dict[str, Any] = {"action": action}
    if trace_dir and action == "stop":
        args["dir"] = trace_dir
    _call("profile", args, worker, timeout, as_json, kwargs)


@admin.command()
@_call_options
def stats(worker: str | None, timeout: float, as_json: bool, **kwargs: Any) -> None:
    """Each worker's engine counters (running, waiting, KV use, prefix hits, sleeping)."""
    _call("stats", {}, worker, timeout, as_json, kwargs)


@admin.command("load-lora")
@click.argument("name")
@_call_options
def load_lora(name: str, worker: str | None, timeout: float, as_json: bool, **kwargs: Any
              ) -> None:
    """Load a LoRA adapter from each worker's --lora-dir now (the first request pays nothing)."""
    _call("load_lora", {"name": name}, worker, timeout, as_json, kwargs)


@admin.command("unload-lora")
@click.argument("name")
@_call_options
def unload_lora(name: str, worker: str | None, timeout: float, as_json: bool, **kwargs: Any
                ) -> None:
    """Drop a LoRA adapter from each worker's LRU (running requests finish with it)."""
    _call("unload_lora", {"name": name}, worker, timeout, as_json, kwargs)


@admin.command("load-functions")
@click.option("--check", is_flag=True,
              help="Only report each server's version; exit 1 if one is missing or older.")
@click.option("--replace", is_flag=True,
              help="Load this llmq's version even where a newer one is loaded (a downgrade).")
@connection_options
def load_functions_(check: bool, replace: bool, **kwargs: Any) -> None:
    """Load the llmq Redis Function library on every server (each primary of a cluster).

    All of llmq's server-side code is in it (submit, retry, ack, lease renewal), so no other
    llmq user needs FUNCTION LOAD, EVAL or SCRIPT: run this as the admin user at deploy, after
    an upgrade, and after adding primaries to a cluster. It is loaded where it is missing or
    older, and kept in the RDB and AOF across restarts."""
    client = open_client(**connection_kwargs(kwargs))
    with translate_errors(client.url):
        if check:
            found = library_versions(client.redis)
        else:
            try:
                found = ensure_functions(client.redis, replace_newer=replace)
            except FunctionLibraryMissing:
                raise click.ClickException(
                    f"{describe_connection(client.redis)}: this user may not load the function "
                    "library (NOPERM): connect as the admin user (--redis-url / "
                    "LLMQ_REDIS_URL with the admin's name and password)") from None
    for server in found:
        if server.loaded:
            before = f"version {server.found}" if server.found else "nothing"
            click.echo(f"{server.server}: loaded library {LIBRARY_NAME!r} version "
                       f"{LIBRARY_VERSION} (was {before})")
        elif server.found >= LIBRARY_VERSION:
            click.echo(f"{server.server}: version {server.found} (this llmq needs "
                       f"{LIBRARY_VERSION}): ok")
        else:
            click.echo(missing_message(server.server, server.found))
    if any(s.found < LIBRARY_VERSION and not s.loaded for s in found):
        raise SystemExit(1)
