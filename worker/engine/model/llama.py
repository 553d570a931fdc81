"""LlamaForCausalLM: the Llama-style decoder of every supported family (families.py: Llama,
Mistral, Qwen2/3, Gemma 2/3, Phi-3, granite, and the MoE ones) in plain torch.

References: nanoGPT `model.py` and gpt-fast `model.py` (a whole decoder in a few hundred lines,
preallocated KV cache), Hugging Face `modeling_llama.py` (the numerics the oracle test holds us
to: float32 RMSNorm, RoPE frequencies), vLLM `models/llama.py` (one flat batch of tokens per
step, fused QKV and gate/up projections, `load_weights` from an iterator of named tensors),
Meta's original `llama/model.py` (RoPE as a complex multiply on interleaved pairs).

Q/K rows are kept in interleaved-RoPE order (llama.cpp's; see gguf_loader.py), so RoPE is one
in-place complex multiply; attention scores do not depend on the order of a head's dimensions.
Every step runs each linear layer once over all scheduled tokens of all sequences.

Three ways to run a step, the first that can express the model: the one-call decode kernel
(plain Llama/Qwen2 blocks, native weights, a few decodes), the fused per-op kernels (SwiGLU,
plain residuals and RoPE: adds Qwen3's Q/K norm, sliding windows, granite's multipliers), and
torch ops per layer (everything else). docs/models.md lists which family runs where.

Precision: `dtype` is the KV cache's. Activations (the residual stream, norms, RoPE) are float32
except on the all-bfloat16 path (`weights="bf16"` with a bfloat16 cache), which keeps today's
bfloat16 numerics. `weights` says how the projections are held (linear.py): `native` (from
the GGUF blocks, in the form per bucket of rows measured fastest on this CPU: form_choice.py),
`bf16` or `fp32`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Generator, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmq.worker.engine.lora.lora_batch import LoraBatch, LoraSlot

from . import huge_pages
from .arch import ModelArchConfig
from .attention import AttentionMetadata, PagedAttention, contiguous_attention
from .block_quant import QuantizedEmbedding
from .cpu_kernels import CpuKernels, DecoderLayer
from .decoder_layer import LlamaDecoderLayer, LlamaMLP, rms_norm
from .form_choice import FormChoice, bucket_of
from .gguf_loader import QuantizedTensor
from .linear import QUANT_MAX_ROWS, Linear, _param
from .llama_weights import load_weights
from .moe import SparseMoe
from .quant_matrix import QuantMatrix
from .repack_cache import RepackCache
from .rope import RopeConfig, Rotary

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS = ("native", "bf16", "fp32")
# NOTE: the LM head runs as this many vocabulary slices, with a pause point after each
# (`logits_parts`): one GEMM over the whole vocabulary for every sampled row was the longest
# stretch of a batch step an interactive arrival could not pause (docs/performance.md, lanes).
HEAD_PARTS = 8
MLP_SLICE_ROWS = 256  # a prefill's MLP runs in slices of at least this many rows


@dataclass(frozen=True)
class _KeptRows:
    """The rows a step's last layer runs past its attention (`forward_layers`' out_rows), and
    their adapters numbered as those rows (None: none)."""

    rows: torch.Tensor  # [k] int64, ascending
    lora: LoraBatch | None

    def narrow(self, o: torch.Tensor, h: torch.Tensor, slot: LoraSlot
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output and residual stream at these rows alone; the projections'
        adapters from here on, numbered as these rows."""
        slot.batch = self.lora
        return o[self.rows], h[self.rows]


