"""Where a decode step's time goes, at batch 1 and batch 64, beside the floor of each part.

    .venv/bin/python bench/step_profile.py                     # batches 1 and 64, default engine
    .venv/bin/python bench/step_profile.py --batch-sizes 1 --weights bf16 --steps 50
    .venv/bin/python bench/step_profile.py --batch-sizes 1 --op-by-op   # batch 1's parts apart

A native decode step runs its layers in the one-call kernel ("layers in one-call kernels"):
every layer in one call up to 8 sequences, a call a layer above where every projection runs
qdot's tiles at every batch size; --op-by-op runs it part by part instead, to see where that
call's time goes.

Each batch runs B requests of 128-token prompts until all are decoding, then times decode
steps. Parts are timed by wrapping the engine's pieces (each wrapper costs ~0.3 us a call):
the projections (quantized kernels or dense GEMMs, the LM head apart), attention, the fused
norm / RoPE / SwiGLU kernels, sampling, the scheduler; "Python and glue" is the rest of the
step. Times are CPU time of this process (robust to a busy neighbour, unlike wall time).

Floors, measured here: weight bytes read once at the streaming bandwidth of one core (batch
1), the step's GEMM FLOPs at the peak of the form each projection runs (batch 64), K/V bytes at
the streaming bandwidth (attention). docs/performance.md reads these tables.

First, the kernel forms (form_choice.py): for each projection shape, each candidate form's time
and rate per bucket of rows as measured at the model's first start on this CPU (read from the
choice file on later starts), beside the floor of reading the quantized weights once, and which
form was chosen.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model import cpu_kernels, form_choice, huge_pages, linear  # noqa: E402
from llmq.worker.engine.model.attention import PagedAttention  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(part: str, fn):
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[part] += time.process_time() - start
            CALLS[part] += 1
    return wrapper


def instrument(engine: EngineCore) -> None:
    """Wrap the parts of a step, once; nested parts are subtracted from their parent."""
    model = engine.runner.model
    head = model.lm_head

    def linear_forward(self, x, _orig=linear.Linear.forward):
        form = self.form_of(x.shape[0])
        part = f"lm head ({form})" if self is head else f"projections ({form})"
        return timed(part, _orig)(self, x)

    linear.Linear.forward = linear_forward  # type: ignore[method-assign]
    PagedAttention.attend = timed("attention", PagedAttention.attend)  # type: ignore
    PagedAttention.__call__ = timed("attention", PagedAttention.__call__)  # type: ignore
    for name, part in (("add_rms_norm", "residual add + RMSNorm"),
                       ("rope_store", "RoPE + K/V store"), ("silu_mul", "SwiGLU"),
                       ("decode_layers", "layers in one-call kernels")):
        method = getattr(cpu_kernels.CpuKernels, name)
        setattr(cpu_kernels.CpuKernels, name, timed(part, method))
    engine.runner.sampler.__call__ = None  # instance attribute is not used for calls
    sampler_cls = type(engine.runner.sampler)
    sampler_cls.__call__ = timed("sampling", sampler_cls.__call__)  # type: ignore
    engine.scheduler.schedule = timed("scheduler", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timed("scheduler", engine.scheduler.update_from_output)


def best_rate(work: float, fn, repeats: int = 7) -> float:
    """work / the shortest CPU time of `repeats` runs of fn (CPU time: a busy neighbour that
    takes the core away does not count)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return work / best


def stream_bandwidth() -> float:
    """Bytes/s one core reads a 512 MiB tensor at (a sum: read-only streaming)."""
    x = torch.ones(128 << 20)
    return best_rate(x.nbytes, x.sum)


def gemm_peak() -> float:
    """FLOP/s of a float32 oneDNN GEMM of the batch-64 MLP's shape class (1024 rows)."""
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(3072, 576), None)
    x = torch.randn(1024, 576)
    return best_rate(2 * 1024 * 3072 * 576, lambda: torch.ops.mkldnn._linear_pointwise(
        x, w, None, "none", [None], ""))


def dense_peak(dtype: torch.dtype) -> float:
    """FLOP/s of a oneDNN GEMM in `dtype` at the same shape (bfloat16 runs on AMX where the
    CPU has it)."""
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(3072, 576).to(dtype), None)
    x = torch.randn(1024, 576).to(dtype)
    return best_rate(2 * 1024 * 3072 * 576, lambda: torch.ops.mkldnn._linear_pointwise(
        x, w, None, "none", [None], ""))


