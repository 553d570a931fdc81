"""FormChoice: which form runs a projection, per row-count bucket, chosen by measuring this CPU.

References: ATLAS and FFTW (tune by timing candidates on the machine, once, and keep the
result), oneDNN's own primitive cache (decided per shape), llama.cpp's `ggml_backend` choice
of a repacked type per CPU feature (by assumption; here by measurement).

A `--weights native` projection can run as any of these forms (linear.py):

- `quant`: the GGUF's blocks on the compiled kernels (quant_matrix.py `QuantMatrix`), float32
  arithmetic on the file's own numbers; up to 8 rows a call (more rows: calls of 8).
- `qdot`: the same blocks (with float16 scales: fewer bytes) against the activations rounded
  to int8 per 32 columns, in integer dot products (kernels/qdot.h: AVX-512 VNNI, ~4x fewer
  instructions a weight than `quant`'s float32); any rows in one call, the weights read once.
- `qdot16`: the `qdot` tiles against the activations rounded to 15 bits (two int8 halves, two
  integer products a weight): ~0.02% error (the float16 scales'), within the LM head's
  tolerance where `qdot` is not, and still fewer instructions than `quant` at a few rows.
- `qdot_b16`: the `qdot` tiles against the activations rounded to int8 per 16 columns: ~0.47%
  error (a 16-column block's largest |x| is smaller), within the LM head's 0.5% where `qdot`'s
  ~0.53% is not, at `qdot`'s products (a float multiply-add more per 16 columns of a group of
  32; none more for Q6_K's groups of 16): the head's form at many rows, where `qdot16`'s two
  products a weight ran at ~0.65x `qdot`'s rate.
- `int8`: torch's int8 GEMM with two int8 terms per activation row (int8_matrix.py).
- `bf16`, `fp16`, `fp32`: the dequantized weight in that dtype, packed for oneDNN (on a CPU
  with AMX, oneDNN runs bfloat16 on it: several times float32 and int8 here).

Which is fastest depends on the CPU (AMX or not, VNNI, the memory bandwidth) and on the rows
a call has, so each distinct projection shape (out, in) is measured once per layout of its
blocks (a Q4_K_M model's Q6_K layers take twice its Q4_K layers' bytes; the dense forms'
figures are shared between layouts), for each bucket of rows in `BUCKETS`, on the first start
of a model on a CPU; the choice is kept in a small JSON
file (`<LLMQ_FORMS_DIR or ~/.cache/llmq/forms>/<key>.json`, next to the kernel cache) keyed
by the model's fingerprint, the CPU (model name and flags), torch's thread count, the kernels'
build and this module's code, so every later start reads it and measures nothing.

How a form is measured: its time on the first (at most) `SLICE_ROWS` output rows of the
projection, scaled to all of them, at least the time to stream the whole form's bytes once at
the measured memory bandwidth (a model's weights are read from memory every step, not from a
cache as a repeated measurement's are), the fastest of at least `REPEATS` calls after one
warm-up, more until each form has run `FORM_SECONDS` (the forms' calls interleaved, so a burst
of a neighbour's load slows one call of each), CPU time on one thread (wall time with more).
That is ~0.6 s of CPU for SmolLM2 (5 shapes) and ~2.4 s for the 1B-class model (7 shapes and
layouts) at a cold start; the log says how long.

Numerics: a form is a candidate only if its output for a random activation (standard normal,
`SAMPLE_ROWS` rows) is within `TOLERANCE` of the float32 form's, as ||y - y_fp32|| / ||y_fp32||;
the LM head within `HEAD_TOLERANCE` (its error reaches the logits unattenuated). The two-term
int8 form sets the bar: ~0.8% on SmolLM2's and the 1B model's shapes; bfloat16 ~0.3%,
float16 ~0.04%, `qdot` ~0.53%, `qdot_b16` ~0.47%, `qdot16` ~0.02%, `quant` ~1e-7 (the same
numbers as float32, summed in another order). docs/performance.md ("Kernel forms chosen by
measurement") has what each host chose.

`LLMQ_FORMS`: `measure` (default), `fixed` (the forms by assumption, as before this module:
quantized kernels up to 8 rows, int8 above; the LM head float32 above 8 rows), or one form's
name for every bucket of every projection (for comparison and tests).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from . import packed_weight
from .cpu_kernels import CpuKernels
from .int8_matrix import Int8Matrix
from .quant_matrix import DOT_FORMS, QuantMatrix

logger = logging.getLogger(__name__)

FORMS = ("quant", "qdot", "qdot16", "qdot_b16", "int8", "bf16", "fp16", "fp32")
# the GGUF's blocks on the compiled kernels (QuantMatrix): float32 tiles, then the qdot ones
QUANT_FORMS = ("quant", *DOT_FORMS)
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (the most rows a bucket holds, the rows it is measured at); the last holds every larger step
BUCKETS = ((1, 1), (4, 4), (8, 8), (32, 32), (128, 128), (1 << 62, 256))
TOLERANCE = 0.02  # relative error of a decoder projection's output (see the docstring)
HEAD_TOLERANCE = 0.005  # of the LM head's logits
SLICE_ROWS = 512  # output rows a form is timed on (a multiple of QuantMatrix's 16-row tiles)
SAMPLE_ROWS = 32  # activation rows the numerics are checked on
REPEATS = 5
# NOTE: calls of a few rows take microseconds: five of them all fell in one burst of a
# neighbour's load, and qdot16 (qdot's products twice) beat qdot at 1 and 4 rows of a
# 960x576 projection (Zen 3, 17.7 against 11.0 GFLOP/s). So each form is called until it has
# run FORM_SECONDS in all (at most MOST_REPEATS times), its fastest call kept.
FORM_SECONDS = 0.002
MOST_REPEATS = 200
# NOTE: a decode step of up to 8 rows whose every projection runs on the quantized kernels is
# one kernel call for all layers (llama.py); any other form there splits it into ~9 calls a
# layer, ~40 us of Python and ctypes per projection (bench/step_profile.py --op-by-op on
# SmolLM2: 18.6 against 13.9 ms a step). A decoder projection's other forms are charged that
# in the buckets of up to 8 rows.
ONE_CALL_CREDIT = 40e-6
# NOTE: each form held costs its bytes of RSS (a bfloat16 copy of a 1B model is 2.4 GB, and
# a worker is to stay within 1.5x of its model file plus KV budget: issue 21): a form that wins
# its buckets by less than this factor over another form chosen anyway gives them up to it,
# and is not built. A second copy of a weight is kept for a win like an AMX host's bfloat16
# (several times qdot's rate at many rows), not for the 1.2-1.6x of a 256-bit datapath's:
# at 1.15 the 1B model held bfloat16 copies of its Q6_K projections and of its head beside
# their qdot tiles (Zen 4: 544 MiB, a worker's peak 1.84x of file + KV, now 1.4x).
MEMORY_SLACK = 2.0
# NOTE: qdot16 runs qdot's products twice: beside qdot it must win by this factor. At a row or
# two both are bound by the call's own cost and tie, and a measurement's noise chose qdot16
# (Zen 3: SmolLM2's 576x1536 at 1 row, 18.2 against 18.0 GFLOP/s; its 960x576 at 1 and 4
# rows), and then every decode step paid the second products.
MORE_WORK_MARGIN = 1.15
# forms that hold another's bytes (qdot16 and qdot_b16 run qdot's tiles): no memory to save
# between them
HOLDS = {form: "qdot" for form in DOT_FORMS if form != "qdot"}
MODES = ("measure", "fixed", *FORMS)
ENV, DIR_ENV = "LLMQ_FORMS", "LLMQ_FORMS_DIR"

# a projection's first rows: float32 [rows, in], and their quantized form on the float32
# tiles and in the qdot layout (None: none)
Sample = tuple[torch.Tensor, QuantMatrix | None, QuantMatrix | None]


def forms_dir() -> Path:
    value = os.environ.get(DIR_ENV)
    return Path(value) if value else Path.home() / ".cache" / "llmq" / "forms"


def bucket_of(rows: int) -> int:
    """The index in BUCKETS of a call of `rows` rows."""
    return next(i for i, (most, _) in enumerate(BUCKETS) if rows <= most)


def fixed_forms(head: bool) -> tuple[str, ...]:
    """The forms by assumption (LLMQ_FORMS=fixed): quantized up to 8 rows, then int8 (the LM
    head float32)."""
    large = "fp32" if head or not Int8Matrix.available() else "int8"
    return tuple("quant" if most <= CpuKernels.MAX_QUANT_ROWS else large for most, _ in BUCKETS)


def _cpu() -> str:
    """The CPU as the choice depends on it: its model name and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line.strip() for line in f if line.startswith(("model name", "flags"))]
    except OSError:
        return ""
    return "\n".join(dict.fromkeys(lines))  # every core's lines are the same


