"""Speculative decoding with a draft model, single stream: llmq with and without the draft, on
bench/spec_decode.py's prompts (copy-heavy and no-repeat workloads), same run.

    flock /tmp/bench.lock .venv/bin/python bench/spec_decode_draft.py
    flock /tmp/bench.lock .venv/bin/python bench/spec_decode_draft.py \
        --target ~/.cache/llmq-peers/big/model.Q4_K_M.gguf --target-weights native

Pairs worth running on one machine without downloads (the draft: the default model's GGUF):
- default: the default model with float32 projections as the target, drafted by the same
  GGUF on its native 4-bit kernels (~3x cheaper, and agreeing on most tokens): what a
  cheap, agreeing draft buys;
- `--target` the 1B-class random-weight Llama of ../shared/peers/setup.sh `big` (SmolLM2's
  vocabulary): a draft that is almost never accepted, so the figure is what the back-off
  leaves of its cost.
Greedy, decode tokens/s (prefill excluded) as bench/spec_decode.py counts them, fastest of
--repeats; also the acceptance and whether the output is identical with and without the draft.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling bench/spec_decode.py

import torch  # noqa: E402
from spec_decode import WORKLOADS, Run, chat_prompt, run_llmq  # noqa: E402

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.model.loader import load_model  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=None, help="default: the default model")
    ap.add_argument("--target-weights", default="fp32", choices=["native", "bf16", "fp32"])
    ap.add_argument("--draft", type=Path, default=None, help="default: the default model")
    ap.add_argument("--draft-weights", default="native", choices=["native", "bf16", "fp32"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()

    torch.set_num_threads(1)
    target_path = args.target or ensure_default_model()
    draft_path = args.draft or ensure_default_model()
    target = load_model(target_path, "bfloat16", args.target_weights)
    draft = load_model(draft_path, "bfloat16", args.draft_weights)
    config = EngineConfig(model=str(target_path), weights=args.target_weights,
                          kv_cache_memory_bytes=1 << 28)
    plain = EngineCore(config, loaded=target)
    spec = EngineCore(EngineConfig(
        model=str(target_path), weights=args.target_weights, kv_cache_memory_bytes=1 << 28,
        speculative_method="draft", draft_model=str(draft_path),
        num_speculative_tokens=args.num_speculative_tokens), loaded=target, draft=draft)
    print(f"target {target_path.name} ({args.target_weights}), draft {draft_path.name} "
          f"({args.draft_weights}), 1 thread, greedy, max_tokens {args.max_tokens}, best of "
          f"{args.repeats}, k={args.num_speculative_tokens}")
    for engine in (plain, spec):  # warm up
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))

    for workload, prompts in WORKLOADS.items():
        totals = {"llmq": [0, 0.0], "llmq+draft": [0, 0.0]}
        drafted = accepted = 0
        identical = True
        for user in prompts:
            ids = target.tokenizer.encode(chat_prompt(user))
            best: dict[str, Run] = {}
            for _ in range(args.repeats):
                runs = {"llmq": run_llmq(plain, ids, args.max_tokens),
                        "llmq+draft": run_llmq(spec, ids, args.max_tokens)}
                for name, run in runs.items():
                    if name not in best or run.num_tokens / run.seconds > \
                            best[name].num_tokens / best[name].seconds:
                        best[name] = run
            identical &= best["llmq"].token_ids == best["llmq+draft"].token_ids
            drafted += best["llmq+draft"].drafted
            accepted += best["llmq+draft"].accepted
            for name, run in best.items():
                totals[name][0] += run.num_tokens
                totals[name][1] += run.seconds
            print(f"  [{workload}] {user[:48]!r}: " + ", ".join(
                f"{name} {run.num_tokens} tok {run.num_tokens / run.seconds:.1f} tok/s"
                for name, run in best.items()))
        rate = {name: n / s if s else 0.0 for name, (n, s) in totals.items()}
        print(f"{workload}: llmq {rate['llmq']:.1f} tok/s, llmq+draft "
              f"{rate['llmq+draft']:.1f} tok/s ({rate['llmq+draft'] / rate['llmq']:.2f}x; "
              f"acceptance {accepted}/{drafted})")
        print(f"  greedy output identical with and without the draft: {identical}")


if __name__ == "__main__":
    main()
