"""Linear: y = x W^T (+ b), with W held in the forms that are fastest for the step's batch.

References: vLLM `layers/linear.py` (one module per projection, weights loaded in slices into a
fused matrix), gpt-fast `quantize.py` (`WeightOnlyInt4Linear` over `_weight_int4pack_mm`),
torch.compile's CPU freezing pass (the oneDNN ops used for the dense form).

Forms, chosen per call by the number of rows (tokens) in x:

- `--weights native` with the compiled kernels (cpu_kernels.py): the form form_choice.py chose
  for the call's bucket of rows, by measuring this CPU at the model's first start (or by
  assumption with LLMQ_FORMS=fixed): the GGUF's blocks on the quantized kernels
  (`QuantMatrix`, float32 arithmetic on the file's own numbers: the file's bytes, the fewest a
  step can read), the same blocks against int8 activations (`qdot`, kernels/qdot.h; the LM
  head's `qdot16` and `qdot_b16` on the same tiles: DOT_FORMS), the
  two-term int8 GEMM (`Int8Matrix`, int8_matrix.py), or the dequantized
  weight in bfloat16, float16 or float32 packed for oneDNN. Only the forms some bucket chose
  are built (each from the blocks, or mapped from the repack cache); the others, and the
  dense copy they come from, are not kept.
- `--weights native` without the kernels (no compiler): torch's int4 kernel (`Int4Weight`,
  bfloat16 in and out) up to `QUANT_MAX_ROWS` rows where the type maps onto it, float32
  oneDNN above.
- dense (`fp32`, `bf16`, a Hugging Face folder): the weight prepacked for oneDNN in its dtype.

Parts (`split`, the LM head's): the dense forms are held as slices of the output rows, one call
each, so `forward_parts` can hand each slice's output back before computing the next: the busy
loop pauses a batch step between them for an interactive arrival (worker/engine/step_interrupt.py),
as it does between decoder layers. The quantized and int8 forms run whole: they serve calls of
few rows, where 8 calls instead of one cost a lone decode ~10% of its speed. Each output element
is the same dot product over the same input either way; tests/model/test_linear_parts.py checks
the parts against one call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import cached_forms, packed_weight
from .block_quant import BLOCK_QUANT_TYPES, BlockQuant, QuantizedEmbedding, merge_rows
from .cpu_kernels import CpuKernels
from .form_choice import BUCKETS, DENSE_DTYPES, QUANT_FORMS, FormChoice, Sample, bucket_of
from .gguf_loader import QuantizedTensor
from .int4_weight import Int4Weight
from .int8_matrix import Int8Matrix
from .quant_matrix import DOT_FORMS, QuantMatrix
from .repack_cache import RepackCache

if TYPE_CHECKING:
    from llmq.worker.engine.lora.lora_batch import LoraSlot

logger = logging.getLogger(__name__)

# NOTE: the quantized kernels take up to 8 rows a call; without the compiled kernels, torch's
# int4 kernel serves steps of up to this many rows (it loses to float32 oneDNN above).
QUANT_MAX_ROWS = 8
# rows past the last finite bucket's bound share its form (Linear._form_by_rows)
ROUTED_ROWS = BUCKETS[-2][0] + 1
# quant_rows where every bucket of rows runs one of qdot's forms
ONE_CALL_ANY_ROWS = 1 << 62
# Batch-invariant dense projections run in calls of exactly this many rows (the last padded):
# oneDNN's and MKL's float32 and bfloat16 GEMMs sum a row in an order that follows the call's
# rows (one row: a GEMV), never the row's place in the call (bench/batch_invariance.py)
INVARIANT_TILE_ROWS = 16
PART_ROWS = 16  # a part's rows start at a multiple of this (QuantMatrix's tiles)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # NOTE: torch.empty, not zeros: load_weights overwrites every element, and untouched
    # pages cost no memory until then.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """One projection (or several fused by rows: QKV, gate/up).

    NOTE: oneDNN on a prepacked weight, not F.linear: torch's default float32 GEMM (MKL) runs
    2-2.5x slower than oneDNN on a prepacked weight, and bfloat16 F.linear re-packs the weight
    into oneDNN's blocked layout on every call (up to 4x slower for a one-token GEMM).
    """

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        # output rows run as one call each: [(start, stop)], one part unless `split`
        self.parts: list[tuple[int, int]] = [(0, out_features)]
        self._packed: list[torch.Tensor] | None = None  # the dense weight, a tensor a part
        self.quant: QuantMatrix | Int4Weight | None = None  # the small-batch form, if any
        self.int8: Int8Matrix | None = None  # the int8 form, where a bucket chose it
        # the blocks in the qdot layout as each chosen form of DOT_FORMS (one set of tiles)
        self.dot_forms: dict[str, QuantMatrix] = {}
        # chosen dense forms, a tensor a part: "bf16" -> [packed weight rows of the part]
        self._dense: dict[str, list[torch.Tensor]] = {}
        self._dense_bias: dict[str, list[torch.Tensor | None]] = {}
        # the repack cache's maps that dense forms' packed tensors wrap (not owned by them)
        self._backing: list[np.ndarray] = []
        self.forms: tuple[str, ...] | None = None  # the form of each BUCKETS bucket, if chosen
        self._form_by_rows: list[str] = []  # forms[bucket of rows], rows 0..ROUTED_ROWS
        self._kernels: CpuKernels | None = None
        self._quantized_rows: list[tuple[slice, QuantizedTensor]] = []
        self._decoded: BlockQuant | None = None  # the blocks, decoded once while finalizing
        self.quant_only = False  # set by finalize: the quantized form serves every batch size
        self.dense_from: QuantizedEmbedding | None = None  # a tied head's faster dense source
        # LoRA (worker/engine/lora/): where the step's adapters are, and this projection's
        # name among their weights (`3.qkv`); None for projections no adapter targets.
        self.lora_slot: LoraSlot | None = None
        self.lora_key = ""
        # Batch-invariant decoding (`make_batch_invariant`): one row-invariant form for calls
        # of every size
        self.batch_invariant = False

    def split(self, num_parts: int) -> None:
        """Hold every form as `num_parts` slices of the output rows (before `finalize`)."""
        tiles = -(-self.out_features // PART_ROWS)
        bounds = [min(self.out_features, tiles * k // num_parts * PART_ROWS)
                  for k in range(num_parts + 1)]
        self.parts = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def _slices(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t's rows (views) of each part."""
        return [t[a:b] for a, b in self.parts]

    def add_quantized(self, rows: slice | None, tensor: QuantizedTensor) -> None:
        """Remember the GGUF blocks of some rows: `finalize` builds the forms from them and
        dequantizes them into the dense weight only where a dense form is still needed."""
        self._quantized_rows.append((rows or slice(0, self.out_features), tensor))

    def finalize(self, native: bool, kernels: CpuKernels | None, keep_dense: bool = False,
                 quant_only: bool = False, cache: RepackCache | None = None, name: str = "",
                 forms: FormChoice | None = None, head: bool = False) -> None:
        """Build the forms once the weights are loaded: with `native`, the quantized form from
        the GGUF blocks, then (given `forms`, the kernels' form choice) the form of every
        bucket of rows; otherwise the oneDNN-packed dense weight. Unless it is shared (a tied
        head that also serves lookups), the dense copy is freed: the forms built replace it,
        and keeping both doubles the RSS. With `cache`, the forms built from blocks are taken
        from (or stored in) the repack cache under `name`. `head`: the LM head (its own
        tolerance in the choice).

        `quant_only` (mixture-of-experts experts): where a quantized form is built, it is the
        only one, for every batch size: an expert sees a few tokens a step, and an int8 or
        dense copy of every expert would multiply the weights' memory for nothing."""
        self._kernels = kernels
        if native and self._quantized_rows:
            if not (kernels is not None and cache is not None
                    and self._quant_from_cache(cache, name)):
                self._build_quant(kernels, cache, name)
        self.quant_only = quant_only and self.quant is not None
        if self.quant_only:
            self._quantized_rows, self._decoded = [], None
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        if (forms is not None and isinstance(self.quant, QuantMatrix) and not keep_dense
                and self.weight.dtype == torch.float32):
            self._build_chosen(forms, cache, name, head)
            return
        from_blocks = (not keep_dense and bool(self._quantized_rows)
                       and self.weight.dtype == torch.float32)
        # NOTE: a shared weight (a tied head that also serves embedding lookups) is filled
        # in place, never swapped for a map of the cache
        self._fill_dense(None if keep_dense else cache, name)
        self._quantized_rows, self._decoded = [], None
        if packed_weight.runs(self.weight.dtype):
            # NOTE: a float32 dense form decoded from GGUF blocks runs oneDNN on the plain
            # weight (see _build_chosen)
            dense = self.weight.detach()
            self._packed = [part if from_blocks
                            else torch.ops.mkldnn._reorder_linear_weight(part, None)
                            for part in self._slices(dense)]
            if not keep_dense:
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _build_quant(self, kernels: CpuKernels | None, cache: RepackCache | None, name: str
                     ) -> None:
        bq = self._blocks()
        if bq is None:
            return
        if kernels is not None and QuantMatrix.supports(bq):
            self.quant = QuantMatrix(bq, self.bias)
        else:
            self.quant = Int4Weight.from_block_quant(bq)
        if cache is not None and isinstance(self.quant, QuantMatrix):
            meta, arrays = cached_forms.tile_arrays(self.quant)
            self._bind_quant(meta, cache.put(name, meta, arrays))

    def _quant_from_cache(self, cache: RepackCache, name: str) -> bool:
        """Take the quantized form from the repack cache; False (nothing set) if it lacks it."""
        found = cache.get(name)
        if found is None:
            return False
        meta, arrays = found
        if tuple(meta["shape"]) != self._shape:
            return False
        self._bind_quant(meta, arrays)
        return True

    def _bind_quant(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self.quant = cached_forms.from_tile_arrays(meta, arrays, self._shape, self.bias)

    def _build_chosen(self, forms: FormChoice, cache: RepackCache | None, name: str,
                      head: bool) -> None:
        """Build the forms `forms` chose for this shape's buckets, and only those."""
        quant = self.quant
        assert isinstance(quant, QuantMatrix)
        chosen = forms.choose(self.out_features, self.in_features, head, quant, self._sample,
                              dot=QuantMatrix.supports_dot(self.in_features, quant.group))
        for form in sorted(set(chosen) - {"quant"}):
            if form == "int8":
                self.int8 = cached_forms.int8_form(self._blocks, self._shape, self.bias, cache,
                                                   name)
            elif form in DOT_FORMS:  # their tiles are one
                tiles = self.dot_tiles or cached_forms.qdot_form(self._blocks, self._shape,
                                                                 self.bias, cache, name)
                self.dot_forms[form] = tiles.against(form)
            elif form == "fp32" and head:
                # NOTE: the head's float32 runs oneDNN on the plain weight: as fast as the
                # packed one for a 1B model's head at 9-256 rows, and a warm start keeps it
                # mapped from the repack cache (no packing, no copy in every worker's RSS).
                self._fill_dense(cache, name)
                self._dense[form] = self._slices(self.weight.detach())
            else:
                self._dense[form] = [
                    cached_forms.dense_form(form, self._blocks, self._shape, part, cache, name,
                                            self._backing) for part in self.parts]
        if "quant" not in chosen:
            self.quant = None
        biases = ([None] * len(self.parts) if self.bias is None
                  else self._slices(self.bias.detach()))
        self._dense_bias = {form: [None if b is None else b.to(DENSE_DTYPES[form])
                                   for b in biases] for form in self._dense}
        self.forms = chosen
        self._form_by_rows = [chosen[bucket_of(rows)] for rows in range(ROUTED_ROWS + 1)]
        self._quantized_rows, self._decoded = [], None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _sample(self, rows: int) -> Sample:
        """The first `rows` output rows: float32, on the float32 tiles and in the qdot layout
        (None where its kernel does not take them), as form_choice.py times them."""
        bq, quant = self._blocks(), self.quant
        assert bq is not None and isinstance(quant, QuantMatrix)
        tiles = -(-rows // 16)
        part = QuantMatrix.from_tiles(quant.q[:tiles], quant.scales[:tiles],
                                      None if quant.offsets is None else quant.offsets[:tiles],
                                      (rows, self.in_features),
                                      quant.group, quant.bits)
        first = cached_forms.block_rows(bq, 0, rows)
        dot = (QuantMatrix(first, dot=True) if QuantMatrix.supports_dot(self.in_features, bq.group)
               else None)
        return first.dequantize_torch(), part, dot

    def _blocks(self) -> BlockQuant | None:
        """The GGUF blocks decoded (once per finalize: the forms built from them share it)."""
        if self._decoded is None:
            self._decoded = self._block_quant()
        return self._decoded

    def _fill_dense(self, cache: RepackCache | None = None, name: str = "") -> None:
        """Dequantize the rows load_weights left to us into the dense weight (a tied head:
        from the embedding's decoded blocks, in place, ~8x faster than from the file's).

        With `cache`, the dequantized float32 weight is one of the repack cache's forms
        (`<name>.dense`): a warm start maps it instead of decoding ~100M elements of a 1B
        model's tied head (0.4 s), and runs it from the map (finalize)."""
        if not self._quantized_rows:
            return
        if self.weight.dtype != torch.float32:  # numpy has no bfloat16 to save it as
            cache = None
        shape = (self.out_features, self.in_features)
        if cache is not None and (found := cache.get(f"{name}.dense")) is not None:
            weight = found[1].get("weight")
            if weight is not None and weight.shape == shape and weight.dtype == np.float32:
                self.weight = nn.Parameter(torch.from_numpy(weight), requires_grad=False)
                return
        if self.dense_from is not None:
            self.dense_from.dequantize_into(self.weight.data)
        else:
            for rows, tensor in self._quantized_rows:
                self.weight[rows].copy_(tensor.dequantize())
        if cache is not None:
            # NOTE: written for the next start; this one keeps the copy it has (mapping the
            # file back would add its pages to the cold start's peak RSS for nothing)
            cache.put(f"{name}.dense", {"shape": list(shape)},
                      {"weight": self.weight.detach().numpy()})

    def _block_quant(self) -> BlockQuant | None:
        parts = sorted(self._quantized_rows, key=lambda part: part[0].start)
        covered = sum(rows.stop - rows.start for rows, _ in parts)
        if covered != self.out_features or any(
                tensor.qtype not in BLOCK_QUANT_TYPES for _, tensor in parts):
            return None
        # NOTE: fused rows of mixed types (Q4_K_M keeps some attn_v in Q6_K) are merged into
        # the finer one's layout, exactly (block_quant.py `merge_rows`); the qdot tiles keep
        # each kind's rows in its own layout (QuantMatrix.stacked).
        decoded = [BlockQuant.from_gguf(t.qtype, t.data, t.shape) for _, t in parts]
        return merge_rows(decoded)

    @property
    def _shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dot_tiles(self) -> QuantMatrix | None:
        """The qdot tiles, held once whichever of DOT_FORMS run them; None: none built."""
        return next(iter(self.dot_forms.values()), None)

    @property
    def nbytes(self) -> int:
        """Bytes of every form held (the RSS the weights cost)."""
        dense = self._packed if self._packed is not None else [self.weight]
        quant = sum(m.nbytes for m in (self.quant, self.dot_tiles) if m is not None)
        int8 = self.int8.nbytes if self.int8 is not None else 0
        chosen = sum(t.numel() * t.element_size() for parts in self._dense.values()
                     for t in parts)
        return sum(t.numel() * t.element_size() for t in dense) + quant + int8 + chosen

    @property
    def can_be_batch_invariant(self) -> bool:
        """Whether `make_batch_invariant` has a form to run every call on."""
        quant = isinstance(self.quant, QuantMatrix) and self._kernels is not None
        return quant or (self.forms is None and self.quant is None)

    def make_batch_invariant(self) -> None:
        """Every call, whatever its rows, computes each output row by one arithmetic: on the
        quantized kernels where this projection has them (a fixed-order float32 sum over the
        row, bitwise the same alone or inside a call of any size: CpuKernels.quant_matmul),
        else the dense weight in calls of INVARIANT_TILE_ROWS rows. The forms chosen per
        bucket are not: which one runs follows the call's rows (form_choice.py), and a GEMM's
        order of sums follows them too (bench/batch_invariance.py)."""
        if not self.can_be_batch_invariant:
            raise ValueError("batch-invariant decoding needs the quantized kernels for a "
                             "projection whose forms were chosen without them")
        self.batch_invariant = True
        if self.forms is not None:
            self.forms = ("quant",) * len(self.forms)
            self._form_by_rows = ["quant"] * len(self._form_by_rows)
        elif self.quant is not None:
            self.quant_only = True

    def form_of(self, num_rows: int) -> str:
        """The form a call of `num_rows` rows runs: one of form_choice.FORMS, or `int4`
        (torch's kernel) or `dense` where no choice was made."""
        if self.forms is not None:
            return self._form_by_rows[min(num_rows, ROUTED_ROWS)]
        if self.quant is not None and (num_rows <= QUANT_MAX_ROWS or self.quant_only):
            return "quant" if isinstance(self.quant, QuantMatrix) else "int4"
        return "dense"

    @property
    def quant_rows(self) -> int:
        """Every call of up to this many rows runs on one of the quantized kernels' matrices
        (0: a lone row's does not): the one-call decode step (llama.py) needs every projection
        there, on `one_call_matrix(rows)`. The float kernel's matrices take up to
        QUANT_MAX_ROWS rows a call, qdot's forms any number (a batch's decode step):
        ONE_CALL_ANY_ROWS where every bucket of rows runs one of them."""
        def one_call(rows: int) -> bool:
            form = self.form_of(rows)
            return form in DOT_FORMS or (form == "quant" and rows <= QUANT_MAX_ROWS
                                         and isinstance(self.quant, QuantMatrix))
        rows = next((n - 1 for n in range(1, ROUTED_ROWS + 1) if not one_call(n)), ROUTED_ROWS)
        return ONE_CALL_ANY_ROWS if rows == ROUTED_ROWS else rows

    def one_call_matrix(self, rows: int) -> QuantMatrix:
        """The matrix a call of `rows` (up to `quant_rows`) rows runs on. NOTE: qdot's forms
        share one set of tiles, and the measured choice may differ between buckets of rows
        (`qdot16` at one row, `qdot` above, seen on Zen 3)."""
        matrix = self._quant_form(self.form_of(rows))
        assert isinstance(matrix, QuantMatrix)
        return matrix

    def _quant_form(self, form: str) -> QuantMatrix | Int4Weight | None:
        """The matrix of one of QUANT_FORMS."""
        return self.quant if form == "quant" else self.dot_forms.get(form)

    def input_dtype(self, num_rows: int) -> torch.dtype:
        """The dtype the form chosen for `num_rows` rows reads (others are cast first)."""
        form = self.form_of(num_rows)
        if form in ("int4", "bf16"):
            return torch.bfloat16
        return torch.float32 if form != "dense" else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_rows, in] -> [num_rows, out]: float32 from the compiled quantized and int8
        forms and float16's, bfloat16 from torch's int4 one and bfloat16's, the weight's dtype
        from the dense one (callers cast where they need another). With LoRA rows in the step,
        each adds its adapter's low-rank product to the base output (whichever form computed
        it)."""
        y = self._base_forward(x)
        if self.lora_slot is not None:
            self.lora_slot.add_(self.lora_key, x, y)
        return y

    def forward_parts(self, x: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`forward` a part at a time (the LM head's vocabulary slices, `split`): yields
        (start, stop, its [num_rows, stop - start] output) once each is computed, the next
        only when asked for. Without LoRA (no adapter targets the head)."""
        if len(self.parts) == 1 or not self.sliced(x.shape[0]):
            yield 0, self.out_features, self.forward(x)
            return
        x = self._as_read(x)
        for k, (start, stop) in enumerate(self.parts):
            yield start, stop, self._part_rows(x, k)

    def sliced(self, num_rows: int) -> bool:
        """Whether a call of `num_rows` rows runs a part at a time: a dense form (chosen, or
        the dense weight); the quantized, int8 and int4 forms run whole."""
        form = self.form_of(num_rows)
        return form in DENSE_DTYPES or form == "dense"

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        form = self.form_of(x.shape[0])
        if form in QUANT_FORMS:  # the kernels add the bias themselves
            matrix = self._quant_form(form)
            assert self._kernels is not None and isinstance(matrix, QuantMatrix)
            return self._kernels.quant_matmul(x.float().contiguous(), matrix)
        if form == "int8":
            assert self._kernels is not None and self.int8 is not None
            return self._kernels.int8_matmul(x.float().contiguous(), self.int8)
        if form == "int4":
            assert isinstance(self.quant, Int4Weight)
            y = self.quant(x.to(torch.bfloat16))
            return y if self.bias is None else y.add_(self.bias)
        x = self._as_read(x)
        ys = [self._part_rows(x, k) for k in range(len(self.parts))]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def _as_read(self, x: torch.Tensor) -> torch.Tensor:
        """x in the dtype the dense form for its rows computes in, contiguous."""
        form = self.form_of(x.shape[0])
        return x.to(DENSE_DTYPES.get(form, self.weight.dtype)).contiguous()

    def _part_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Part k's output [num_rows, its rows] of x (`_as_read`); a batch-invariant dense
        projection's in calls of exactly INVARIANT_TILE_ROWS rows, the last padded."""
        if not (self.batch_invariant and self.forms is None):
            return self._part_forward(x, k)
        rows, tile = x.shape[0], INVARIANT_TILE_ROWS
        padded = x.new_zeros(-(-rows // tile) * tile, x.shape[1])  # [rows rounded up, in]
        padded[:rows] = x
        return torch.cat([self._part_forward(padded[start:start + tile], k)  # [tile, its rows]
                          for start in range(0, padded.shape[0], tile)])[:rows]

    def _part_forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Part k's output [num_rows, its rows] of x [num_rows, in] (`_as_read`)."""
        if self.forms is None:  # the dense weight
            start, stop = self.parts[k]
            bias = None if self.bias is None else self.bias[start:stop]
            if self._packed is None:
                return F.linear(x, self.weight[start:stop], bias)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed[k], bias, "none", [None],
                                                      "")
        form = self.form_of(x.shape[0])
        y = torch.ops.mkldnn._linear_pointwise(  # [rows, out] in the form's dtype
            x, self._dense[form][k], self._dense_bias[form][k], "none", [None], "")
        # NOTE: the fused kernels after a projection read float32 or bfloat16, not float16
        return y.float() if form == "fp16" else y

