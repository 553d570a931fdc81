"""`llmq bench`: a load generator against a running pool, like vLLM's `benchmark_serving`.

It sends N requests with at most C in flight (random prompts of a fixed token length, or the
requests of a JSONL file), follows every result stream as a client would, and prints throughput
and the latency a user sees: time to first token (submit -> first delta), inter-token latency
(gap between deltas, per token) and end-to-end latency, as mean / p50 / p90 / p99. While it
runs, a live bar on stderr shows the requests done and the tokens per second it receives
(cli/bench_progress.py).

Random prompts are `prompt_token_ids` drawn from [100, 500), valid for any vocabulary of 500 or
more, with `ignore_eos` so every request produces exactly `--output-len` tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import click

from llmq.broker.aio import AsyncClient
from llmq.broker.commands import build_submission
from llmq.cli.bench_progress import BenchProgress
from llmq.cli.helpers import echo_json
from llmq.cli.options import ConnectionFlags, connection_kwargs, connection_options
from llmq.protocol import Delta, Done, Error, Start
from llmq.protocol.errors import LLMQError

_TOKEN_IDS = (100, 500)


@dataclass
class Sample:
    ok: bool = False
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def _requests(num: int, prompt_len: int, output_len: int, file: str | None, seed: int
              ) -> list[dict[str, Any]]:
    if file is not None:
        with open(file, encoding="utf-8") as f:
            bodies = [json.loads(line) for line in f if line.strip()]
        if not bodies:
            raise click.BadParameter("the file has no requests", param_hint="--file")
        for body in bodies:
            body.pop("id", None)  # every run sends them afresh
        return [dict(bodies[i % len(bodies)]) for i in range(num)]
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(*_TOKEN_IDS) for _ in range(prompt_len)],
             "max_tokens": output_len, "ignore_eos": True, "seed": seed + i}
            for i in range(num)]


async def _one(client: AsyncClient, body: dict[str, Any], timeout: float,
               progress: BenchProgress | None = None) -> Sample:
    sample = Sample()
    sent = time.perf_counter()
    try:
        request_id = await client.submit(**_split(body))
        last = sent
        async for event in client.events(request_id, timeout=timeout):
            now = time.perf_counter()
            if isinstance(event, Start) and event.attempt > 1:
                sample.ttft, sample.itl = None, []  # a re-run: measure the attempt that counts
            elif isinstance(event, Delta) and event.token_ids:
                if progress is not None:
                    progress.token(len(event.token_ids))
                if sample.ttft is None:
                    sample.ttft = now - sent
                else:
                    gap = (now - last) / len(event.token_ids)
                    sample.itl += [gap] * len(event.token_ids)
                last = now
            elif isinstance(event, Done):
                sample.ok = event.finish_reason != "cancelled"
                sample.e2e = now - sent
                sample.prompt_tokens = event.usage.prompt_tokens
                sample.output_tokens = event.usage.completion_tokens
            elif isinstance(event, Error):
                sample.error = event.code
    except LLMQError as exc:
        sample.error = type(exc).__name__
    if progress is not None:
        progress.finished(sample.ok)
    return sample


def _split(body: dict[str, Any]) -> dict[str, Any]:
    """Request fields as AsyncClient.submit's arguments."""
    body = dict(body)
    return {"prompt": body.pop("prompt", None), **body}


async def _run(client: AsyncClient, bodies: list[dict[str, Any]], concurrency: int,
               timeout: float, progress: BenchProgress | None = None
               ) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    samples: list[Sample] = []

    async def user() -> None:
        while not queue.empty():
            samples.append(await _one(client, queue.get_nowait(), timeout, progress))

    async def draw() -> None:
        while progress is not None:
            progress.tick()
            await asyncio.sleep(0.25)

    started = time.perf_counter()
    drawing = asyncio.create_task(draw())
    try:
        await asyncio.gather(*(user() for _ in range(min(concurrency, len(bodies)))))
    finally:
        drawing.cancel()
        if progress is not None:
            progress.stop()
    return samples, time.perf_counter() - started


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"mean": statistics.fmean(values) * 1000, "p50": pick(0.5), "p90": pick(0.9),
            "p99": pick(0.99)}


def report(samples: list[Sample], duration: float, concurrency: int) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    output_tokens = sum(s.output_tokens for s in ok)
    prompt_tokens = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(samples), "completed": len(ok), "failed": len(samples) - len(ok),
        "concurrency": concurrency, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens, "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "ttft_ms": _stats([s.ttft for s in ok if s.ttft is not None]),
        "itl_ms": _stats([gap for s in ok for gap in s.itl]),
        "e2e_ms": _stats([s.e2e for s in ok]),
    }


def _ms(stats: dict[str, float | None]) -> str:
    return "  ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in stats.items())


@click.command()
@click.option("-n", "--num-requests", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight at a time.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens of each random request.")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Output tokens of each random request (ignore_eos).")
@click.option("-f", "--file", type=click.Path(exists=True, dir_okay=False),
              help="Send these requests (wire-format JSONL, reused round-robin) instead.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds one request may take.")
@click.option("--json", "as_json", is_flag=True, help="The figures as one JSON object.")
@connection_options
def bench(num_requests: int, concurrency: int, prompt_len: int, output_len: int,
          file: str | None, seed: int, timeout: float, as_json: bool, **kwargs: Any) -> None:
    """Load-test the running pool: throughput, TTFT and inter-token latency percentiles."""
    bodies = _requests(num_requests, prompt_len, output_len, file, seed)
    samples, duration = asyncio.run(_bench(connection_kwargs(kwargs), bodies, concurrency,
                                           timeout))
    figures = report(samples, duration, concurrency)
    errors = sorted({s.error for s in samples if s.error})
    if as_json:
        echo_json({**figures, "errors": errors})
        return
    click.echo(f"requests      {figures['completed']} ok, {figures['failed']} failed "
               f"in {duration:.2f} s at concurrency {concurrency}"
               + (f" (errors: {', '.join(errors)})" if errors else ""))
    click.echo(f"throughput    {figures['request_throughput']:.2f} req/s, "
               f"{figures['output_throughput']:.1f} output tok/s, "
               f"{figures['total_token_throughput']:.1f} total tok/s")
    click.echo(f"tokens        {figures['prompt_tokens']} prompt, "
               f"{figures['output_tokens']} output")
    click.echo(f"TTFT ms       {_ms(figures['ttft_ms'])}")
    click.echo(f"ITL ms        {_ms(figures['itl_ms'])}")
    click.echo(f"E2E ms        {_ms(figures['e2e_ms'])}")


async def _bench(connection: ConnectionFlags, bodies: list[dict[str, Any]], concurrency: int,
                 timeout: float) -> tuple[list[Sample], float]:
    async with AsyncClient(**connection) as client:
        queue = client.settings.queue
        if not any(w.queue == queue for w in await client.workers()):
            raise LLMQError(f"no worker is serving queue {queue!r}: start the pool first "
                            "(`llmq up`, or `llmq worker`)")
        for body in bodies:  # fail before sending anything, naming the field
            build_submission(body)
        return await _run(client, bodies, concurrency, timeout, BenchProgress(len(bodies)))
