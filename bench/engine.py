"""Offline engine throughput, with plain transformers `generate` as the baseline in the same run.

    .venv/bin/python bench/engine.py                       # 64 x 128/128, bf16, 1 thread
    .venv/bin/python bench/engine.py --num-requests 16 --skip-baseline
    .venv/bin/python bench/engine.py --skip-baseline --batch-invariant   # the mode's cost

Prints output tokens/s, total (prompt + output) tokens/s, TTFT and inter-token latency
percentiles, single-sequence decode tokens/s, and the ratio to transformers. The machine is
shared and noisy: compare the ratio, and always read the thread setting beside a figure.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model import huge_pages  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402


def percentiles(values: list[float], qs=(50, 90, 99)) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    picks = [ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] for q in qs]
    return " ".join(f"p{q}={v * 1000:.1f}ms" for q, v in zip(qs, picks, strict=True))


def make_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # NOTE: ids below 100 include special tokens; random ordinary tokens keep the lengths exact.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


def run_engine(engine: EngineCore, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    last_token_at: dict[str, float] = {}
    ttfts: list[float] = []
    itls: list[float] = []
    num_output = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            num_output += len(out.new_token_ids)
            if out.request_id in last_token_at:
                itls.append(now - last_token_at[out.request_id])
            else:
                ttfts.append(now - start)
            last_token_at[out.request_id] = now
    elapsed = time.perf_counter() - start
    num_prompt = sum(len(p) for p in prompts)
    return {"elapsed": elapsed, "output_tps": num_output / elapsed,
            "total_tps": (num_output + num_prompt) / elapsed,
            "prompt_tps": num_prompt / elapsed, "ttft": ttfts, "itl": itls}


def single_sequence_decode(engine: EngineCore, prompt: list[int], output_len: int) -> float:
    result = run_engine(engine, [prompt], output_len)
    return 1.0 / statistics.mean(result["itl"])


def run_transformers(model_path: str, prompts: list[list[int]], output_len: int,
                     batch: int, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), torch_dtype=dtype)
    model.eval()
    start = time.perf_counter()
    num_output = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0)
        num_output += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elapsed = time.perf_counter() - start
    num_prompt = sum(len(p) for p in prompts)
    return {"elapsed": elapsed, "output_tps": num_output / elapsed,
            "total_tps": (num_output + num_prompt) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="concurrency")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", choices=["native", "bf16", "fp32"], default=None,
                    help="default: native (fp32 with --dtype float32)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="")
    ap.add_argument("--baseline-batch", type=int, default=16)
    ap.add_argument("--baseline-requests", type=int, default=16,
                    help="transformers runs only this many requests (it is slow); tok/s compare")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine batch-invariant (EngineConfig.batch_invariant)")
    args = ap.parse_args()

    model_path = args.model or str(ensure_default_model())
    config = EngineConfig(model=model_path, dtype=args.dtype, weights=args.weights,
                          threads=args.threads,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          batch_invariant=args.batch_invariant)
    t0 = time.perf_counter()
    engine = EngineCore(config)
    print(f"model {os.path.basename(model_path)}  dtype {args.dtype}  weights "
          f"{engine.runner.model.weights}  threads {args.threads}  "
          f"{'batch-invariant  ' if args.batch_invariant else ''}"
          f"load {time.perf_counter() - t0:.1f}s")
    prompts = make_prompts(engine.arch.vocab_size, args.num_requests, args.prompt_len)
    run_engine(engine, prompts[:2], 4)  # warm-up: first-call allocations, lazy inits

    single = single_sequence_decode(engine, prompts[0], args.output_len)
    print(f"llmq single-sequence decode: {single:.1f} tok/s")
    resident, huge = huge_pages.file_maps()
    print(f"  weights mapped from the repack cache: {huge / 2**20:.0f} of {resident / 2**20:.0f} "
          "MiB on 2 MiB pages (huge_pages.py: a lone decode's rate follows it)")

    r = run_engine(engine, prompts, args.output_len)
    print(f"llmq engine  {args.num_requests} x {args.prompt_len}/{args.output_len}, "
          f"max_num_seqs {args.max_num_seqs}: {r['elapsed']:.1f}s  "
          f"output {r['output_tps']:.1f} tok/s  prompt {r['prompt_tps']:.1f} tok/s  "
          f"total {r['total_tps']:.1f} tok/s")
    print(f"  TTFT {percentiles(r['ttft'])}   ITL {percentiles(r['itl'])}")
    stats = engine.stats()
    print(f"  preemptions {stats.num_preemptions}")

    if not args.skip_baseline:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        n = min(args.baseline_requests, len(prompts))
        b = run_transformers(model_path, prompts[:n], args.output_len, args.baseline_batch, dtype)
        print(f"transformers generate  {n} x {args.prompt_len}/{args.output_len}, batch "
              f"{args.baseline_batch}: {b['elapsed']:.1f}s  output {b['output_tps']:.1f} tok/s  "
              f"total {b['total_tps']:.1f} tok/s")
        print(f"ratio llmq / transformers: output {r['output_tps'] / b['output_tps']:.2f}x  "
              f"total {r['total_tps'] / b['total_tps']:.2f}x")


if __name__ == "__main__":
    main()
