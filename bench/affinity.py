"""Prefix-cache affinity across workers: hit rate and throughput on `llmq up` pools.

    .venv/bin/python bench/affinity.py                   # the issue-27 bars, default model
    .venv/bin/python bench/affinity.py --prefixes 8 --per-prefix 8 --skip-single   # quicker
    .venv/bin/python bench/affinity.py --lane batch      # the same on the batch lane

Workload (issue 27): P distinct shared prefixes of 1,024 tokens, R requests each with a 32-token
suffix of its own and 64 output tokens (greedy, ignore_eos), submitted shuffled in one
`submit_many` (on the queue's own stream, or with `--lane batch` on the batch lane, where file
jobs, the Batch API and dataset jobs submit). Each scenario runs on a fresh `llmq up --detach`
pool (its own run folder and server), LLMQ_AFFINITY=1 or 0 in the workers' environment:

    single     1 worker with the pool's whole KV cache (2 x --kv-blocks): the hit rate a pool
               should approach, one cache holding every prefix
    off / on   2 workers, affinity off / on   (bar: on hit rate >= 0.9x single, tok/s >= 1.3x off)
    one-off / one-on  2 workers, every request on ONE prefix (bar: on tok/s >= 0.95x off: both
               workers stay busy although one prefix would send everything to one)

Figures come from the requests' own events: the hit rate is the summed `cached_prompt_tokens`
over the summed `prompt_tokens` of the done events, per worker (the worker of each request's
`start`) and pool-wide; tokens/s is prompt + output tokens over the time from the submission
to the last terminal event (server clock). Same work in every scenario, so the tokens/s ratio is
the wall-time ratio.

The KV cache is sized (`--kv-blocks`, 384 blocks of 16 tokens by default: six 64-block prefixes
with no request running) so one worker holds about half of the eight prefixes next to its
running requests: the case affinity is for, a pool whose prefixes outgrow one worker's cache.
(768 blocks, the default before, held all eight beside the few requests the intake window lets
start at once: with affinity off each worker hit 90.7% and affinity changed nothing, 1.00x;
bench/results/affinity-full-2026-12-02.txt.) With the default 1 GiB budget each worker holds all
eight and affinity can only save the second copy of each prefix (`--kv-blocks 0` measures that).
The machine is shared: run it under `flock /tmp/bench.lock`, and read the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.embedded import EmbeddedServer
from llmq.broker.keys import Keys

KEYS = Keys()
# SmolLM2-135M (the default model): 30 layers x 3 KV heads x 64 dims, keys and values in bf16.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
BLOCK_SIZE = 16


@dataclass
class Outcome:
    name: str
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    per_worker: dict[str, list[int]] = field(default_factory=dict)  # [prompt, cached, requests]
    errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds if self.seconds else 0.0

    @property
    def output_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        workers = ", ".join(f"{w}: {c / p:.1%} of {n}" for w, (p, c, n) in
                            sorted(self.per_worker.items()) if p)
        return (f"{self.name:8} {self.seconds:7.1f} s  {self.tokens_per_s:7.1f} tok/s "
                f"({self.output_per_s:6.1f} out)  hit rate {self.hit_rate:6.1%}  "
                f"[{workers}]{f'  ERRORS {self.errors}' if self.errors else ''}")


def workload(num_prefixes: int, per_prefix: int, seed: int,
             lane: str | None = None) -> list[dict[str, object]]:
    rng = random.Random(seed)
    # NOTE: ids well inside the vocabulary, distinct from the first token on, so no two
    # prefixes share a block.
    prefixes = [[rng.randrange(1000, 40000) for _ in range(1024)] for _ in range(num_prefixes)]
    requests = [{"prompt_token_ids": prefix + [rng.randrange(1000, 40000) for _ in range(32)],
                 "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
                 **({"lane": lane} if lane else {})}
                for prefix in prefixes for _ in range(per_prefix)]
    rng.shuffle(requests)
    return requests


def run(name: str, requests: list[dict[str, object]], workers: int, affinity: bool,
        kv_blocks: int) -> Outcome:
    run_dir = Path(tempfile.mkdtemp(prefix=f"llmq-affinity-{name}-"))
    env = {**os.environ, "LLMQ_RUN_DIR": str(run_dir), "LLMQ_AFFINITY": "1" if affinity else "0"}
    env.pop("LLMQ_REDIS_URL", None)  # the pool's own server
    engine = ["--threads", "1"]
    if kv_blocks:
        engine += ["--kv-cache-memory-bytes", str(kv_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN)]
    llmq = [sys.executable, "-m", "llmq.cli.main"]
    subprocess.run([*llmq, "up", "--workers", str(workers), "--detach", *engine], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    try:
        url = EmbeddedServer(run_dir).running_url()
        assert url is not None, f"no server under {run_dir}"
        return measure(name, url, requests)
    finally:
        subprocess.run([*llmq, "down"], env=env, check=False, stdout=subprocess.DEVNULL)


def measure(name: str, url: str, requests: list[dict[str, object]]) -> Outcome:
    r = redis.Redis.from_url(url)
    with Client(url) as client:
        sec, usec = r.time()
        submitted_ms = sec * 1000 + usec // 1000
        ids = client.submit_many(requests)
    outcome = Outcome(name)
    pending = set(ids)
    last_ms = submitted_ms
    per_worker: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    while pending:
        time.sleep(0.5)
        pipe = r.pipeline(transaction=False)
        order = sorted(pending)
        for request_id in order:
            pipe.xrange(KEYS.result(request_id))
        for request_id, entries in zip(order, pipe.execute(), strict=True):
            events = [(entry_id, protocol.decode_event(fields)) for entry_id, fields in entries]
            terminal = [(i, e) for i, e in events if protocol.is_terminal(e)]
            if not terminal:
                continue
            pending.discard(request_id)
            entry_id, final = max(terminal, key=lambda t: t[1].attempt)
            last_ms = max(last_ms, int(entry_id.decode().partition("-")[0]))
            if not isinstance(final, protocol.Done):
                outcome.errors += 1
                continue
            worker = next((e.worker for _, e in reversed(events)
                           if isinstance(e, protocol.Start) and e.attempt == final.attempt), "?")
            usage = final.usage
            outcome.prompt_tokens += usage.prompt_tokens
            outcome.cached_tokens += usage.cached_prompt_tokens
            outcome.output_tokens += usage.completion_tokens
            row = per_worker[worker]
            row[0] += usage.prompt_tokens
            row[1] += usage.cached_prompt_tokens
            row[2] += 1
    outcome.seconds = (last_ms - submitted_ms) / 1000.0
    outcome.per_worker = dict(per_worker)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--per-prefix", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=384,
                        help="KV blocks per worker (0: the default 1 GiB budget)")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--skip-single", action="store_true")
    parser.add_argument("--skip-one-prefix", action="store_true")
    parser.add_argument("--lane", choices=["interactive", "batch"], default=None,
                        help="the requests' lane (default: none, the queue's own stream)")
    args = parser.parse_args(argv)
    mixed = workload(args.prefixes, args.per_prefix, args.seed, args.lane)
    one = workload(1, args.prefixes * args.per_prefix, args.seed, args.lane)
    print(f"{len(mixed)} requests: {args.prefixes} prefixes x {args.per_prefix}, 1,024 + 32 "
          f"prompt tokens, 64 out; KV {args.kv_blocks or 'default'} blocks per worker; "
          f"lane {args.lane or 'none (the queue stream)'}", flush=True)
    outcomes: dict[str, Outcome] = {}
    kv = args.kv_blocks
    plan = [("off", mixed, 2, False, kv), ("on", mixed, 2, True, kv)]
    if not args.skip_single:
        plan.insert(0, ("single", mixed, 1, False, 2 * kv))
    if not args.skip_one_prefix:
        plan += [("one-off", one, 2, False, kv), ("one-on", one, 2, True, kv)]
    for name, requests, workers, affinity, kv_blocks in plan:
        outcomes[name] = run(name, requests, workers, affinity, kv_blocks)
        print(outcomes[name].line(), flush=True)
    on, off = outcomes["on"], outcomes["off"]
    print()
    if "single" in outcomes:
        single = outcomes["single"]
        ratio = on.hit_rate / single.hit_rate if single.hit_rate else float("inf")
        print(f"hit rate on / single   {ratio:5.2f}  (bar >= 0.9)  "
              f"[{on.hit_rate:.1%} / {single.hit_rate:.1%}; off {off.hit_rate:.1%}]")
    print(f"tok/s on / off         {on.tokens_per_s / off.tokens_per_s:5.2f}  (bar >= 1.3)")
    if "one-on" in outcomes:
        print(f"one prefix on / off    "
              f"{outcomes['one-on'].tokens_per_s / outcomes['one-off'].tokens_per_s:5.2f}  "
              f"(bar >= 0.95)")
    return 1 if any(o.errors for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
