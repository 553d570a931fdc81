"""Decode attention over a KV cache on 4 KiB pages against one on 2 MiB pages (huge_pages.py),
with each sequence's blocks scattered over the cache as a long-running worker's are (a fresh
cache hands blocks out in order, and a benchmark's batch then reads them nearly in order).

    .venv/bin/python bench/attention_pages.py                 # SmolLM2's shape, 64 sequences
    .venv/bin/python bench/attention_pages.py --seqs 32 --kv-heads 8 --group 4 --layers 16

Both caches hold the same values and the same block tables; the two are timed alternately (wall
time of all layers' decode attention, one thread), and the output must be the same floats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from llmq.worker.engine.model import huge_pages
from llmq.worker.engine.model.cpu_kernels import CpuKernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=147, help="mean keys a sequence")
    parser.add_argument("--blocks", type=int, default=4096, help="the cache's blocks a layer")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = CpuKernels.load()
    assert kernels is not None, "no compiled kernels here"
    block_size, rng = 16, random.Random(0)
    lens = [rng.randint(args.context * 9 // 10, args.context * 11 // 10) for _ in range(args.seqs)]
    needed = [-(-n // block_size) for n in lens]
    free = list(range(1, args.blocks))
    rng.shuffle(free)
    tables, taken = [], 0
    for n in needed:
        tables.append(free[taken:taken + n])
        taken += n
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    q = torch.randn(args.seqs, args.kv_heads * args.group, args.head_dim)
    shape = (2, args.kv_heads, args.blocks, block_size, args.head_dim)
    caches = {"4 KiB pages": [torch.zeros(shape, dtype=torch.bfloat16)
                              for _ in range(args.layers)],
              "2 MiB pages": [huge_pages.zeros(shape, torch.bfloat16)
                              for _ in range(args.layers)]}
    # moved now, not when khugepaged gets to them
    if not all(huge_pages.collapse(layer) for layer in caches["2 MiB pages"]):
        raise SystemExit("this kernel moves no memory onto 2 MiB pages (MADV_COLLAPSE)")
    g = torch.Generator().manual_seed(0)
    for layer in range(args.layers):
        values = torch.randn(shape, generator=g).to(torch.bfloat16)
        for layers in caches.values():
            layers[layer].copy_(values)
    outs = {name: torch.empty_like(q) for name in caches}
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.rounds):
        for name, layers in caches.items():
            start = time.perf_counter()
            for cache in layers:
                kernels.decode_attention(q, cache, block_tables, seq_lens,
                                         args.head_dim ** -0.5, outs[name])
            seconds[name].append(time.perf_counter() - start)
    a, b = outs.values()
    mib = caches["4 KiB pages"][0].numel() * 2 / 2**20  # bfloat16
    print(f"{args.layers} layers x {args.seqs} sequences x ~{args.context} keys, blocks "
          f"scattered over {args.blocks} a layer ({mib:.0f} MiB); outputs equal: "
          f"{torch.equal(a, b)}")
    for name, times in seconds.items():
        print(f"  {name}: median {statistics.median(times) * 1e3:7.2f} ms   "
              f"best {min(times) * 1e3:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