def print_forms(model) -> None:
    """Each shape's forms as measured (or read from the choice file), beside the floor."""
    forms = model.forms
    if forms is None or not forms.shapes:
        print("kernel forms: none measured (not native, no kernels, or LLMQ_FORMS="
              f"{forms.mode if forms else '-'})")
        return
    source = (f"measured this start in {forms.seconds:.1f} s, {forms.cpu_seconds:.1f} s of CPU"
              if forms.num_measured
              else f"read from {forms.path}")
    print(f"\nkernel forms ({source}); streaming {forms.bandwidth / 1e9:.1f} GB/s. Per bucket: "
          "ms a call (GFLOP/s); * chosen, x outside the tolerance; floor: the quantized "
          "weights read once")
    for name, shape in forms.shapes.items():
        shape_name = name.split("/")[0].split(":")[-1]
        out_features, in_features = (int(d) for d in shape_name.split("x"))
        errors = " ".join(f"{f} {e:.1e}" for f, e in shape["errors"].items())
        print(f"  {name}: error against fp32 {errors} (tolerance {shape['tolerance']:.1e})")
        print(f"    {'rows':>5} {'floor':>8} " + "".join(f"{f:>18}" for f in shape["rates"]))
        for i, (_, rows) in enumerate(form_choice.BUCKETS):
            flops = 2 * rows * out_features * in_features
            floor = shape["bytes"]["quant"] / forms.bandwidth
            cells = []
            for form, rates in shape["rates"].items():
                rate = rates[i]
                mark = ("*" if shape["chosen"][i] == form else
                        "x" if shape["errors"][form] > shape["tolerance"] else " ")
                cells.append(f"{'-':>17} " if rate is None else
                             f"{1e3 * flops / rate / 1e9:>9.3f} ({rate:>5.0f}){mark}")
            print(f"    {rows:>5} {1e3 * floor:>8.3f} " + "".join(cells))


def best_rates(forms) -> dict[str, float]:
    """Each form's best rate in FLOP/s over every shape and bucket the choice measured."""
    best: dict[str, float] = {}
    for shape in (forms.shapes.values() if forms is not None else ()):
        for form, rates in shape["rates"].items():
            measured = [r for r in rates if r is not None]
            if measured:
                best[form] = max(best.get(form, 0.0), 1e9 * max(measured))
    return best


def int8_peak() -> float:
    """int8 multiply-adds x 2 per second of torch._int_mm at the same shape."""
    w = torch.randint(-127, 128, (3072, 576), dtype=torch.int8)
    x = torch.randint(-127, 128, (1024, 576), dtype=torch.int8)
    return best_rate(2 * 1024 * 3072 * 576, lambda: torch._int_mm(x, w.t()))


