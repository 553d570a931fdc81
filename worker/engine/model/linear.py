"""Linear: y = x W^T (+ b), with W held in the forms that are fastest for the step's batch.

References: vLLM `layers/linear.py` (one module per projection, weights loaded in slices into a
fused matrix), gpt-fast `quantize.py` (`WeightOnlyInt4Linear` over `_weight_int4pack_mm`),
torch.compile's CPU freezing pass (the oneDNN ops used for the dense form).

Forms, chosen per call by the number of rows (tokens) in x:

- quantized (`--weights native`, GGUF block-quantized tensors), up to `QUANT_MAX_ROWS` rows:
  a decode step of a few sequences reads each weight once, and 4-bit weights are 1/8 of
  float32's bytes. With the compiled kernels (cpu_kernels.py) it is a `QuantMatrix`, run in
  float32 arithmetic (the file's own numbers, exactly); without them torch's int4 kernel
  (`Int4Weight`, bfloat16 in and out) where the type maps onto it.
- int8 (`--weights native` with the compiled kernels, above `QUANT_MAX_ROWS` rows): an
  `Int8Matrix`, run on torch's int8 GEMM, ~2x float32 oneDNN (int8_matrix.py says how it
  keeps the activations' precision). The decoder's projections only: the LM head's error
  would go straight into the logits, and it runs on few rows (the sampled ones).
- dense: the weight prepacked for oneDNN in float32 (`fp32`, and `native` where int8 is not
  built) or bfloat16 (`bf16`). Above a few rows the GEMM is compute-bound, and on CPUs
  without AMX float32 oneDNN beats both bfloat16 and the int4 kernels (bench/kernels.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .block_quant import BLOCK_QUANT_TYPES, BlockQuant, QuantizedEmbedding, merge_rows
from .cpu_kernels import CpuKernels, QuantMatrix
from .gguf_loader import QuantizedTensor
from .int4_weight import Int4Weight
from .int8_matrix import Int8Matrix
from .repack_cache import RepackCache

if TYPE_CHECKING:
    from llmq.worker.engine.lora.lora_batch import LoraSlot

logger = logging.getLogger(__name__)

# NOTE: measured with bench/kernels.py on a 2-vCPU Xeon (AVX-512, no AMX), one thread: the
# quantized kernels beat float32 oneDNN up to ~8 rows on every SmolLM2 shape (M=4: 0.6-0.7x;
# M=16: 1.3-1.4x). With weights hot in cache the int8 form is ahead of them already at 4-8 rows
# (bench/results/kernels-int8-2026-12-01.txt), but a model streams its weights from memory,
# where 4-bit blocks are ~60% of int8's bytes, and up to 8 rows a decode step is one kernel
# call (llama.py); that crossover is not re-measured.
QUANT_MAX_ROWS = 8


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # NOTE: torch.empty, not zeros: load_weights overwrites every element, and untouched
    # pages cost no memory until then.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


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
        self._packed: torch.Tensor | None = None
        self.quant: QuantMatrix | Int4Weight | None = None  # the small-batch form, if any
        self.int8: Int8Matrix | None = None  # the large-batch form of `native`, if any
        self._kernels: CpuKernels | None = None
        self._quantized_rows: list[tuple[slice, QuantizedTensor]] = []
        self.quant_only = False  # set by finalize: the quantized form serves every batch size
        self.dense_from: QuantizedEmbedding | None = None  # a tied head's faster dense source
        # LoRA (worker/engine/lora/): where the step's adapters are, and this projection's
        # name among their weights (`3.qkv`); None for projections no adapter targets.
        self.lora_slot: LoraSlot | None = None
        self.lora_key = ""

    def add_quantized(self, rows: slice | None, tensor: QuantizedTensor) -> None:
        """Remember the GGUF blocks of some rows: `finalize` builds the forms from them and
        dequantizes them into the dense weight only where a dense form is still needed."""
        self._quantized_rows.append((rows or slice(0, self.out_features), tensor))

    def finalize(self, native: bool, kernels: CpuKernels | None, keep_dense: bool = False,
                 int8: bool = True, quant_only: bool = False, cache: RepackCache | None = None,
                 name: str = "") -> None:
        """Build the forms once the weights are loaded: with `native`, quantized from the GGUF
        blocks and (`int8`, given the kernels) int8 for large batches; otherwise the
        oneDNN-packed dense weight. Unless it is shared (a tied head), the dense copy is freed:
        the form built replaces it, and keeping both doubles the RSS. With `cache`, the forms
        built from blocks are taken from (or stored in) the repack cache under `name`.

        `quant_only` (mixture-of-experts experts): where a quantized form is built, it is the
        only one, for every batch size: an expert sees a few tokens a step, and an int8 or
        dense copy of every expert would multiply the weights' memory for nothing."""
        self._kernels = kernels
        if native and self._quantized_rows:
            want_int8 = kernels is not None and int8 and not quant_only
            if not (kernels is not None and cache is not None
                    and self._forms_from_cache(cache, name, want_int8)):
                self._build_forms(kernels, want_int8, cache, name)
        self.quant_only = quant_only and self.quant is not None
        if self.quant_only:
            self._quantized_rows = []
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        needs_dense = keep_dense or (self.int8 is None and self._packed is None)
        from_blocks = (needs_dense and not keep_dense and bool(self._quantized_rows)
                       and self.weight.dtype == torch.float32)
        if needs_dense:
            # NOTE: a shared weight (a tied head that also serves embedding lookups) is filled
            # in place, never swapped for a map of the cache
            self._fill_dense(None if keep_dense else cache, name)
        self._quantized_rows = []
        if self.int8 is None and self._packed is None and _onednn_available():
            # NOTE: a float32 dense form decoded from GGUF blocks (the LM head of `native`)
            # runs oneDNN on the plain weight: as fast as the packed one for a 1B model's head
            # at 9-256 rows, 1 or 2 threads (up to ~20% slower at 9 rows for 151936 x 896,
            # equal above), and a warm start keeps it mapped from the repack cache: no 0.33 s
            # of packing, and no 400 MB copy in every worker's RSS.
            dense = self.weight.detach()
            self._packed = (dense if from_blocks
                            else torch.ops.mkldnn._reorder_linear_weight(dense, None))
        if (self.int8 is not None or self._packed is not None) and not keep_dense:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _build_forms(self, kernels: CpuKernels | None, want_int8: bool,
                     cache: RepackCache | None, name: str) -> None:
        bq = self._block_quant()
        if bq is None:
            return
        if kernels is not None and QuantMatrix.supports(bq):
            self.quant = QuantMatrix(bq, self.bias)
        else:
            self.quant = Int4Weight.from_block_quant(bq)
        if self.quant is not None and want_int8 and Int8Matrix.available():
            # NOTE: from this projection's blocks alone: one float32 matrix at a time
            self.int8 = Int8Matrix(bq.dequantize_torch(), self.bias)
        if cache is not None and isinstance(self.quant, QuantMatrix):
            quant = self.quant
            arrays = {"q": quant.q.numpy(), "scales": quant.scales.numpy(),
                      "offsets": quant.offsets.numpy()}
            if self.int8 is not None:
                arrays |= {"int8_q": self.int8.q.numpy(), "int8_scale": self.int8.scale.numpy()}
            meta = {"shape": [quant.out_features, quant.in_features], "group": quant.group,
                    "bits": quant.bits}
            self._bind_forms(meta, cache.put(name, meta, arrays), want_int8)

    def _forms_from_cache(self, cache: RepackCache, name: str, want_int8: bool) -> bool:
        """Take the forms from the repack cache; False (nothing set) if it lacks them."""
        found = cache.get(name)
        if found is None:
            return False
        meta, arrays = found
        if tuple(meta["shape"]) != (self.out_features, self.in_features):
            return False
        if want_int8 and Int8Matrix.available() != ("int8_q" in arrays):
            return False
        self._bind_forms(meta, arrays, want_int8)
        return True

    def _bind_forms(self, meta: dict, arrays: dict[str, np.ndarray], want_int8: bool) -> None:
        t = {part: torch.from_numpy(a) for part, a in arrays.items()}
        self.quant = QuantMatrix.from_tiles(t["q"], t["scales"], t["offsets"],
                                            (self.out_features, self.in_features),
                                            meta["group"], meta["bits"], self.bias)
        if want_int8 and "int8_q" in t:
            self.int8 = Int8Matrix.from_parts(t["int8_q"], t["int8_scale"], self.bias)

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
        # the finer one's layout, exactly (block_quant.py `merge_rows`).
        decoded = [BlockQuant.from_gguf(t.qtype, t.data, t.shape) for _, t in parts]
        return merge_rows(decoded)
    @property
    def nbytes(self) -> int:
        """Bytes of every form held (the RSS the weights cost)."""
        dense = self._packed if self._packed is not None else self.weight
        quant = self.quant.nbytes if self.quant is not None else 0
        int8 = self.int8.nbytes if self.int8 is not None else 0
        return dense.numel() * dense.element_size() + quant + int8

    def input_dtype(self, num_rows: int) -> torch.dtype:
        """The dtype the form chosen for `num_rows` rows reads (others are cast first)."""
        if isinstance(self.quant, Int4Weight) and num_rows <= QUANT_MAX_ROWS:
            return torch.bfloat16
        return torch.float32 if self.quant is not None else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_rows, in] -> [num_rows, out]: float32 from the compiled quantized and int8
        forms, bfloat16 from torch's int4 one, the weight's dtype from the dense one (callers
        cast where they need another). With LoRA rows in the step, each adds its adapter's
        low-rank product to the base output (whichever form computed it)."""
        y = self._base_forward(x)
        if self.lora_slot is not None:
            self.lora_slot.add_(self.lora_key, x, y)
        return y

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quant, QuantMatrix) and self.quant_only and x.shape[0] > QUANT_MAX_ROWS:
            # NOTE: the kernel takes up to QUANT_MAX_ROWS rows a call
            return torch.cat([self._base_forward(rows) for rows in x.split(QUANT_MAX_ROWS)])
        if self.quant is not None and (x.shape[0] <= QUANT_MAX_ROWS or self.quant_only):
            if isinstance(self.quant, QuantMatrix):  # it adds the bias itself
                assert self._kernels is not None
                return self._kernels.quant_matmul(x.float(), self.quant)
            y = self.quant(x.to(torch.bfloat16))
            return y if self.bias is None else y.add_(self.bias)
        if self.int8 is not None:  # it adds the bias itself
            assert self._kernels is not None
            return self._kernels.int8_matmul(x.float(), self.int8)
        x = x.to(self.weight.dtype)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self._packed, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)
