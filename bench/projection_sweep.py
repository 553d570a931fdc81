"""A decode step's projections, swept over every layer of a GGUF model as one step sweeps them
(the weights streamed from memory, not hot in cache as bench/kernels.py has them), in the qdot
layout, in one process, alternating what is compared, so a noisy neighbour skews them alike.

    .venv/bin/python bench/projection_sweep.py --model ~/.cache/llmq-peers/big/model.Q4_K_M.gguf
    .venv/bin/python bench/projection_sweep.py --model <gguf> --rows 32 --against /work/wt/base

Compared, each a full sweep per round, the median and best of the rounds printed:
  this build, as held      the kernels of this checkout on the tiles QuantMatrix lays out
  this build, 8-bit        ... with the 6-bit tiles (Q6_K, the Q5 types) held in 8 bits instead
  --against DIR, 8-bit     another checkout's kernels (DIR/worker/engine/model/kernels), built
                           once; it must take the 8-bit tiles (any checkout since `qdot`), and
                           a stacked matrix's blocks (`QMat.next`: since 16f0865)
  --against-held           ... DIR's kernels on the tiles as held too
  floor                    the same bytes read by torch (a sum: a plain streaming read)

With --against, each projection's output on the 8-bit tiles is compared between the two builds.

NOTE: the tiles here are NumPy's allocations, which NumPy advises for 2 MiB pages itself (arrays
of 4 MiB or more): the engine's maps of the repack cache are on 2 MiB pages only where the page
cache holds their files in 2 MiB folios (huge_pages.py `read_in`). On 4 KiB pages the sweep at
one row read 34.3-35.6 ms against 32.5-33.9
(bench/results/lone_huge_pages-zen4-2026-12-06-twentyfourth.txt).

Llama-family tensor names (blk.N.attn_q ... ffn_down, token_embd as the tied head); the fused
QKV and gate-up as the model fuses them (a Q4_K_M QKV with a Q6_K V: a stacked matrix, its
Q and K rows in 4 bits and V in 6).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from llmq.worker.engine.model.block_quant import BlockQuant, merge_rows
from llmq.worker.engine.model.cpu_kernels import CpuKernels, build_library
from llmq.worker.engine.model.quant_matrix import QuantMatrix, _dot_tiles


def projections(path: Path) -> list[BlockQuant]:
    """The model's projections in step order, the LM head last."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def blocks(name: str) -> BlockQuant:
        t = tensors[name]
        shape = (int(t.shape[1]), int(t.shape[0]))
        return BlockQuant.from_gguf(t.tensor_type, np.asarray(t.data).reshape(shape[0], -1),
                                    shape)

    layers = sum(1 for name in tensors if name.endswith(".attn_q.weight"))
    found: list[BlockQuant] = []
    for i in range(layers):
        p = f"blk.{i}."
        found += [merge_rows([blocks(p + f"attn_{x}.weight") for x in "qkv"]),
                  blocks(p + "attn_output.weight"),
                  merge_rows([blocks(p + "ffn_gate.weight"), blocks(p + "ffn_up.weight")]),
                  blocks(p + "ffn_down.weight")]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return [*found, blocks(head)]


def in_eight_bits(bq: BlockQuant, held: QuantMatrix) -> QuantMatrix:
    """`held`'s matrix in the 8-bit qdot tiles (itself unless held in 6 bits; a stacked
    matrix's blocks each)."""
    if held.row_blocks:
        assert bq.row_blocks is not None
        return QuantMatrix.stacked([in_eight_bits(part, block) for part, block
                                    in zip(bq.row_blocks, held.row_blocks, strict=True)])
    if held.bits != 6:
        return held
    q = np.pad(bq.q, ((0, -bq.q.shape[0] % 16), (0, 0)))
    return QuantMatrix.from_tiles(_dot_tiles(q, 8), held.scales, held.offsets,
                                  (held.out_features, held.in_features), held.group, 8,
                                  unit=held.unit, form=held.form)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--against", type=Path, help="another checkout, its kernels compared")
    parser.add_argument("--against-held", action="store_true",
                        help="the other checkout's kernels on the tiles as held too (it must "
                             "take the 6-bit tiles: any checkout since e8e2ab1)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    kernels = CpuKernels.load()
    assert kernels is not None, "no compiled kernels here"
    blocks = projections(args.model)
    # the LM head's form: within its tolerance (form_choice.py), the decoder's `qdot`
    forms = ["qdot"] * (len(blocks) - 1) + ["qdot_b16"]
    held = [QuantMatrix(bq, dot=True).against(form) for bq, form in zip(blocks, forms, strict=True)]
    eight = [in_eight_bits(bq, h) for bq, h in zip(blocks, held, strict=True)]
    del blocks
    runs = {"this build, as held": (kernels, held), "this build, 8-bit": (kernels, eight)}
    if args.against:
        library = build_library(Path.home() / ".cache" / "llmq" / "kernels",
                                args.against / "worker" / "engine" / "model" / "kernels")
        assert library is not None, f"could not build {args.against}'s kernels"
        theirs = CpuKernels(ctypes.CDLL(str(library)))
        runs[f"{args.against}, 8-bit"] = (theirs, eight)
        if args.against_held:
            runs[f"{args.against}, as held"] = (theirs, held)
    views = [t.view(-1).view(torch.float32) for m in held for block in m.row_blocks or [m]
             for t in (block.q, block.scales, block.offsets)
             if t is not None and t.nbytes % 4 == 0]
    x = {k: torch.randn(args.rows, k) for k in {m.in_features for m in held}}
    print(f"{args.model.name}: {len(held)} projections at {args.rows} rows; bytes as held "
          f"{sum(m.nbytes for m in held) / 1e6:.1f} MB, in 8 bits "
          f"{sum(m.nbytes for m in eight) / 1e6:.1f} MB", flush=True)

    seconds: dict[str, list[float]] = {name: [] for name in [*runs, "floor"]}
    for _ in range(args.rounds):
        for name, (k, matrices) in runs.items():
            start = time.perf_counter()
            for m in matrices:
                k.quant_matmul(x[m.in_features], m)
            seconds[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        for v in views:
            v.sum()
        seconds["floor"].append(time.perf_counter() - start)
    for name, times in seconds.items():
        print(f"  {name:40s} median {statistics.median(times) * 1e3:8.2f} ms   "
              f"best {min(times) * 1e3:8.2f} ms", flush=True)
    if args.against:
        # the same tiles through both builds: a kernel change that keeps the arithmetic keeps
        # every output bit
        (ours, _), (theirs, _) = runs["this build, 8-bit"], runs[f"{args.against}, 8-bit"]
        same = sum(torch.equal(ours.quant_matmul(x[m.in_features], m),
                               theirs.quant_matmul(x[m.in_features], m)) for m in eight)
        print(f"  outputs the same bits as {args.against}'s: {same} of {len(eight)} projections",
              flush=True)


if __name__ == "__main__":
    main()
