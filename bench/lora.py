"""LoRA adapters in one batch: tokens/s of a batch mixing adapters against the base model alone,
same run, and the time a not-yet-loaded adapter takes to load.

    flock /tmp/bench.lock .venv/bin/python bench/lora.py
    .venv/bin/python bench/lora.py --requests 16 --max-tokens 16 --repeats 1

The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF on `--weights native`, one thread)
with random rank-16 adapters on every projection (q/k/v/o and gate/up/down), written in PEFT's
format. Each configuration is one batch of --requests greedy requests (--max-tokens each,
EOS ignored), all added at once and run to completion through the engine:

- base:             every request on the base model;
- N adapters:       the requests spread evenly over --adapters adapters (the issue's bar: 64
                    requests over 8 rank-16 adapters at >= 0.8x the base model's tokens/s);
- 4 adapters + base: a fifth of them each on four adapters and on the base model.

The figure is output tokens/s over the whole batch (prefill included); configurations run
--repeats times, interleaved, and the fastest run counts (the machine is shared and noisy).
Adapters are loaded before the timed runs; the cold load of one adapter is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.arch import ModelArchConfig  # noqa: E402
from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.model.loader import load_model  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, arch: ModelArchConfig, rank: int, seed: int) -> None:
    """A PEFT adapter folder with random weights small enough to keep the model sane."""
    shapes = {"q_proj": (arch.q_size, arch.hidden_size), "k_proj": (arch.kv_size, arch.hidden_size),
              "v_proj": (arch.kv_size, arch.hidden_size), "o_proj": (arch.hidden_size, arch.q_size),
              "gate_proj": (arch.intermediate_size, arch.hidden_size),
              "up_proj": (arch.intermediate_size, arch.hidden_size),
              "down_proj": (arch.hidden_size, arch.intermediate_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, block in MODULES.items():
            out_features, in_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, in_features, generator=g) / in_features ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(MODULES), "bias": "none"}))


def run_batch(engine: EngineCore, prompts: list[list[int]], names: list[str | None],
              max_tokens: int) -> float:
    """Output tokens/s of the batch, each prompt under its adapter (None: the base model)."""
    loras = engine.loras
    assert loras is not None
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                             lora=None if name is None else loras.get(name)) for name in names]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.new_token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    path = ensure_default_model()
    loaded = load_model(path, "bfloat16", "native")
    lora_dir = Path(tempfile.mkdtemp(prefix="llmq-bench-lora-"))
    names = [f"adapter-{i}" for i in range(max(args.adapters, 4))]
    for i, name in enumerate([*names, "cold"]):
        write_adapter(lora_dir / name, loaded.arch, args.rank, seed=i)
    engine = EngineCore(EngineConfig(model=str(path), dtype="bfloat16", weights="native",
                                     threads=args.threads, lora_dir=str(lora_dir),
                                     max_loras=len(names) + 1, max_lora_rank=args.rank,
                                     max_num_seqs=args.requests), loaded)
    loras = engine.loras
    assert loras is not None

    started = time.perf_counter()
    loras.get("cold")
    cold_load = time.perf_counter() - started
    for name in names:
        loras.get(name)

    tokenizer = loaded.tokenizer
    topics = ["the ocean", "a library", "mountain weather", "bread baking", "old maps",
              "city buses", "a chess opening", "garden soil"]
    prompts = [tokenizer.encode(f"Write a short note about {topics[i % len(topics)]}, "
                                f"number {i}, for a friend.") for i in range(args.requests)]
    configs: dict[str, list[str | None]] = {
        "base": [None] * args.requests,
        f"{args.adapters} adapters": [names[i % args.adapters] for i in range(args.requests)],
        "4 adapters + base": [([None] + names[:4])[i % 5] for i in range(args.requests)],
    }
    best = dict.fromkeys(configs, 0.0)
    run_batch(engine, prompts[:4], [None, *names[:3]], 4)  # warm-up
    for _ in range(args.repeats):
        for label, config in configs.items():
            best[label] = max(best[label], run_batch(engine, prompts, config, args.max_tokens))

    print(f"model {path.name}, native weights, {args.threads} thread(s); {args.requests} "
          f"requests x {args.max_tokens} tokens, greedy; rank-{args.rank} adapters on q/k/v/o/"
          f"gate/up/down; best of {args.repeats}")
    for label, rate in best.items():
        print(f"  {label:<20} {rate:8.1f} tokens/s   {rate / best['base']:.2f}x base")
    print(f"  cold load of one rank-{args.rank} adapter: {cold_load * 1000:.0f} ms")


if __name__ == "__main__":
    main()
