"""torch.compile against llmq's own path, on one decoder layer's MLP block of the default model.

    .venv/bin/python bench/torch_compile.py              # rows 1, 8 and 64, one thread

The block is what a step runs per layer after attention: h += o (residual), RMSNorm, gate/up
projection, SwiGLU, down projection. Three ways, same weights (the GGUF's, dequantized):

- eager: plain torch ops on dense float32 weights (what torch.compile starts from)
- compiled: `torch.compile(eager, dynamic=False)` (inductor; one graph per row count, warmed)
- llmq: the engine's own calls (kernels.add_rms_norm, Linear on its quantized or
  oneDNN-packed form, kernels.silu_mul), as llama.py `_run_fused` makes them

Prints the compile time and the microseconds a call at each row count (median of many, CPU
time). docs/performance.md reads it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmq.worker.engine.model.default_model import ensure_default_model  # noqa: E402
from llmq.worker.engine.model.loader import load_model  # noqa: E402


def per_call_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time_ns()
        fn()
        times.append(time.process_time_ns() - start)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64", type=lambda s: [int(r) for r in s.split(",")])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = load_model(str(ensure_default_model()), "bfloat16", "native").model
    kernels = model.kernels
    assert kernels is not None, "the comparison needs the compiled CPU kernels"
    layer = model._layers[0]
    mlp, norm_w, eps = layer.mlp, layer.post_attention_layernorm, model.arch.rms_norm_eps
    ffn, hidden = model.arch.intermediate_size, model.arch.hidden_size
    # dense float32 copies of the quantized weights: identity through the packed forms
    w_gate_up = mlp.gate_up_proj(torch.eye(hidden)).T.contiguous()  # [2 * ffn, hidden]
    w_down = mlp.down_proj(torch.eye(ffn)).T.contiguous()  # [hidden, ffn]

    def eager(h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = h + o
        x = F.rms_norm(h, (hidden,), norm_w, eps)
        gate, up = F.linear(x, w_gate_up).split(ffn, dim=-1)
        return h + F.linear(F.silu(gate) * up, w_down)

    def llmq(h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = kernels.add_rms_norm(h, o, norm_w, eps, mlp.gate_up_proj.input_dtype(h.shape[0]))
        act = kernels.silu_mul(mlp.gate_up_proj(x), mlp.down_proj.input_dtype(h.shape[0]))
        return h.add_(mlp.down_proj(act))

    compiled = torch.compile(eager, dynamic=False)
    print(f"torch {torch.__version__}, 1 thread, MLP block of layer 0 (hidden {hidden}, "
          f"ffn {ffn})")
    with torch.inference_mode():
        for rows in args.rows:
            h, o = torch.randn(rows, hidden), torch.randn(rows, hidden)
            start = time.perf_counter()
            compiled(h, o)
            compile_s = time.perf_counter() - start
            ref = eager(h, o)
            diff = (compiled(h, o) - ref).abs().max().item()
            ours = (llmq(h.clone(), o) - ref).abs().max().item()
            e = per_call_us(lambda h=h, o=o: eager(h, o), args.repeats)
            c = per_call_us(lambda h=h, o=o: compiled(h, o), args.repeats)
            m = per_call_us(lambda h=h, o=o: llmq(h.clone(), o), args.repeats)
            print(f"rows {rows:>3}: eager {e:8.1f} us  compiled {c:8.1f} us (first call "
                  f"{compile_s:.1f} s, max diff {diff:.1e})  llmq {m:8.1f} us (max diff "
                  f"{ours:.1e})  compiled / llmq {c / m:.2f}x")


if __name__ == "__main__":
    main()