def run_to_end(layers: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """The hidden states a layer-by-layer forward (`forward_layers`) returns, run through."""
    while True:
        try:
            next(layers)
        except StopIteration as done:
            return done.value


def default_weights(dtype: str) -> str:
    """`native` (quantized kernels where the file has them) unless the float32 path is asked
    for: float32 means float32 weights and activations throughout (the oracle tests' path)."""
    return "fp32" if dtype == "float32" else "native"


class LlamaForCausalLM(nn.Module):
    """The decoder. `forward` is the paged path the model runner drives; `forward_contiguous`
    is the one-sequence oracle."""

    embed_tokens: nn.Parameter
    norm: nn.Parameter
    lm_head: Linear

    def __init__(self, arch: ModelArchConfig, dtype: str | torch.dtype = "float32",
                 weights: str | None = None) -> None:
        super().__init__()
        if isinstance(dtype, torch.dtype):
            dtype = next(name for name, d in DTYPES.items() if d == dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        # NOTE: a model built directly defaults to the dense path of its dtype (the loader
        # picks `native` for GGUF files); `native` needs load_weights to see GGUF blocks.
        weights = weights or ("fp32" if dtype == "float32" else "bf16")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.arch = arch
        self.weights = weights
        self.dtype = DTYPES[dtype]  # the KV cache's
        # [see the module docstring] bfloat16 activations only on the all-bfloat16 path
        self.act_dtype = (torch.bfloat16 if weights == "bf16" and dtype == "bfloat16"
                          else torch.float32)
        weight_dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=weight_dtype)
        # typed list for the hot loop; the ModuleList registers the same layers
        self._layers = [LlamaDecoderLayer(
            arch, weight_dtype, self.act_dtype,
            SparseMoe(arch, weight_dtype) if arch.num_experts and i not in arch.dense_layers
            else None) for i in range(arch.num_layers)]
        self.layers = nn.ModuleList(self._layers)
        self.norm = _param(arch.hidden_size, dtype=self.act_dtype)
        self.lm_head = Linear(arch.vocab_size, arch.hidden_size, False, weight_dtype)
        self.lm_head.split(HEAD_PARTS)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        # native: a quantized embedding is looked up from its blocks, not a dense table
        self.embed_quant: QuantizedEmbedding | None = None
        # native, tied, the head on qdot tiles: lookups from those tiles instead (below)
        self.embed_tiles: QuantMatrix | None = None
        # native with the kernels: decode steps of up to this many rows (those every decoder
        # projection runs on the quantized kernels) run every layer in one kernel call
        self._one_call = False
        self._one_call_rows = 0
        self.forms: FormChoice | None = None  # native with the kernels: the forms chosen
        self._one_call_layers: tuple[tuple[int, ...], dict[int, ctypes.Array]] | None = None
        # One Rotary per distinct RoPE (Gemma 3's local and global layers differ), one
        # PagedAttention per distinct window; each layer points at its own.
        rotaries: dict[RopeConfig, Rotary] = {}
        self._layer_rotary = [rotaries.setdefault(arch.layer_rope(i),
                                                  Rotary(arch.head_dim, arch.layer_rope(i)))
                              for i in range(arch.num_layers)]
        self.rotary = self._layer_rotary[0]
        # The fused paged path (float32 activations) runs on the compiled CPU kernels; without
        # them (no compiler) or on the bfloat16 path, the same steps run as torch ops.
        self.kernels = CpuKernels.load() if self.act_dtype == torch.float32 else None
        attentions: dict[int | None, PagedAttention] = {}
        self._layer_attention = [attentions.setdefault(arch.layer_window(i), PagedAttention(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, self.kernels,
            arch.layer_window(i), arch.attn_scale, arch.attn_softcap))
            for i in range(arch.num_layers)]
        self.paged_attention = self._layer_attention[0]
        # NOTE: the one-call decode kernel runs plain Llama blocks only: one RoPE table, full
        # attention, no Q/K norm. Any other model decodes op by op (still fused kernels).
        self._one_call_able = (len(rotaries) == 1 and not arch.qk_norm
                               and set(arch.layer_types) == {"full_attention"})
        # NOTE: the fused per-op path has SwiGLU, plain residual adds, unscaled embeddings and
        # plain RoPE only: Gemma, and Phi with longrope or partial RoPE, run every step as
        # torch ops (the decode kernel still serves their unwindowed, uncapped layers).
        fam = arch.family
        self._fused_able = (fam.mlp_act == "silu" and not fam.sandwich_norms
                            and not fam.scaled_embedding and not arch.num_experts
                            and all(r.plain for r in self._layer_rotary))
        self._one_call_able = (self._one_call_able and self._fused_able
                               and arch.embedding_multiplier is None  # granite
                               and arch.residual_multiplier is None)
        # LoRA: every dense decoder projection adds the step's adapters' products
        # (worker/engine/lora/lora_batch.py); the LM head and MoE experts take none.
        self.lora_slot = LoraSlot(self.kernels)
        for i, layer in enumerate(self._layers):
            named = [("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj)]
            if isinstance(layer.mlp, LlamaMLP):
                named += [("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)]
            for projection, linear in named:
                linear.lora_slot, linear.lora_key = self.lora_slot, f"{i}.{projection}"

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor], lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids [num_tokens] (all sequences of the step, flattened in metadata order) ->
        final-normed hidden states [num_tokens, hidden_size]. Writes the step's K/V. `lora`:
        the rows that run under an adapter (None or no segments: the base model's alone)."""
        return run_to_end(self.forward_layers(input_ids, attn_metadata, kv_caches, lora))

    def forward_layers(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata,
                       kv_caches: list[torch.Tensor], lora: LoraBatch | None = None,
                       out_rows: list[int] | None = None) -> Generator[int, None, torch.Tensor]:
        """`forward` a decoder layer at a time: yields each layer's index once it is done, and
        returns the hidden states. Between two layers the caller may run whole other steps
        (worker/engine/step_interrupt.py): the step's tensors live in this generator, and
        `lora` is set again on every resume. The one-call decode kernel of up to QUANT_MAX_ROWS
        rows yields nothing.

        `out_rows`: the rows whose hidden states the caller reads (None: all), distinct, ascending;
        returned in that order. The last layer then runs its output projection and MLP for
        those rows alone (under their adapters, `LoraBatch.of_rows`): no later layer reads
        the others, whose K/V it has already written. A prefill chunk samples one row of each
        prompt, so its last layer's projections shrink ~100x (the 1B model: 1/16 of a chunk's
        projections)."""
        batch = lora if lora is not None and lora.segments else None
        keep = None
        if out_rows is not None and len(out_rows) < input_ids.shape[0]:
            kept_lora = batch.of_rows(out_rows) if batch is not None else LoraBatch()
            keep = _KeptRows(torch.tensor(out_rows, dtype=torch.long),
                             kept_lora if kept_lora.segments else None)
        if self.kernels is not None and self._fused_able:
            run = self._run_fused(input_ids, attn_metadata, kv_caches, keep)
        else:
            run = self._run(input_ids, attn_metadata.positions, kv_caches, attn_metadata, keep)
        while True:
            self.lora_slot.batch = batch
            try:
                layer = next(run)
            except StopIteration as done:
                return done.value
            finally:
                self.lora_slot.batch = None
            yield layer

    @torch.inference_mode()
    def forward_contiguous(self, input_ids: torch.Tensor, start_pos: int,
                           cache: list[torch.Tensor]) -> torch.Tensor:
        """The oracle: one sequence's tokens at start_pos.. over a contiguous cache
        (`make_contiguous_cache`). Returns [num_tokens, hidden_size]."""
        positions = torch.arange(start_pos, start_pos + input_ids.shape[0])
        return run_to_end(self._run(input_ids, positions, cache, start_pos))

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             kv_caches: list[torch.Tensor], attn: AttentionMetadata | int,
             keep: _KeptRows | None = None) -> Generator[int, None, torch.Tensor]:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        eps, act_dtype = self.arch.rms_norm_eps, self.act_dtype
        # [num_tokens, 1, head_dim / 2] complex64 for each distinct RoPE
        seq_lens = None  # each token's sequence length this step: longrope picks by it
        if any(r.inv_freq_long is not None for r in self._layer_rotary):
            seq_lens = (torch.repeat_interleave(attn.seq_lens_tensor,
                                                torch.tensor(attn.query_lens))
                        if isinstance(attn, AttentionMetadata)
                        else torch.full_like(positions, attn + positions.shape[0]))
        freqs = {id(r): r.freqs(positions, seq_lens) for r in self._layer_rotary}
        # NOTE: a fresh tensor (embedding output), so the residual adds below go in place.
        h = self.embed(input_ids).to(act_dtype)  # [num_tokens, hidden]
        for i, (layer, kv_cache) in enumerate(zip(self._layers, kv_caches, strict=True)):
            x = rms_norm(h, layer.input_layernorm, eps)  # [num_tokens, hidden_size]
            q, kv = layer.self_attn.qkv(x, freqs[id(self._layer_rotary[i])], act_dtype)
            paged = self._layer_attention[i]
            if isinstance(attn, AttentionMetadata):
                o = paged(q, kv, kv_cache, attn)  # [num_tokens, q_size]
            else:  # [num_tokens, q_size]
                o = contiguous_attention(q, kv, kv_cache, attn, paged.window, paged.scale,
                                         paged.softcap)
            if keep is not None and i + 1 == len(self._layers):  # `forward_layers` says why
                o, h = keep.narrow(o, h, self.lora_slot)
                if not len(h):
                    yield i
                    return h
            h.add_(layer.attn_residual(o))  # [num_tokens, hidden_size]
            x = rms_norm(h, layer.post_attention_layernorm, eps)
            h.add_(layer.mlp_residual(x))  # [num_tokens, hidden_size]
            yield i
        return rms_norm(h, self.norm, eps)

    def _run_fused(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor], keep: _KeptRows | None = None
                   ) -> Generator[int, None, torch.Tensor]:
        """`_run` on the compiled kernels: per layer two GEMMs and one kernel around each,
        so a one-token step is ~9 calls a layer instead of ~30 torch ops (the Python and
        dispatch cost of a decode step). Residual adds are fused into the next RMSNorm, RoPE
        into the K/V store, and each kernel writes the dtype its consumer reads."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        kernels, eps, arch = self.kernels, self.arch.rms_norm_eps, self.arch
        assert kernels is not None
        n = input_ids.shape[0]
        tables = {id(r): r.tables(max(meta.seq_lens)) for r in self._layer_rotary}
        cos, sin = tables[id(self.rotary)]  # [positions, head_dim / 2]
        with_kv = bool(meta.prefills)  # only prefills read this step's K/V outside the cache
        layers = self._layers
        h = self.embed(input_ids)  # [n, hidden] residual stream (float32 here)
        # NOTE: the one-call kernel has no LoRA hook: a step with adapter rows runs op by op.
        if (self._one_call and meta.num_decodes == meta.num_seqs and n <= self._one_call_rows
                and self.lora_slot.batch is None):
            # NOTE: a few decodes: the whole step in one kernel call. The ~9 calls a layer
            # below cost ~3 us of Python and ctypes each, 15-20% of a one-token step. A
            # batch's decode step: a call a layer, so that it can pause between layers
            # (step_interrupt.py), each recomputing the norm the last one ended with (Zen 3,
            # SmolLM2 at 64 rows: 163-168 ms a step where op by op took 176-184).
            decoder = self._decoder_layers(kv_caches, n)
            calls = [(0, len(layers))] if n <= QUANT_MAX_ROWS else [
                (i, 1) for i in range(len(layers))]
            for start, count in calls:
                last = start + count == len(layers)
                out = kernels.decode_layers(
                    decoder, h, arch.intermediate_size,
                    self.norm if last else layers[start + count].input_layernorm, eps,
                    arch.num_heads, kv_caches[0], meta.positions, cos, sin, meta.slot_mapping,
                    meta.block_tables, meta.seq_lens_tensor, self.paged_attention.scale,
                    start, count)
                if out is None:
                    raise RuntimeError("decode_layers: a shape checked at load has no kernel")
                hidden = out
                if len(calls) > 1:
                    yield start
            return hidden if keep is None else hidden[keep.rows]
        first = layers[0]
        x = kernels.add_rms_norm(h, None, first.input_layernorm, eps,
                                 first.self_attn.qkv_proj.input_dtype(n))
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.dense_mlp
            qkv = attn.qkv_proj(x)  # [n, q_size + 2 * kv_size]
            attn.norm_qk_(qkv)  # Qwen3's per-head Q/K norm, before RoPE (no-op elsewhere)
            cos, sin = tables[id(self._layer_rotary[i])]
            q, kv = kernels.rope_store(qkv, arch.num_heads, arch.num_kv_heads, meta.positions,
                                       cos, sin, meta.slot_mapping, kv_cache, with_kv)
            o = self._layer_attention[i].attend(  # [n, q_size]
                q, kv, kv_cache, meta, q.new_empty(q.shape, dtype=attn.o_proj.input_dtype(n)))
            if keep is not None and i + 1 == len(layers):  # `forward_layers` says why
                o, h = keep.narrow(o, h, self.lora_slot)
                if not len(h):
                    yield i
                    return h
                n = len(h)
            x = kernels.add_rms_norm(h, layer.attn_residual(o), layer.post_attention_layernorm,
                                     eps, mlp.gate_up_proj.input_dtype(n))  # h += o_proj(o)
            down = layer.scale_residual(self._mlp_in_slices(mlp, x))
            if i + 1 < len(layers):
                norm, dtype = layers[i + 1].input_layernorm, layers[i + 1].self_attn.qkv_proj
                x = kernels.add_rms_norm(h, down, norm, eps, dtype.input_dtype(n))
            else:
                x = kernels.add_rms_norm(h, down, self.norm, eps, torch.float32)
            yield i
        return x

    def _mlp_in_slices(self, mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of x [n, hidden], in slices of at least MLP_SLICE_ROWS rows:
        a prefill chunk's [n, 2 * ffn] intermediate was a step's largest allocation (1,024
        tokens of the 1B model: 64 MiB, and 32 more for the product), the peak of a worker's
        RSS. Every slice stays in n's bucket of rows (more than 128), so each runs the form
        and input dtype n's step chose, at its large-row rate."""
        kernels, n = self.kernels, x.shape[0]
        assert kernels is not None
        dtype = mlp.down_proj.input_dtype(n)
        # NOTE: a step's adapter segments are rows of the whole step (LoraBatch): a slice's
        # projections would add them at the wrong rows, past the slice's end (a crash, seen)
        slices = 1 if self.lora_slot.batch is not None else max(1, n // MLP_SLICE_ROWS)
        parts = [mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(rows), dtype))
                 for rows in x.tensor_split(slices)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decoder_layers(self, kv_caches: list[torch.Tensor], rows: int) -> ctypes.Array:
        """The layers as the one-call kernel reads them for a step of `rows` rows (each
        projection's matrix for that bucket of rows), built once per set of caches."""
        key = tuple(c.data_ptr() for c in kv_caches)
        bucket = bucket_of(rows)
        if self._one_call_layers is None or self._one_call_layers[0] != key:
            self._one_call_layers = (key, {})
        built = self._one_call_layers[1]
        if bucket not in built:
            structs = []
            for layer, cache in zip(self._layers, kv_caches, strict=True):
                structs.append(DecoderLayer(
                    *(p.one_call_matrix(rows).struct for p in layer.projections),
                    layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr(),
                    cache.data_ptr()))
            built[bucket] = (DecoderLayer * len(structs))(*structs)
        return built[bucket]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> a fresh [n, hidden_size] tensor in the activations' dtype (the
        residual adds go in place), scaled where the family scales it."""
        if self.embed_tiles is not None:
            h = self.embed_tiles.rows(input_ids).to(self.act_dtype)
        elif self.embed_quant is not None:
            h = self.embed_quant(input_ids).to(self.act_dtype)
        else:
            h = F.embedding(input_ids, self.embed_tokens).to(self.act_dtype)
        if self.arch.family.scaled_embedding:
            # NOTE: as Gemma does it: the scale rounded to the activations' dtype first
            h.mul_(torch.tensor(self.arch.hidden_size ** 0.5, dtype=self.act_dtype))
        if self.arch.embedding_multiplier is not None:  # granite
            h.mul_(self.arch.embedding_multiplier)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] (only the rows being sampled) -> float32 logits [n, vocab]."""
        return run_to_end(self.logits_parts(hidden))

    def logits_parts(self, hidden: torch.Tensor) -> Generator[int, None, torch.Tensor]:
        """`compute_logits` a vocabulary slice at a time: yields each slice's index once its
        logits are in, and returns them all. Between two slices the caller may run whole other
        steps (worker/engine/step_interrupt.py); the logits so far wait in this generator."""
        vocab = self.arch.vocab_size
        logits = None  # [n, vocab] float32
        for k, (start, stop, part) in enumerate(self.lm_head.forward_parts(hidden)):
            if (start, stop) == (0, vocab):
                # NOTE: the whole vocabulary in one part (the quantized forms): a copy into a
                # fresh [n, vocab] was ~3% of a batch-64 step (12 MiB written, its pages new)
                logits = part.float()
            else:
                if logits is None:
                    logits = hidden.new_empty(hidden.shape[0], vocab, dtype=torch.float32)
                logits[:, start:stop] = part  # [n, stop - start], cast as .float() casts it
            yield k
        assert logits is not None
        if self.arch.logits_scaling is not None:  # granite
            logits.div_(self.arch.logits_scaling)
        cap = self.arch.final_softcap
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- batch invariance ----------------------------------------------------------------

    def make_batch_invariant(self) -> None:
        """Batch-invariant decoding (vLLM's VLLM_BATCH_INVARIANT): from now on every token's
        hidden states and logits are bitwise the same whatever else its step holds, however
        its prompt was chunked, and whether its prefix came from the cache. Each op runs one
        fixed arithmetic per row: the projections and the LM head on the quantized kernels, or
        dense weights in calls of a fixed number of rows (Linear.make_batch_invariant),
        attention on the decode kernel for every query row, prompt rows too
        (PagedAttention.attend), and the norms, RoPE and SwiGLU on the fused per-row kernels
        (the one-call decode step runs those same functions). Raises
        ValueError for a model or setting that cannot run so (the all-bfloat16 path, families
        off the fused kernels, sliding windows)."""
        problem = None
        if self.kernels is None:
            problem = "the compiled CPU kernels (a C++ compiler) and float32 activations"
        elif not self._fused_able:
            problem = f"the fused kernels, which {self.arch.family.name} models do not run on"
        elif any(a.kernels is None for a in self._layer_attention):
            problem = ("the decode attention kernel, which sliding-window or soft-capped "
                       "layers (or more than 8 query heads per kv head) do not run on")
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if problem is None and not all(m.can_be_batch_invariant for m in linears):
            problem = ("the quantized kernels for projections whose forms were chosen without "
                       "them (load the model with batch_invariant)")
        if problem is not None:
            raise ValueError(f"batch-invariant decoding needs {problem}")
        for linear in linears:
            linear.make_batch_invariant()
        for attention in self._layer_attention:
            attention.batch_invariant = True
        logger.info("batch-invariant decoding: projections on the %s, attention on the decode "
                    "kernel for every query row",
                    "quantized kernels" if all(m.quant is not None for m in linears)
                    else "dense weights in calls of 16 rows")

    @property
    def batch_invariant(self) -> bool:
        return self.paged_attention.batch_invariant

    # ---- caches ---------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` tokens takes across all layers (K and V)."""
        arch = self.arch
        per_layer = 2 * arch.num_kv_heads * block_size * arch.head_dim * self.dtype.itemsize
        return arch.num_layers * per_layer

    def make_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed [2, num_kv_heads, num_blocks, block_size, head_dim] tensor per layer.

        Zeroed, not empty: masked slots are multiplied by exactly 0 after softmax, and
        0 * NaN from uninitialised memory would poison the whole row.
        """
        arch = self.arch
        shape = (2, arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        # NOTE: zeroed at once, not a lazily zeroed anonymous map (tried 2026-12-02: ~0.1 s
        # less at start, but a level-1 sleep then released only part of the cache's memory);
        # moved onto 2 MiB pages in the background (huge_pages.py: attention reads blocks
        # at random)
        return [huge_pages.zeros(shape, self.dtype) for _ in range(arch.num_layers)]

    def make_contiguous_cache(self, max_len: int) -> list[torch.Tensor]:
        """For `forward_contiguous`: one [2, num_kv_heads, max_len, head_dim] tensor per layer."""
        arch = self.arch
        shape = (2, arch.num_kv_heads, max_len, arch.head_dim)
        return [torch.zeros(shape, dtype=self.dtype) for _ in range(arch.num_layers)]

    # ---- weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
                     repack: RepackCache | None = None, forms: FormChoice | None = None
                     ) -> None:
        """Copy named tensors in Hugging Face layout and names (`model.layers.0.self_attn.
        q_proj.weight`, ...) into the fused parameters (llama_weights.py says how); then
        whether the one-call decode kernel runs this model's decode steps."""
        load_weights(self, self._layers, weights, repack, forms)
        self._one_call_rows = 0 if not self._one_call_able else min(
            (p.quant_rows for layer in self._layers for p in layer.projections), default=0)
        self._one_call = (self._one_call_able and self.kernels is not None
                          and self.paged_attention.kernels is not None
                          and self._one_call_rows > 0)
