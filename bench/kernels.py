"""Every CPU matmul kernel llmq could run a projection on, per shape and number of rows.

    .venv/bin/python bench/kernels.py                       # SmolLM2's shapes, rows 1..1024
    .venv/bin/python bench/kernels.py --rows 1,8,64 --shapes gate_up,lm_head

Kernels (one thread; microseconds per call, the best CPU time of interleaved repeats, so a busy
neighbour skews them little; weights are hot in cache: a model streams them from memory,
which bench/step_profile.py measures):

  fp32     oneDNN, prepacked float32 weight, float32 activations (`--weights fp32`, and native
           above QUANT_MAX_ROWS rows where the int8 form is not built)
  bf16     oneDNN, prepacked bfloat16 weight and activations (`--weights bf16`)
  quant    llmq's compiled kernel on the GGUF's Q4_1 blocks, float32 arithmetic (native)
  i8x2     llmq's int8 form (int8_matrix.py): torch._int_mm on int8-per-channel weights and
           each activation row as two int8 terms (native above QUANT_MAX_ROWS rows)
  int4     aten._weight_int4pack_mm_for_cpu, Q4_1 as int4 with bfloat16 scales; bfloat16 in/out
  int8     aten._weight_int8pack_mm, per-channel int8 (Q4_1 re-quantized: lossy), bfloat16
  w8a8     oneDNN qlinear_pointwise (VNNI), int8 weights and per-tensor dynamic int8
           activations (lossy: SmolLM2's logits move by up to ~5, see docs/performance.md)
  dyn4     aten._dyn_quant_matmul_4bit (KleidiAI on Arm; a reference loop on x86)

The table picks QUANT_MAX_ROWS (linear.py): below it the quantized kernels read far fewer
bytes; above it int8 compute (i8x2) wins, float32 where there is no int8 form.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from llmq.worker.engine.model.block_quant import BlockQuant
from llmq.worker.engine.model.cpu_kernels import CpuKernels
from llmq.worker.engine.model.int4_weight import Int4Weight
from llmq.worker.engine.model.int8_matrix import Int8Matrix
from llmq.worker.engine.model.quant_matrix import QuantMatrix

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def kernels_for(out_features: int, in_features: int, kernels: CpuKernels | None) -> dict:
    """name -> (activation dtype, callable) for one weight of the given shape."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    bq = BlockQuant.from_gguf(gguf.GGMLQuantizationType.Q4_1,
                              gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                              (out_features, in_features))
    dense = torch.from_numpy(bq.dequantize())
    fp32 = torch.ops.mkldnn._reorder_linear_weight(dense, None)
    bf16 = torch.ops.mkldnn._reorder_linear_weight(dense.bfloat16(), None)
    int4 = Int4Weight.from_block_quant(bq)
    scale8 = dense.abs().amax(1) / 127
    q8 = torch.round(dense / scale8[:, None]).to(torch.int8)
    packed8 = torch.ops.onednn.qlinear_prepack(q8, None)
    zeros8 = torch.zeros(out_features, dtype=torch.long)
    nibbles = torch.from_numpy(bq.q.astype(np.uint8))
    dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(
        nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), torch.from_numpy(bq.scales), None, 32,
        in_features, out_features)

    def onednn(weight):
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")

    def w8a8(x):
        lo, hi = torch.aminmax(x)
        scale = (hi - lo).clamp_min(1e-8) / 255
        zero = (-lo / scale).round()
        qx = torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise.tensor(
            qx, scale, zero.long(), packed8, scale8, zeros8, None, 1.0, 0, torch.float32,
            "none", [], "")

    table = {
        "fp32": (torch.float32, onednn(fp32)),
        "bf16": (torch.bfloat16, onednn(bf16)),
        "int4": (torch.bfloat16, int4),
        "int8": (torch.bfloat16,
                 lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, scale8.bfloat16())),
        "w8a8": (torch.float32, w8a8),
        "dyn4": (torch.float32,
                 lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, dyn, 32, in_features,
                                                                 out_features)),
    }
    if kernels is not None:
        matrix = QuantMatrix(bq)
        table["quant"] = (torch.float32, lambda x: kernels.quant_matmul(x, matrix))
        int8x2 = Int8Matrix(dense)
        table["i8x2"] = (torch.float32, lambda x: kernels.int8_matmul(x, int8x2))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,1024",
                    type=lambda s: [int(r) for r in s.split(",")])
    ap.add_argument("--shapes", default=",".join(SHAPES), type=lambda s: s.split(","))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip", default="dyn4", type=lambda s: set(s.split(",")) - {""},
                    help="kernels left out (dyn4 is a scalar reference loop on x86: slow)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = CpuKernels.load()
    names = ["fp32", "bf16", "quant", "i8x2", "int4", "int8", "w8a8", "dyn4"]
    names = [n for n in names if n not in args.skip and (n not in ("quant", "i8x2") or kernels)]
    print("us per call (best CPU time); '-' where the kernel does not take that many rows")
    print(f"{'shape':<8} {'rows':>5} " + " ".join(f"{n:>8}" for n in names) + "  fastest")
    for shape in args.shapes:
        out_features, in_features = SHAPES[shape]
        table = kernels_for(out_features, in_features, kernels)
        for rows in args.rows:
            x32 = torch.randn(rows, in_features)
            inputs = {torch.float32: x32, torch.bfloat16: x32.bfloat16()}
            usable = {n: table[n] for n in names
                      if n != "quant" or rows <= CpuKernels.MAX_QUANT_ROWS}
            reps = max(1, min(50, int(2e8 / (2 * rows * out_features * in_features))))
            best = {n: float("inf") for n in usable}
            for _ in range(args.repeats):
                for name, (dtype, fn) in usable.items():
                    x = inputs[dtype]
                    fn(x)
                    start = time.process_time()
                    for _ in range(reps):
                        fn(x)
                    best[name] = min(best[name], (time.process_time() - start) / reps)
            fastest = min(best, key=best.__getitem__)
            cells = [f"{best[n] * 1e6:>8.0f}" if n in best else f"{'-':>8}" for n in names]
            print(f"{shape:<8} {rows:>5} " + " ".join(cells) + f"  {fastest}", flush=True)


if __name__ == "__main__":
    main()
