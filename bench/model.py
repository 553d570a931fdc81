"""Model benchmark: load time, memory, prefill and decode tokens/s through the paged path.

    .venv/bin/python bench/model.py [--threads 1] [--configs bfloat16:native,float32:fp32]
                                    [--prompt-len 128] [--decode-steps 128] [--batch-sizes 1]
                                    [--kv-budget-mib 1024] [--max-batched-tokens 1024]

A config is `dtype:weights` (KV cache dtype, `--weights`). Each runs in its own process so load
time and RSS are not skewed by the other; "RSS" is the process after loading (weights, no KV
cache), "peak" its peak RSS over the whole run (VmHWM: loading, the KV cache and every
batch's steps), "weights" what the projections and the embedding hold. As a worker does, the
process allocates the KV cache of its budget once (the engine's default, 1 GiB) and prefills
in chunks of at most the engine's tokens a step; "peak / (file + KV)" is the peak over the
model file's size plus that KV cache (issue 21's bar for a worker: 1.5 at most). A batch size
B decodes B copies of the prompt (different tokens) together, as the engine would. Figures are
printed, never asserted.
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

    def prefill(self, max_tokens: int):
        """Every prompt, whole prompts a step up to `max_tokens` (the engine's chunks)."""
        import torch

        from llmq.worker.engine.model.attention import AttentionMetadata

        per_step = max(1, max_tokens // self.prompt_len)
        firsts = []
        for start in range(0, self.batch, per_step):
            rows = range(start, min(start + per_step, self.batch))
            meta = AttentionMetadata.build([self.prompt_len] * len(rows),
                                           [self.prompt_len] * len(rows),
                                           [self.tables[i] for i in rows], self.block_size)
            hidden = self.model(self.prompts[rows.start:rows.stop].reshape(-1), meta,
                                self.kv_caches)
            firsts.append(self.model.compute_logits(
                hidden[meta.query_start_loc[1:] - 1]).argmax(-1))
        return torch.cat(firsts)

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
    # the worker's KV cache: its budget's blocks, allocated (zeroed) once at start
    num_blocks = max(2, (args.kv_budget_mib << 20) // model.kv_cache_bytes_per_block(block_size))
    kv_caches = model.make_kv_caches(num_blocks, block_size)
    kv_mib = sum(c.nbytes for c in kv_caches) / 2**20
    from llmq.worker.engine.model.linear import Linear

    held = sum(m.nbytes for m in model.modules() if isinstance(m, Linear))
    held += model.embed_tokens.nbytes + (
        model.embed_quant.nbytes if model.embed_quant and not model.embed_tiles else 0)
    result = {"dtype": args.dtype, "weights": model.weights, "load_s": load_s,
              "rss_mib": rss_loaded, "rss_model_mib": rss_loaded - rss_before,
              "weights_mib": held / 2**20, "kv_mib": kv_mib,
              "file_mib": os.path.getsize(path) / 2**20 if os.path.isfile(path) else None,
              "runs": []}

    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, model.arch.vocab_size, (batch, args.prompt_len), generator=g)
        total = args.prompt_len + args.decode_steps
        blocks_per_seq = -(-total // block_size)
        tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                  for i in range(batch)]
        if 1 + batch * blocks_per_seq > num_blocks:
            raise SystemExit(f"batch {batch} needs {1 + batch * blocks_per_seq} KV blocks; "
                             f"--kv-budget-mib {args.kv_budget_mib} holds {num_blocks}")

        steps = PagedSteps(model, prompts, tables, block_size, kv_caches)
        steps.decode(steps.prefill(args.max_batched_tokens), 4)  # warm-up: oneDNN builds
        start = time.perf_counter()  # its kernels on first use
        tokens = steps.prefill(args.max_batched_tokens)
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
    parser.add_argument("--kv-budget-mib", type=int, default=1024,
                        help="the KV cache allocated at start (the worker's default budget)")
    parser.add_argument("--max-batched-tokens", type=int, default=1024,
                        help="prefill tokens a step (the engine's default)")
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
          f"(block 16), KV cache {args.kv_budget_mib} MiB, prefill chunks of "
          f"{args.max_batched_tokens} tokens", flush=True)
    print(f"{'config':<16} {'load s':>7} {'RSS MiB':>8} {'peak':>6} {'weights':>8} {'batch':>6} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13} {'ms/step':>8}", flush=True)
    for config in args.configs.split(","):
        dtype, weights = config.split(":")
        cmd = [sys.executable, __file__, "--dtype", dtype, "--weights", weights,
               "--threads", str(args.threads),
               "--prompt-len", str(args.prompt_len), "--decode-steps", str(args.decode_steps),
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--model", model,
               "--kv-budget-mib", str(args.kv_budget_mib),
               "--max-batched-tokens", str(args.max_batched_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        for run in r["runs"]:
            print(f"{config:<16} {r['load_s']:>7.2f} {r['rss_mib']:>8.0f} "
                  f"{r['rss_peak_mib']:>6.0f} "
                  f"{r['weights_mib']:>8.0f} {run['batch']:>6} "
                  f"{run['prefill_tok_s']:>14.0f} {run['decode_tok_s']:>13.1f} "
                  f"{run['decode_ms_per_step']:>8.1f}", flush=True)
        if r["file_mib"]:
            ratio = r["rss_peak_mib"] / (r["file_mib"] + r["kv_mib"])
            print(f"{config:<16} peak {r['rss_peak_mib']:.0f} MiB / (file {r['file_mib']:.0f} + "
                  f"KV {r['kv_mib']:.0f} MiB) = {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