class FormChoice:
    """The chosen form per bucket of every projection shape of one model on this CPU."""

    def __init__(self, mode: str, path: Path | None, key: dict[str, Any],
                 kernels: CpuKernels | None) -> None:
        if mode not in MODES:
            raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.path, self.key, self.kernels = mode, path, key, kernels
        # ("head:" or "") + "<out>x<in>/q<bits>g<group>" -> what `measure` found
        self.shapes: dict[str, dict[str, Any]] = {}
        self.bandwidth: float | None = None  # bytes/s one thread streams
        self.num_measured = 0  # shapes measured this start (0 on a warm start)
        self.seconds = 0.0  # spent measuring this start (wall time)
        self.cpu_seconds = 0.0  # the same in this process's CPU time (a busy machine's wall
        # time includes the neighbours' turns)
        if mode == "measure" and path is not None:
            self._read()

    @classmethod
    def for_model(cls, model_path: Path, fingerprint: str, kernels: CpuKernels | None,
                  mode: str | None = None) -> FormChoice:
        """The choice for this model file on this CPU, read from its file if there is one.
        `mode`: one of MODES in place of LLMQ_FORMS's."""
        mode = mode or os.environ.get(ENV, "measure").strip().lower() or "measure"
        key = {"model": str(model_path.resolve()), "fingerprint": fingerprint, "cpu": _cpu(),
               "threads": torch.get_num_threads(),
               "kernels": kernels.build_id if kernels is not None else "",
               "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
               "tolerance": [TOLERANCE, HEAD_TOLERANCE]}
        # NOTE: named by the whole key: workers of one model with another thread count, or
        # two installs of llmq (kernel builds) on one machine, each keep their own choice
        # instead of measuring again at every start, each over the other's file.
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
        return cls(mode, forms_dir() / f"{name.hexdigest()[:16]}.json", key, kernels)

    def choose(self, out_features: int, in_features: int, head: bool, quant: QuantMatrix,
               sample: Callable[[int], Sample], dot: bool = True) -> tuple[str, ...]:
        """The form of each bucket for a projection of this shape and quantization: from the
        file, else measured on `sample(rows)` (its first `rows` output rows, float32 and
        quantized). `dot`: whether the qdot kernel takes these blocks."""
        if self.mode == "fixed" or self.kernels is None:
            return fixed_forms(head)
        if self.mode != "measure":
            forced = self.mode
            if forced in DOT_FORMS and not dot:
                logger.info("kernel forms: %s=%s: not for %dx%d %s; quant instead", ENV,
                            forced, out_features, in_features, quant.kind)
                forced = "quant"
            if (forced == "int8" and not Int8Matrix.available()) or (
                    forced in DENSE_DTYPES and not dense_form_runs(forced)):
                logger.warning("kernel forms: %s=%s does not run on this CPU; float32 instead",
                               ENV, forced)
                forced = "fp32"
            return (forced,) * len(BUCKETS)
        # NOTE: the quantized form's bytes follow its blocks (a Q6_K layer's are twice a
        # Q4_K one's), so a shape is measured once per quantization (and per symmetric or not)
        shape = f"{'head:' if head else ''}{out_features}x{in_features}"
        name = f"{shape}/{quant.kind}"
        if name not in self.shapes:
            started, cpu_started = time.perf_counter(), time.process_time()
            if self.bandwidth is None:
                self.bandwidth = stream_bandwidth()
            tolerance = HEAD_TOLERANCE if head else TOLERANCE
            known = next((s for n, s in self.shapes.items() if n.split("/")[0] == shape), None)
            self.shapes[name] = measure(self.kernels, out_features, quant.nbytes,
                                        sample(min(out_features, SLICE_ROWS)), tolerance,
                                        self.bandwidth, one_call=not head, known=known)
            self.num_measured += 1
            self.seconds += time.perf_counter() - started
            self.cpu_seconds += time.process_time() - cpu_started
        return tuple(self.shapes[name]["chosen"])

    def save(self) -> None:
        """Write what this start measured (nothing to write on a warm start)."""
        if not self.num_measured or self.path is None:
            return
        logger.info("kernel forms measured for %d projection shapes in %.1f s (%.1f s of CPU; "
                    "first start of this model on this CPU; later starts read %s)",
                    self.num_measured, self.seconds, self.cpu_seconds, self.path)
        for name, result in self.shapes.items():
            logger.info("forms of %s by rows %s: %s", name,
                        [rows for _, rows in BUCKETS], " ".join(result["chosen"]))
        data = {"key": self.key, "bandwidth": self.bandwidth, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds,
                "buckets": [list(b) for b in BUCKETS], "shapes": self.shapes}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = self.path.with_suffix(f".tmp-{os.getpid()}")
            staging.write_text(json.dumps(data, indent=1))
            os.replace(staging, self.path)  # a worker starting beside us never reads half
        except OSError as exc:  # a read-only disk costs the next start a measurement
            logger.warning("kernel form choice not written to %s: %s", self.path, exc)

    def _read(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("kernel form choice %s is unreadable (%s): measuring again",
                           self.path, exc)
            return
        if not isinstance(data, dict) or data.get("key") != self.key:
            logger.warning("kernel form choice %s is for another model, CPU, thread count or "
                           "build: measuring again", self.path)
            return
        shapes = data.get("shapes")
        if not (isinstance(shapes, dict) and all(
                isinstance(s, dict) and isinstance(s.get("chosen"), list)
                and len(s["chosen"]) == len(BUCKETS) and set(s["chosen"]) <= set(FORMS)
                for s in shapes.values())):
            logger.warning("kernel form choice %s is damaged: measuring again", self.path)
            return
        self.shapes, self.bandwidth = shapes, data.get("bandwidth")


@functools.cache
def stream_bandwidth() -> float:
    """Bytes/s this thread streams from memory (a sum over 256 MiB, more than a core's caches),
    measured once a process."""
    x = torch.ones(64 << 20)
    x.sum()
    best = min(_seconds(lambda: x.sum()) for _ in range(REPEATS))
    return x.nbytes / best


def _seconds(fn: Callable[[], object]) -> float:
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn()
    return max(clock() - start, 1e-9)


def _candidates(kernels: CpuKernels, w: torch.Tensor,
                quant: tuple[QuantMatrix | None, ...], names: Collection[str]
                ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The named forms of w [rows, in] as functions of x [n, in] float32 (bfloat16 for `bf16`:
    the kernel before it writes bfloat16), as linear.py runs them; `quant`: its blocks on the
    float32 tiles, then the qdot tiles as each of DOT_FORMS (QUANT_FORMS' order)."""
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for form, matrix in zip(QUANT_FORMS, quant, strict=True):
        if matrix is not None and form in names:
            forms[form] = functools.partial(kernels.quant_matmul, w=matrix)
    if Int8Matrix.available() and "int8" in names:
        int8 = Int8Matrix(w)
        forms["int8"] = lambda x: kernels.int8_matmul(x, int8)
    for form, dtype in DENSE_DTYPES.items():
        if form in names and dense_form_runs(form):
            forms[form] = _dense(torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None),
                                 dtype)
    return forms


def dense_form_runs(form: str) -> bool:
    """Whether oneDNN runs this dense form on this CPU (`packed_weight.runs`)."""
    return packed_weight.runs(DENSE_DTYPES[form])


def _dense(packed: torch.Tensor, dtype: torch.dtype
           ) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.to(dtype), packed, None, "none", [None], "").float()
    return run


def measure(kernels: CpuKernels, out_features: int, quant_bytes: int, sample: Sample,
            tolerance: float, bandwidth: float, one_call: bool = True,
            known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time and check every form of one shape on its sample rows; choose per bucket the
    fastest within `tolerance`. Returns what the choice file keeps: each form's error and
    rate per bucket (GFLOP/s, None where not measured), bytes, and the chosen forms.
    `known`: what this returned for the same shape quantized another way (a Q4_K_M layer
    whose blocks are Q6_K): only the quantized form is measured, the others' figures reused."""
    w, quant_sample, dot_sample = sample
    rows, in_features = w.shape
    reused = {} if known is None else {
        form: (rates, known["errors"][form]) for form, rates in known["rates"].items()
        if form not in QUANT_FORMS}
    dots = [None if dot_sample is None else dot_sample.against(form) for form in DOT_FORMS]
    forms = _candidates(kernels, w, (quant_sample, *dots),
                        {*QUANT_FORMS, "fp32"} if reused else FORMS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLE_ROWS, in_features, generator=g)
    reference = forms["fp32"](x).double()
    errors = {form: float((fn(x).double() - reference).norm() / reference.norm())
              for form, fn in forms.items()}
    errors |= {form: error for form, (_, error) in reused.items()}
    if errors.get("qdot", float("inf")) <= tolerance:
        # NOTE: qdot_b16 is qdot's products with more float work: it is for where qdot's error
        # is out of tolerance (the LM head's); beside qdot it won buckets by a measurement's
        # noise (SmolLM2's decoder projections at 1-8 and 256 rows, Zen 4)
        del forms["qdot_b16"]
    # NOTE: the qdot layout holds the same integers with float16 scales and offsets
    dot_bytes = quant_bytes if quant_sample is None or dot_sample is None else round(
        quant_bytes * dot_sample.nbytes / quant_sample.nbytes)
    sizes = {"quant": quant_bytes, **dict.fromkeys(DOT_FORMS, dot_bytes),
             "int8": out_features * (in_features + 4),
             "bf16": 2 * out_features * in_features, "fp16": 2 * out_features * in_features,
             "fp32": 4 * out_features * in_features}
    rates: dict[str, list[float | None]] = {form: [] for form in FORMS
                                            if form in forms or form in reused}
    costs: list[dict[str, float]] = []  # per bucket: each eligible form's seconds a call
    for i, (_, num_rows) in enumerate(BUCKETS):
        xb = torch.randn(num_rows, in_features, generator=g)
        xb16 = xb.to(torch.bfloat16)
        flops = 2 * num_rows * out_features * in_features
        # NOTE: the quantized kernels beyond 8 rows are calls of 8: a candidate only while
        # they won the bucket below (they read fewer bytes, never compute faster)
        quant_out = num_rows > CpuKernels.MAX_QUANT_ROWS and (
            not costs or min(costs[-1], key=costs[-1].__getitem__) != "quant")
        calls = {form: functools.partial(forms[form], xb16 if form == "bf16" else xb)
                 for form in rates if form not in reused and not (form == "quant" and quant_out)}
        for call in calls.values():
            call()  # warm-up: oneDNN builds its primitive for the shape here
        # NOTE: the forms' calls interleaved, each form's fastest kept: a neighbour's burst of
        # load then slows one call of every form, not every call of one. Timed one form after
        # another, a busy VM's slow second made a form lose buckets it wins, and the choice
        # file keeps that for good (a 960x576 projection on bfloat16 from 33 rows, seen)
        spent = {form: float("inf") for form in calls}
        total = dict.fromkeys(calls, 0.0)
        for repeat in range(MOST_REPEATS):
            if repeat >= REPEATS and min(total.values(), default=1.0) >= FORM_SECONDS:
                break
            for form, call in calls.items():
                seconds = _seconds(call)
                spent[form], total[form] = min(spent[form], seconds), total[form] + seconds
        cost: dict[str, float] = {}
        for form in rates:
            rate: float | None = (
                reused[form][0][i] if form in reused else
                flops / max(spent[form] * out_features / rows, sizes[form] / bandwidth) / 1e9
                if form in spent else None)
            rates[form].append(rate)
            if rate is not None and errors[form] <= tolerance:
                fused = (one_call and form not in QUANT_FORMS
                         and num_rows <= CpuKernels.MAX_QUANT_ROWS)
                cost[form] = flops / (rate * 1e9) + (ONE_CALL_CREDIT if fused else 0.0)
        costs.append(_charge_more_work(cost))
    return {"errors": errors, "rates": rates, "bytes": sizes, "chosen": _fewest_forms(costs),
            "tolerance": tolerance}


def _charge_more_work(cost: dict[str, float]) -> dict[str, float]:
    """A bucket's costs with qdot16 charged MORE_WORK_MARGIN where qdot is a candidate too."""
    if "qdot" in cost and "qdot16" in cost:
        return {**cost, "qdot16": cost["qdot16"] * MORE_WORK_MARGIN}
    return cost


def _fewest_forms(costs: list[dict[str, float]]) -> list[str]:
    """Per bucket the cheapest form; then, largest first, each chosen form whose buckets
    another chosen form serves within MEMORY_SLACK of each bucket's best gives them up to it
    (unless another chosen form holds its bytes: dropping it would save none)."""
    chosen = [min(cost, key=cost.__getitem__) for cost in costs]
    order = (*QUANT_FORMS, "int8", "fp16", "bf16", "fp32")
    for form in sorted(set(chosen), key=order.index, reverse=True):
        others = set(chosen) - {form}
        if HOLDS.get(form, form) in {HOLDS.get(o, o) for o in others}:
            continue
        instead: dict[int, str] = {}
        for i, cost in enumerate(costs):
            if chosen[i] == form:
                near = [o for o in others
                        if cost.get(o, float("inf")) <= MEMORY_SLACK * min(cost.values())]
                if not near:
                    break
                instead[i] = min(near, key=cost.__getitem__)
        else:
            for i, other in instead.items():
                chosen[i] = other
    return chosen
