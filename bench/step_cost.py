"""What one engine step costs by its prompt tokens and its decode rows (choosing
`max_batch_prefill_tokens`, docs/performance.md "Lanes and fair share").

    flock /tmp/bench.lock .venv/bin/python bench/step_cost.py
    flock /tmp/bench.lock .venv/bin/python bench/step_cost.py --decode-rows 0,48 --prompt 16

For each number of decode rows D, D requests are started and run until all decode; then, for
each number of prompt tokens P, P / --prompt new requests of --prompt tokens each (distinct,
so nothing is a prefix-cache hit) are added and one step computes their prompts beside the D
decode rows; they are aborted before the next measurement. Prints the median CPU time of that
step (robust to a busy neighbour, unlike wall time) and its wall time, over --repeats steps.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

DECODE = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-rows", type=ints, default=[0, 16, 48])
    ap.add_argument("--prompt-tokens", type=ints, default=[0, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--prompt", type=int, default=16, help="tokens of each new prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="")
    args = ap.parse_args()

    engine = EngineCore(EngineConfig(model=args.model, max_num_seqs=256,
                                     max_num_batched_tokens=max(args.prompt_tokens) + 256))
    vocab = engine.vocab_size
    serial = itertools.count()

    def fresh_prompt(length: int) -> list[int]:
        n = next(serial)
        return [1 + (n * 7919 + j * 104729) % (vocab - 1) for j in range(length)]

    print(f"model {args.model or 'default'}, bfloat16 KV, 1 thread; new prompts of "
          f"{args.prompt} tokens; median of {args.repeats} steps")
    print("decode rows | prompt tokens | step CPU ms | step wall ms | CPU ms per prompt token")
    for rows in args.decode_rows:
        decoding = [f"d{next(serial)}" for _ in range(rows)]
        for request_id in decoding:
            engine.add_request(request_id, fresh_prompt(args.prompt), DECODE)
        while any(engine.scheduler.requests[r].num_output_tokens == 0 for r in decoding):
            engine.step()
        base = None
        for tokens in args.prompt_tokens:
            cpu, wall = [], []
            for _ in range(args.repeats):
                new = [f"p{next(serial)}" for _ in range(tokens // args.prompt)]
                for request_id in new:
                    engine.add_request(request_id, fresh_prompt(args.prompt), ONE)
                started_cpu, started_wall = time.process_time(), time.perf_counter()
                engine.step()
                cpu.append(time.process_time() - started_cpu)
                wall.append(time.perf_counter() - started_wall)
                engine.abort(new)
            ms = statistics.median(cpu) * 1000
            base = ms if base is None else base
            per_token = f"{(ms - base) / tokens:.2f}" if tokens else ""
            print(f"{rows:11d} | {tokens:13d} | {ms:11.1f} | "
                  f"{statistics.median(wall) * 1000:12.1f} | {per_token}")
        engine.abort(decoding)
        engine.step()


if __name__ == "__main__":
    main()
