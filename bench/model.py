"""Model benchmark: load time, memory, prefill and decode tokens/s through the paged path.

    .venv/bin/python bench/model.py [--threads 1] [--configs bfloat16:native,float32:fp32]
                                    [--prompt-len 128] [--decode-steps 128] [--batch-sizes 1]

A config is `dtype:weights` (KV cache dtype, `--weights`). Each runs in its own process so load
time and RSS are not skewed by the other; "RSS" is the process after loading (weights, no KV
cache), "peak" its peak RSS over the whole run (VmHWM: loading, and every batch's KV cache and
steps), "weights" what the projections and the embedding hold. A batch size B decodes B copies
of the prompt (different tokens) together, as the engine would. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def rss_mib(field: str = "VmRSS") -> float:
    """The process's resident memory now (VmRSS), or its peak so far (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PagedSteps:
    """Drives `batch` sequences through the paged path like the model runner: one step
    prefills every prompt, then each step decodes all sequences together (greedy)."""

    def __init__(self, model, prompts, tables: list[list[int]], block_size: int, kv_caches
                 ) -> None:
        self.model, self.prompts, self.tables = model, prompts, tables
        self.block_size, self.kv_caches = block_size, kv_caches
        self.batch, self.prompt_len = prompts.shape

    def prefill(self):
        from llmq.worker.engine.model.attention import AttentionMetadata

        meta = AttentionMetadata.build([self.prompt_len] * self.batch,
                                       [self.prompt_len] * self.batch, self.tables,
                                       self.block_size)
        hidden = self.model(self.prompts.reshape(-1), meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1]).argmax(-1)

    def decode(self, tokens, steps: int) -> None:
        from llmq.worker.engine.model.attention import AttentionMetadata

        for step in range(steps):
            seq_len = self.prompt_len + step + 1
            meta = AttentionMetadata.build([1] * self.batch, [seq_len] * self.batch,
                                           self.tables, self.block_size)
            tokens = self.model.compute_logits(self.model(tokens, meta, self.kv_caches)).argmax(-1)


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from llmq.worker.engine.model.default_model import ensure_default_model
    from llmq.worker.engine.model.loader import load_model

    path = args.model or ensure_default_model()
    rss_before = rss_mib()
    start = time.perf_counter()
    loaded = load_model(path, args.dtype, args.weights)
    load_s = time.perf_counter() - start
    rss_loaded = rss_mib()
    model = loaded.model
    block_size = 16
    from llmq.worker.engine.model.linear import Linear

    held = sum(m.nbytes for m in model.modules() if isinstance(m, Linear))
    held += model.embed_tokens.nbytes + (model.embed_quant.nbytes if model.embed_quant else 0)
    result = {"dtype": args.dtype, "weights": model.weights, "load_s": load_s,
              "rss_mib": rss_loaded, "rss_model_mib": rss_loaded - rss_before,
              "weights_mib": held / 2**20, "runs": []}

    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, model.arch.vocab_size, (batch, args.prompt_len), generator=g)
        total = args.prompt_len + args.decode_steps
        blocks_per_seq = -(-total // block_size)
        tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                  for i in range(batch)]
        kv_caches = model.make_kv_caches(1 + batch * blocks_per_seq, block_size)

        steps = PagedSteps(model, prompts, tables, block_size, kv_caches)
        steps.decode(steps.prefill(), 4)  # warm-up: oneDNN builds its kernels on first use
        start = time.perf_counter()
        tokens = steps.prefill()
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        steps.decode(tokens, args.decode_steps)
        decode_s = time.perf_counter() - start
        result["runs"].append({
            "batch": batch,
            "prefill_tok_s": batch * args.prompt_len / prefill_s,
            "decode_tok_s": batch * args.decode_steps / decode_s,
            "decode_ms_per_step": 1e3 * decode_s / args.decode_steps,
        })
    result["rss_peak_mib"] = rss_mib("VmHWM")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help=".gguf file or HF folder (default model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default="bfloat16:native,bfloat16:bf16,float32:fp32",
                        help="dtype:weights pairs")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1",
                        type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--dtype", help=argparse.SUPPRESS)  # internal: run one config, print JSON
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.dtype:
        print(json.dumps(run_one(args)))
        return

    from llmq.worker.engine.model.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    print(f"model {os.path.basename(model)}  threads={args.threads}  "
          f"prompt {args.prompt_len} tokens, {args.decode_steps} decode steps, paged KV "
          f"(block 16)  torch threads via --threads", flush=True)
    print(f"{'config':<16} {'load s':>7} {'RSS MiB':>8} {'peak':>6} {'weights':>8} {'batch':>6} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13} {'ms/step':>8}", flush=True)
    for config in args.configs.split(","):
        dtype, weights = config.split(":")
        cmd = [sys.executable, __file__, "--dtype", dtype, "--weights", weights,
               "--threads", str(args.threads),
               "--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps),
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--model", model]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        for run in r["runs"]:
            print(f"{config:<16} {r['load_s']:>7.2f} {r['rss_mib']:>8.0f} "
                  f"{r['rss_peak_mib']:>6.0f} "
                  f"{r['weights_mib']:>8.0f} {run['batch']:>6} "
                  f"{run['prefill_tok_s']:>14.0f} {run['decode_tok_s']:>13.1f} "
                  f"{run['decode_ms_per_step']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
