"""What an interactive arrival waits for in one engine busy with batch work, with and without
paused steps (worker/engine/step_interrupt.py; docs/performance.md "Interruptible steps").

    flock /tmp/bench.lock .venv/bin/python bench/pause_latency.py --pauses on
    flock /tmp/bench.lock .venv/bin/python bench/pause_latency.py --pauses off

One engine (the default model, one thread) with --backlog batch requests of bench/lanes.py's
shape (4 output tokens), stepped by this process as the worker's busy loop steps it; a thread
sends an interactive request (16 output tokens) every 0.3-0.6 s (seeded), signalling the
engine as admission does. Prints, over --seconds, the time from each arrival to its first
token (p50, p90, max), the batch output tokens, and the steps paused and dropped. No Redis, so
the figures are the engine's alone; `--pauses off` is the engine without pausing (main).
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Item {i}. Write the next item of this list, one short line."
BATCH = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
INTERACTIVE = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pauses", choices=("on", "off"), default="on")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--backlog", type=int, default=3000)
    ap.add_argument("--model", default="")
    args = ap.parse_args()

    engine = EngineCore(EngineConfig(model=args.model, threads=1))
    if args.pauses == "off":
        engine.step_interrupt.pause_check = lambda has_batch_work: None  # type: ignore[method-assign] # main: nothing pauses
    encode = engine.tokenizer.encode
    for i in range(args.backlog):
        engine.add_request(f"b{i}", encode(PROMPT.format(i=i)), BATCH, batch=True)
    for _ in range(20):  # the engine full of batch work
        engine.step()

    arrivals: queue.SimpleQueue[str] = queue.SimpleQueue()
    arrived: dict[str, float] = {}
    stop = threading.Event()

    def send() -> None:
        rng = random.Random(7)
        i = 0
        while not stop.wait(rng.uniform(0.3, 0.6)):
            request_id = f"i{i}"
            i += 1
            arrived[request_id] = time.perf_counter()
            arrivals.put(request_id)
            engine.step_interrupt.request()  # after the put, as admission does

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    first: dict[str, float] = {}
    batch_tokens = 0
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        engine.step_interrupt.clear()  # before the drain, as the busy loop does
        while True:
            try:
                request_id = arrivals.get_nowait()
            except queue.Empty:
                break
            engine.add_request(request_id, encode(PROMPT.format(i=1000 + int(request_id[1:]))),
                               INTERACTIVE)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id.startswith("i"):
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = now
            else:
                batch_tokens += len(out.new_token_ids)
    stop.set()
    waits = sorted((first[r] - arrived[r]) * 1000 for r in first)
    print(f"pauses {args.pauses}: {len(waits)} interactive arrivals, arrival to first token "
          f"p50 {waits[len(waits) // 2]:.0f} ms, p90 {waits[int(len(waits) * 0.9)]:.0f} ms, "
          f"max {waits[-1]:.0f} ms; batch output tokens in {args.seconds:.0f} s: {batch_tokens}; "
          f"steps paused {engine.step_interrupt.num_paused}, dropped "
          f"{engine.step_interrupt.num_dropped}")


if __name__ == "__main__":
    main()
