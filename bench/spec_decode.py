"""Speculative decoding, single stream: llmq with and without prompt lookup, and llama.cpp's
`llama-lookup`, on the same prompts in the same run.

    flock /tmp/bench.lock .venv/bin/python bench/spec_decode.py
    .venv/bin/python bench/spec_decode.py --repeats 1 --max-tokens 128 --skip-llama

Two workloads of chat prompts for the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF for
both engines, one thread each):
- copy-heavy: answers that repeat spans of the prompt (a list in reverse order, a JSON record
  re-formatted, a summary made of the text's own sentences, a function with type hints added);
- no-repeat: free story writing, where prompt lookup rarely finds anything to draft.

Greedy decoding, up to --max-tokens per prompt, stopping at EOS. The figure is decode tokens/s
(output tokens after the first, over the time after the first: prefill excluded, as
llama-lookup reports it), summed over a workload's prompts; each configuration runs --repeats
times, interleaved, and the fastest run counts (the machine is shared and noisy). Also printed:
whether llmq's greedy output is the same with and without speculation, the acceptance rates,
and llmq's figures by CPU time as well (on a busy machine wall time mostly measures waiting for
a core; llama-lookup reports wall time only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.model.loader import load_model  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

PEERS = Path("/root/.cache/llmq-peers")
LLAMA_LOOKUP = PEERS / "llama-build/bin/llama-lookup"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

RECORD = {"id": 48213, "name": "Alice Johnson", "email": "alice.johnson@example.com",
          "age": 34, "city": "Portland", "state": "Oregon", "manager": "Bob Smith",
          "skills": ["python", "sql", "docker", "kubernetes"], "start_date": "2019-04-15",
          "active": True}
ARTICLE = (
    "The city council approved a new budget on Tuesday after a long debate. The budget adds "
    "funding for public libraries and for repairing roads in the northern districts. Mayor "
    "Elena Ruiz said the plan keeps taxes at their current level. Several residents spoke "
    "against cuts to the parks department during the public comment period. The council will "
    "review the spending again in six months.")
FUNCTION = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    result = []\n"
    "    total = 0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            result.append(total / window)\n"
    "    return result\n")

WORKLOADS = {
    "copy-heavy": [
        "Repeat the following list in reverse order, one item per line: apple, banana, "
        "cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, "
        "orange, papaya, quince, raspberry.",
        "Re-format this JSON record with one key per line and 2-space indentation, keeping "
        "every key and value exactly as it is:\n" + json.dumps(RECORD),
        "Summarize the following article by copying its two most important sentences word "
        "for word:\n" + ARTICLE,
        "Add type hints to this Python function and return the whole function:\n" + FUNCTION,
    ],
    "no-repeat": [
        "Write a short story about a dragon who learns to bake bread.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    ],
}


def chat_prompt(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


@dataclass
class Run:
    num_tokens: int  # decoded after the first
    seconds: float
    token_ids: list[int]
    drafted: int = 0
    accepted: int = 0
    cpu_seconds: float = 0.0  # llmq only: CPU time of the decode, immune to waiting for a core


def run_llmq(engine: EngineCore, prompt_ids: list[int], max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec_before = engine.stats()
    engine.add_request("bench", prompt_ids, params)
    tokens: list[int] = []
    first_at = end = cpu_first = cpu_end = 0.0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        end, cpu_end = time.perf_counter(), time.process_time()
        for out in outputs:
            if out.new_token_ids and not tokens:
                first_at, cpu_first = end, cpu_end  # the prefill's token: decoding starts
            tokens += out.new_token_ids
    spec = engine.stats()
    return Run(len(tokens) - 1, end - first_at, tokens,
               spec.spec_num_draft_tokens - spec_before.spec_num_draft_tokens,
               spec.spec_num_accepted_tokens - spec_before.spec_num_accepted_tokens,
               cpu_end - cpu_first)


def run_llama_lookup(binary: Path, model: Path, prompt: str, max_tokens: int,
                     draft_max: int) -> Run:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        proc = subprocess.run(
            [str(binary), "-m", str(model), "-f", f.name, "-n", str(max_tokens), "-t", "1",
             "--temp", "0", "--spec-draft-n-max", str(draft_max), "-c", "2048"],
            capture_output=True, text=True, timeout=600, check=False)
    finally:
        os.unlink(f.name)
    log = proc.stdout + proc.stderr
    decoded = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds", log)
    if proc.returncode or decoded is None:
        raise RuntimeError(f"llama-lookup failed ({proc.returncode}): {log[-2000:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    return Run(int(decoded.group(1)), float(decoded.group(2)), [],
               int(drafted.group(1)) if drafted else 0, int(accepted.group(1)) if accepted else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--llama-draft-max", type=int, default=None,
                    help="llama-lookup's --spec-draft-n-max (default: --num-speculative-tokens)")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the default model's")
    ap.add_argument("--llama-lookup", type=Path, default=LLAMA_LOOKUP,
                    help="the llama-lookup binary (built by ../shared/peers/setup.sh)")
    ap.add_argument("--skip-llama", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    gguf = args.gguf or ensure_default_model()
    loaded = load_model(gguf, "bfloat16")
    plain = EngineCore(EngineConfig(model=str(gguf)), loaded=loaded)
    spec = EngineCore(EngineConfig(
        model=str(gguf), speculative_method="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min),
        loaded=loaded)
    llama = not args.skip_llama and args.llama_lookup.exists()
    draft_max = args.llama_draft_max or args.num_speculative_tokens
    print(f"model {gguf.name}, 1 thread, greedy, max_tokens {args.max_tokens}, best of "
          f"{args.repeats}; llmq ngram k={args.num_speculative_tokens} "
          f"n={args.prompt_lookup_min}..{args.prompt_lookup_max}; llama-lookup "
          f"{'--spec-draft-n-max ' + str(draft_max) if llama else 'skipped'}")
    plain.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))  # warm up
    spec.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))

    for workload, prompts in WORKLOADS.items():
        totals = {"llmq": [0, 0.0], "llmq+ngram": [0, 0.0], "llama-lookup": [0, 0.0]}
        cpu = {"llmq": [0, 0.0], "llmq+ngram": [0, 0.0]}
        drafted = accepted = llama_drafted = llama_accepted = 0
        identical = True
        for user in prompts:
            text = chat_prompt(user)
            ids = loaded.tokenizer.encode(text)
            best: dict[str, Run] = {}
            for _ in range(args.repeats):
                runs = {"llmq": run_llmq(plain, ids, args.max_tokens),
                        "llmq+ngram": run_llmq(spec, ids, args.max_tokens)}
                if llama:
                    runs["llama-lookup"] = run_llama_lookup(args.llama_lookup, gguf, text,
                                                            args.max_tokens, draft_max)
                for name, run in runs.items():
                    if name not in best or run.num_tokens / run.seconds > \
                            best[name].num_tokens / best[name].seconds:
                        best[name] = run
            identical &= best["llmq"].token_ids == best["llmq+ngram"].token_ids
            drafted += best["llmq+ngram"].drafted
            accepted += best["llmq+ngram"].accepted
            if llama:
                llama_drafted += best["llama-lookup"].drafted
                llama_accepted += best["llama-lookup"].accepted
            for name, run in best.items():
                totals[name][0] += run.num_tokens
                totals[name][1] += run.seconds
                if name in cpu:
                    cpu[name][0] += run.num_tokens
                    cpu[name][1] += run.cpu_seconds
            print(f"  [{workload}] {user[:48]!r}: " + ", ".join(
                f"{name} {run.num_tokens} tok {run.num_tokens / run.seconds:.1f} tok/s"
                for name, run in best.items()))
        rate = {name: n / s if s else 0.0 for name, (n, s) in totals.items()}
        line = (f"{workload}: llmq {rate['llmq']:.1f} tok/s, llmq+ngram "
                f"{rate['llmq+ngram']:.1f} tok/s ({rate['llmq+ngram'] / rate['llmq']:.2f}x "
                f"llmq; acceptance {accepted}/{drafted})")
        if llama:
            line += (f", llama-lookup {rate['llama-lookup']:.1f} tok/s (llmq+ngram / "
                     f"llama-lookup = {rate['llmq+ngram'] / rate['llama-lookup']:.2f}x; its "
                     f"acceptance {llama_accepted}/{llama_drafted})")
        print(line)
        cpu_rate = {name: n / s if s else 0.0 for name, (n, s) in cpu.items()}
        print(f"  by CPU time (waits for the core excluded): llmq {cpu_rate['llmq']:.1f} tok/s, "
              f"llmq+ngram {cpu_rate['llmq+ngram']:.1f} tok/s "
              f"({cpu_rate['llmq+ngram'] / cpu_rate['llmq']:.2f}x)")
        print(f"  greedy output identical with and without speculation: {identical}")


if __name__ == "__main__":
    main()