def profile_batch(engine: EngineCore, batch: int, steps: int, prompt_len: int) -> None:
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(100, engine.arch.vocab_size, (prompt_len,), generator=g)
        engine.add_request(f"p{batch}-{i}", prompt.tolist(), params)
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    SPENT.clear()
    CALLS.clear()
    step_times = []
    for _ in range(steps):
        start = time.process_time()
        engine.step()
        step_times.append(time.process_time() - start)
    total = sum(step_times)
    context = prompt_len + 3 + steps // 2
    print(f"\nbatch {batch}: {1e3 * statistics.median(step_times):.2f} ms a step "
          f"(median CPU time of {steps}), {batch / statistics.median(step_times):.1f} tok/s, "
          f"context ~{context} tokens")
    print(f"  {'part':<36} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    accounted = 0.0
    for part, spent in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        # NOTE: the fused kernels run inside no other timed part; attention's own time
        # includes nothing else timed either, so the parts add up.
        accounted += spent
        print(f"  {part:<36} {1e3 * spent / steps:>8.2f} {spent / total:>6.1%} "
              f"{CALLS[part] / steps:>10.0f}")
    rest = total - accounted
    print(f"  {'Python and glue (the rest)':<36} {1e3 * rest / steps:>8.2f} {rest / total:>6.1%}")
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,64", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default=None, choices=["native", "bf16", "fp32"])
    ap.add_argument("--model", default="")
    ap.add_argument("--op-by-op", action="store_true",
                    help="no one-call decode step: time each part of a step apart")
    args = ap.parse_args()

    torch.set_num_threads(1)
    engine = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                                     threads=1, max_num_seqs=max(args.batch_sizes)))
    model = engine.runner.model
    if args.op_by_op:
        model._one_call = False
    projections = [m for m in model.modules() if isinstance(m, linear.Linear)]
    quant_bytes = sum(q.nbytes for m in projections for q in (m.quant, m.dot_tiles)
                      if q is not None)
    other_bytes = sum(m.nbytes for m in projections) - quant_bytes
    flops_per_token = 2 * sum(m.out_features * m.in_features for m in projections)
    bandwidth, peak8 = stream_bandwidth(), int8_peak()
    # NOTE: a dense dtype only where oneDNN runs it: no float16 on an AMD Zen 5 (no
    # avx512_fp16), no bfloat16 on a Zen 3 (AVX2 only)
    peaks = {"fp32": gemm_peak(),
             **{form: (dense_peak(dtype) if form_choice.dense_form_runs(form) else float("nan"))
                for form, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))},
             "int8": peak8 / 2,  # int8: two terms a row
             "qdot": peak8,  # qdot: one int8 term a row (its VNNI products, not torch's GEMM)
             "qdot_b16": peak8,  # qdot_b16: one (more float work, not more products)
             "qdot16": peak8 / 2}  # qdot16: two
    # NOTE: where oneDNN has no fast int8 GEMM (AVX2: ~3 GOP/s), torch's rate is no roof for
    # the qdot kernels: their own best rate over every shape and bucket is
    for form, rate in best_rates(model.forms).items():
        if form.startswith("qdot"):
            peaks[form] = max(peaks[form], rate)
    print(f"weights {model.weights}, KV cache {args.dtype}, 1 thread. Measured here: streaming "
          f"read {bandwidth / 1e9:.1f} GB/s, GEMM peaks float32 {peaks['fp32'] / 1e9:.0f}, "
          f"bfloat16 {peaks['bf16'] / 1e9:.0f}, float16 {peaks['fp16'] / 1e9:.0f} GFLOP/s "
          f"(nan: this CPU's oneDNN has none), int8 {peak8 / 1e9:.0f} GOP/s; qdot's roof "
          f"{peaks['qdot'] / 1e9:.0f} GOP/s")
    print(f"projections: quantized forms {quant_bytes / 2**20:.0f} MiB, other forms "
          f"{other_bytes / 2**20:.0f} MiB, {flops_per_token / 1e6:.0f} MFLOP per token "
          "(LM head included)")
    print_forms(model)
    for batch in args.batch_sizes:
        weight_floor = compute_floor = 0.0
        for m in projections:
            form = m.form_of(batch)
            size = m.quant.nbytes if form == "quant" and m.quant is not None else (
                m.dot_forms[form].nbytes if form in m.dot_forms else
                m.int8.nbytes if form == "int8" and m.int8 is not None else
                m.out_features * m.in_features * {"bf16": 2, "fp16": 2}.get(form, 4))
            weight_floor += size / bandwidth
            flops = 2 * batch * m.out_features * m.in_features
            compute_floor += flops / peaks[form] if form in peaks else 0.0
        print(f"floor batch {batch}: the chosen forms' weights read once "
              f"{1e3 * weight_floor:.2f} ms, GEMM work at their peaks {1e3 * compute_floor:.2f} ms")
    instrument(engine)
    for batch in args.batch_sizes:
        profile_batch(engine, batch, args.steps, args.prompt_len)
        arch = model.arch
        kv_bytes = (batch * (args.prompt_len + 3 + args.steps // 2) * 2 * arch.num_kv_heads
                    * arch.head_dim * model.dtype.itemsize * arch.num_layers)
        print(f"  floor of attention: K/V read once {1e3 * kv_bytes / bandwidth:.2f} ms")
    resident, huge = huge_pages.file_maps()
    print(f"weights mapped from the repack cache: {huge / 2**20:.0f} of {resident / 2**20:.0f} MiB "
          "on 2 MiB pages (huge_pages.py: a lone decode's rate follows it)")


if __name__ == "__main__":
    main()
