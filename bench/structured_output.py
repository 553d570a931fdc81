"""What structured output costs the engine: a batch constrained to a JSON schema against the same
batch unconstrained, in one run.

    flock /tmp/bench.lock .venv/bin/python bench/structured_output.py [--batch 64]

Each round runs `--batch` chat prompts ("extract this person as JSON") with every request
constrained to one schema, then the same prompts unconstrained with each request's max_tokens
set to the length its constrained twin produced (ignore_eos), so both runs decode the same number
of tokens per request in the same batch shapes. Rounds alternate to spread the machine's noise.
Prints output tokens/s of both, the throughput cost, and the grammar's share: time to fill the
bitmask (per token per row) and to apply it to the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llmq.worker.engine import model_runner, structured_output  # noqa: E402
from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.sampling_params import (  # noqa: E402
    SamplingParams,
    StructuredOutputParams,
)

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "city", "job", "hobbies"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "job": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 24}},
        "married": {"type": "boolean"},
    },
}
PEOPLE = ["Maria Lopez, 34, an engineer in Madrid who loves chess and hiking",
          "Tom Baker, 58, a teacher from Leeds; he paints and keeps bees",
          "Aiko Tanaka is a 27-year-old doctor in Osaka who plays the violin",
          "Samuel Okafor (41) works as an artist in Lagos and enjoys football"]


class Timer:
    """Accumulates the seconds spent in one function, wrapped in place."""

    def __init__(self, owner, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]):
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_output = sum(o.usage.completion_tokens for o in outs)
    return outs, num_output / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    engine = EngineCore(EngineConfig(model=str(ensure_default_model()), dtype=args.dtype,
                                     threads=args.threads, max_num_seqs=args.batch,
                                     # NOTE: off, or the second run of a round would find
                                     # every prompt in the cache and skip its prefill.
                                     enable_prefix_caching=False))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        f"Extract the person as JSON ({i}): {PEOPLE[i % len(PEOPLE)]}.")}]))
        for i in range(args.batch)]
    spec = StructuredOutputParams("json_schema", json.dumps(SCHEMA))
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i,
                                  structured_output=spec) for i in range(args.batch)]
    fill = Timer(structured_output.GrammarMatcher, "fill_bitmask")
    apply = Timer(model_runner, "apply_token_bitmask")
    engine.generate(prompts[:2], constrained[:2])  # warm-up: compile, first-call allocations

    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    fill_per_row, apply_per_step, valid = [], [], 0
    for _ in range(args.rounds):
        fill.reset()
        apply.reset()
        outs, rate = run(engine, prompts, constrained)
        rates["constrained"].append(rate)
        fill_per_row.append(fill.seconds / fill.calls)
        apply_per_step.append(apply.seconds / apply.calls)
        valid += sum(o.finish_reason == "stop" for o in outs)
        lengths = [o.usage.completion_tokens for o in outs]
        free = [SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True)
                for i, n in enumerate(lengths)]
        rates["unconstrained"].append(run(engine, prompts, free)[1])
        print(f"round: constrained {rates['constrained'][-1]:.1f} tok/s, unconstrained "
              f"{rates['unconstrained'][-1]:.1f} tok/s, {sum(lengths)} tokens "
              f"(mean {statistics.mean(lengths):.0f} per request)")

    c, u = statistics.median(rates["constrained"]), statistics.median(rates["unconstrained"])
    print(f"batch {args.batch}, {args.dtype}, {args.threads} thread(s), {args.rounds} rounds "
          f"(medians): constrained {c:.1f} tok/s, unconstrained {u:.1f} tok/s, "
          f"cost {(1 - c / u) * 100:.1f}%")
    print(f"  mask fill per token per row: {statistics.median(fill_per_row) * 1e6:.0f} us; "
          f"apply per step (all rows): {statistics.median(apply_per_step) * 1e3:.2f} ms")
    print(f"  {valid} of {args.batch * args.rounds} constrained outputs ended by the grammar "
          f"(the rest hit max_tokens={args.max_tokens})")


if __name__ == "__main__":
    main()
