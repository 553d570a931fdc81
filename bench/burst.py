"""A burst on a real pool: does every worker start work at once, and how is the burst split?

    .venv/bin/python bench/burst.py                          # default model, 64 x 128/128
    .venv/bin/python bench/burst.py --model <1B .gguf> --output-len 32

Starts `llmq up --detach --workers 2` (its own server, in a private run folder), answers four
short warm-ups, then adds the burst's requests in one pipelined transaction (every entry in the
stream before any worker wakes) and waits for all of them. Prints, per worker, how many of the
burst it ran and how long after the burst its first request started (the start event's entry
time, the server's clock, against the burst's own entry ids), and the burst's drain time.
Issue 21's bar: both workers busy within 2 s of a 64-request burst. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis

from llmq import protocol
from llmq.broker.keys import Keys

LLMQ = str(Path(sys.executable).with_name("llmq"))


def entry_seconds(entry_id: bytes | str) -> float:
    """A stream entry id's server time, in seconds."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0]) / 1000.0


def first_start(r: redis.Redis, keys: Keys, request_id: str) -> tuple[str, float] | None:
    """(worker, server time) of the request's first start event, None before it has one."""
    for entry_id, fields in r.xrange(keys.result(request_id)):
        event = protocol.decode_event(fields)
        if isinstance(event, protocol.Start):
            return event.worker, entry_seconds(entry_id)
    return None


def finished(r: redis.Redis, keys: Keys, ids: list[str]) -> set[str]:
    """Those of `ids` whose result stream ends in a terminal event: each stream's last entry
    alone, in one round trip (the poll shares the cores with the pool it measures)."""
    with r.pipeline(transaction=False) as pipe:
        for request_id in ids:
            pipe.xrevrange(keys.result(request_id), count=1)
        lasts = pipe.execute()
    return {request_id for request_id, last in zip(ids, lasts, strict=True)
            if last and protocol.is_terminal(protocol.decode_event(last[0][1]))}


def add_all(r: redis.Redis, keys: Keys, requests: list[dict]) -> list[str]:
    """XADD every request in one MULTI/EXEC: the entry ids, which are the request ids."""
    with r.pipeline(transaction=True) as pipe:
        for request in requests:
            pipe.xadd(keys.queue("default"), {"json": json.dumps(request)})
        return [entry_id.decode() for entry_id in pipe.execute()]


def wait_all(r: redis.Redis, keys: Keys, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(ids)
    while waiting:
        if time.monotonic() > deadline:
            sys.exit(f"{len(waiting)} of {len(ids)} requests unanswered after {timeout:.0f} s")
        done = finished(r, keys, waiting)
        waiting = [i for i in waiting if i not in done]
        time.sleep(0.2)


def run_burst(url: str, args: argparse.Namespace) -> dict:
    keys = Keys()
    r = redis.Redis.from_url(url)
    rng = random.Random(1)
    warm_ups = add_all(r, keys, [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(8)],
                                  "max_tokens": 4} for _ in range(4)])
    wait_all(r, keys, warm_ups, timeout=120)
    time.sleep(args.settle)  # each worker's heartbeat has seen the other
    ids = add_all(r, keys, [{"prompt_token_ids": [rng.randrange(100, 20000)
                                                  for _ in range(args.prompt_len)],
                             "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
                            for _ in range(args.num_requests)])
    burst_at = entry_seconds(ids[0])
    wait_all(r, keys, ids, timeout=args.timeout)
    starts = {i: first_start(r, keys, i) for i in ids}
    ends = [entry_seconds(r.xrevrange(keys.result(i), count=1)[0][0]) for i in ids]
    ran = Counter(worker for worker, _ in starts.values())
    first = {worker: round(min(t for w, t in starts.values() if w == worker) - burst_at, 3)
             for worker in sorted(ran)}
    drain_s = max(ends) - burst_at
    return {"requests": len(ids), "ran": dict(sorted(ran.items())),
            "first_start_s": first, "slowest_first_start_s": max(first.values()),
            "drain_s": round(drain_s, 2),
            "total_tok_s": round(len(ids) * (args.prompt_len + args.output_len) / drain_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help=".gguf file or HF folder (default model)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="bursts, one after the other")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the warm-ups' answers and the burst")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()

    run_dir = tempfile.mkdtemp(prefix="llmq-burst-")
    env = dict(os.environ, LLMQ_RUN_DIR=run_dir)
    up = [LLMQ, "up", "--detach", "--workers", str(args.workers)]
    subprocess.run(up + (["--model", args.model] if args.model else []), env=env, check=True)
    try:
        for round_ in range(args.rounds):
            result = run_burst(f"unix://{run_dir}/redis.sock", args)
            print(json.dumps({"round": round_, **result}), flush=True)
    finally:
        subprocess.run([LLMQ, "down"], env=env, check=False)


if __name__ == "__main__":
    main()
