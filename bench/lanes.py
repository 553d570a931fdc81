"""Lanes and fair share on an `llmq up` pool: interactive TTFT under a batch backlog, and two
tenants' shares of a lane (issue 27's bars).

    .venv/bin/python bench/lanes.py                      # 2 workers, the default model
    .venv/bin/python bench/lanes.py --samples 60 --batch-max-tokens 8

Starts `llmq up --workers 2 --detach` under a private run folder, then, on that one pool:

1. Idle: tenant B sends `--samples` interactive requests one after another (`--interactive-
   max-tokens`, streamed); TTFT is the client's time from the submit to the first delta read.
2. Fair share: tenant A queues 4,000 batch requests, then B 1,000 of the same shape
   (`--batch-max-tokens`, ignore_eos, so every request is the same number of tokens). B's share
   of output tokens is counted over the time both had work queued: from B's first request
   finishing to B's last, from the `done` events' times on the server's clock (their result
   entry ids). Bar: 45-55%.
3. Loaded: A tops its backlog up to 5,000 queued batch requests, and B sends the same
   interactive stream as in 1 while that backlog is being worked off (topped up to 5,000 again
   every `TOP_UP_EVERY` interactive requests, so it never runs dry). Bar: p99 TTFT <= 1.5 x the
   idle p99. The batch work taken meanwhile (A's requests admitted, in output tokens/s) is what
   the interactive stream leaves the batch lane.

`--samples` (default 200) interactive requests a phase: with 200 the p99 is the 198th of the
sorted TTFTs (the third-slowest), not the maximum as with 40; each phase takes ~0.15 s a
request. The slowest loaded samples are printed with the server-side split of each (the
entry's XADD -> the worker's `start` -> the first delta).

Prints every figure; asserts nothing (the machine is shared: run it when it is quiet, and read
the idle figure beside the loaded one of the same run).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import Keys

LLMQ = [sys.executable, "-m", "llmq.cli.main"]
TOP_UP_EVERY = 20  # interactive requests between two top-ups of A's batch backlog
KEYS = Keys()
PROMPT = "Item {i}. Write the next item of this list, one short line."


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def interactive_ttfts(client: Client, tag: str, samples: int, max_tokens: int,
                      between: Callable[[], None] = lambda: None) -> list[float]:
    """TTFT of `samples` interactive requests of tenant B, sent one after another; `between`
    is called every TOP_UP_EVERY requests (outside any request's TTFT)."""
    ttfts = []
    for i in range(samples):
        if i and i % TOP_UP_EVERY == 0:
            between()
        start = time.perf_counter()
        request_id = client.submit(PROMPT.format(i=i), request_id=f"B:{tag}-{i}",
                                   max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for event in client.events(request_id, timeout=300):
            if isinstance(event, protocol.Delta | protocol.Done):
                ttfts.append(time.perf_counter() - start)
                break
            if isinstance(event, protocol.Error):
                raise SystemExit(f"{request_id}: {event.code}: {event.message}")
        time.sleep(0.1)
    return ttfts


def batch_requests(tenant: str, first: int, count: int, max_tokens: int) -> list[dict]:
    return [{"id": f"{tenant}:b{i}", "prompt": PROMPT.format(i=i), "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True, "stream": False, "lane": "batch"}
            for i in range(first, first + count)]


def done_times(r: redis.Redis, request_ids: list[str]) -> dict[str, tuple[int, int]]:
    """request id -> (server ms its `done` was written, its output tokens), for those done."""
    pipe = r.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.xrevrange(KEYS.result(request_id), count=1)
    out = {}
    for request_id, entries in zip(request_ids, pipe.execute(), strict=True):
        for entry_id, fields in entries:
            event = protocol.decode_event(fields)
            if isinstance(event, protocol.Done):
                ms = int(entry_id.decode().partition("-")[0])
                out[request_id] = (ms, event.usage.completion_tokens)
    return out


def start_times(r: redis.Redis, request_ids: list[str]) -> dict[str, int]:
    """request id -> server ms its first `start` was written (admitted by a worker)."""
    pipe = r.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.xrange(KEYS.result(request_id), count=1)
    out = {}
    for request_id, entries in zip(request_ids, pipe.execute(), strict=True):
        for entry_id, fields in entries:
            if isinstance(protocol.decode_event(fields), protocol.Start):
                out[request_id] = int(entry_id.decode().partition("-")[0])
    return out


def share_of_b(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]
               ) -> tuple[float, int, int, float]:
    """(B's share of output tokens, A's tokens, B's tokens, seconds) over the span of B's
    times in `b` (request id -> (ms, tokens)), counting A's in the same span."""
    start, end = min(ms for ms, _ in b.values()), max(ms for ms, _ in b.values())
    a_tokens = sum(t for ms, t in a.values() if start <= ms <= end)
    b_tokens = sum(t for _, t in b.values())
    return b_tokens / max(1, a_tokens + b_tokens), a_tokens, b_tokens, (end - start) / 1000


def server_side(r: redis.Redis, request_ids: list[str]
                ) -> tuple[list[float], list[float], dict[str, tuple[int, int]]]:
    """(entry added -> start event, start event -> first delta) in ms on the server's clock,
    as two lists and by request id."""
    queued, engine, by_id = [], [], {}
    for request_id in request_ids:
        marker = r.get(KEYS.idempotency("default", request_id))
        events = r.xrange(KEYS.result(request_id))
        times = [(int(i.decode().partition("-")[0]), protocol.decode_event(f)) for i, f in events]
        start = next((ms for ms, e in times if isinstance(e, protocol.Start)), None)
        first = next((ms for ms, e in times if isinstance(e, protocol.Delta)), None)
        if marker is None or start is None or first is None:
            continue
        queued.append(start - int(marker.decode().partition("-")[0]))
        engine.append(first - start)
        by_id[request_id] = (queued[-1], engine[-1])
    return queued, engine, by_id


def batch_backlog(client: Client, tenant: str) -> int:
    return sum(s.backlog for s in client.lane_stats() if s.lane == f"batch:{tenant}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="", help="a .gguf or HF folder (default model)")
    parser.add_argument("--samples", type=int, default=200, help="interactive requests a phase")
    parser.add_argument("--interactive-max-tokens", type=int, default=16)
    parser.add_argument("--batch-max-tokens", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=5000)
    parser.add_argument("--tenant-a", type=int, default=4000)
    parser.add_argument("--tenant-b", type=int, default=1000)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="llmq-lanes-bench-"))
    os.environ["LLMQ_RUN_DIR"] = str(folder / "run")  # this process's Client finds the pool
    os.environ.pop("LLMQ_REDIS_URL", None)
    env = dict(os.environ)
    up = [*LLMQ, "up", "--workers", str(args.workers), "--detach"]
    subprocess.run(up + (["--model", args.model] if args.model else []), env=env, check=True,
                   stdout=subprocess.DEVNULL)
    try:
        with Client() as client:
            r = client.redis
            print(f"pool: {args.workers} workers, model {args.model or 'default'}; "
                  f"interactive {args.samples} x max_tokens {args.interactive_max_tokens}, "
                  f"batch max_tokens {args.batch_max_tokens}")
            interactive_ttfts(client, "warm", 3, args.interactive_max_tokens)
            idle = interactive_ttfts(client, "idle", args.samples, args.interactive_max_tokens)
            print(f"idle pool: interactive TTFT p50 {percentile(idle, 50) * 1000:.0f} ms, "
                  f"p99 {percentile(idle, 99) * 1000:.0f} ms")
            queued, engine, _ = server_side(r, [f"B:idle-{i}" for i in range(args.samples)])
            print(f"  server side: queued to admitted p50 {percentile(queued, 50):.0f} ms, p99 "
                  f"{percentile(queued, 99):.0f} ms; admitted to first token p50 "
                  f"{percentile(engine, 50):.0f} ms, p99 {percentile(engine, 99):.0f} ms",
                  flush=True)

            # -- fair share ----------------------------------------------------------------
            a_ids = client.submit_many(batch_requests("A", 0, args.tenant_a,
                                                      args.batch_max_tokens))
            b_ids = client.submit_many(batch_requests("B", 0, args.tenant_b,
                                                      args.batch_max_tokens))
            deadline = time.monotonic() + 3600
            while len(done_times(r, b_ids)) < len(b_ids) and time.monotonic() < deadline:
                time.sleep(2.0)
            b_done, a_done = done_times(r, b_ids), done_times(r, a_ids)
            b_start, a_start = start_times(r, b_ids), start_times(r, a_ids)
            # NOTE: A's requests already running when B submitted finish inside the span of
            # B's; counted by admission, only what the workers chose while both had work
            # queued counts (ignore_eos: each makes exactly --batch-max-tokens tokens).
            tokens = args.batch_max_tokens
            by_start = share_of_b({i: (ms, tokens) for i, ms in a_start.items()},
                                  {i: (ms, tokens) for i, ms in b_start.items()})
            by_done = share_of_b(a_done, b_done)
            end = max(ms for ms, _ in b_done.values())
            a_left = len(a_ids) - len([ms for ms, _ in a_done.values() if ms <= end])
            print(f"fair share: A queued {args.tenant_a}, then B {args.tenant_b} (A still had "
                  f"{a_left} queued or running when B's last finished)")
            for what, (share, a_tokens, b_tokens, seconds) in (
                    ("admitted", by_start), ("finished", by_done)):
                print(f"  over the {seconds:.1f} s B's requests were {what} in: B {b_tokens} "
                      f"output tokens, A {a_tokens}: B's share {share:.1%} (bar 45-55%)")

            # -- interactive under a batch backlog -------------------------------------------
            backlog = batch_backlog(client, "A")
            more = max(0, args.backlog - backlog)
            client.submit_many(batch_requests("A", args.tenant_a, more, args.batch_max_tokens))
            time.sleep(2.0)  # the workers full of batch work
            added = 0  # batch requests A added during the interactive stream

            def top_up() -> None:
                nonlocal added
                more = max(0, args.backlog - batch_backlog(client, "A"))
                client.submit_many(batch_requests("A", args.tenant_a + args.backlog + added,
                                                  more, args.batch_max_tokens))
                added += more

            before, began = batch_backlog(client, "A"), time.monotonic()
            loaded = interactive_ttfts(client, "loaded", args.samples,
                                       args.interactive_max_tokens, top_up)
            after, seconds = batch_backlog(client, "A"), time.monotonic() - began
            ratio = percentile(loaded, 99) / percentile(idle, 99)
            loaded_ids = [f"B:loaded-{i}" for i in range(args.samples)]
            queued, engine, split = server_side(r, loaded_ids)
            print(f"  server side: queued to admitted p50 {percentile(queued, 50):.0f} ms, p99 "
                  f"{percentile(queued, 99):.0f} ms; admitted to first token p50 "
                  f"{percentile(engine, 50):.0f} ms, p99 {percentile(engine, 99):.0f} ms")
            slowest = sorted(zip(loaded, loaded_ids, strict=True), reverse=True)[:5]
            print("  slowest loaded: " + ", ".join(
                f"{ttft * 1000:.0f} ms ({split[i][0]} + {split[i][1]} ms)" if i in split
                else f"{ttft * 1000:.0f} ms" for ttft, i in slowest)
                  + " (client TTFT (queued + admitted to first token))")
            print(f"batch backlog of A: {before} queued when the interactive stream began, "
                  f"{after} when it ended ({added} added), {seconds:.1f} s later: batch work "
                  f"taken at {(before + added - after) * args.batch_max_tokens / seconds:.1f} "
                  f"output tokens/s")
            print(f"loaded pool: interactive TTFT p50 {percentile(loaded, 50) * 1000:.0f} ms, "
                  f"p99 {percentile(loaded, 99) * 1000:.0f} ms: {ratio:.2f} x the idle p99 "
                  f"(bar <= 1.5)")
    finally:
        subprocess.run([*LLMQ, "down"], env=env, check=False, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
