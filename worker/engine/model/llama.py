"""LlamaForCausalLM: a Llama-family decoder (Llama, SmolLM, TinyLlama, Qwen2) in plain torch.

References: nanoGPT `model.py` and gpt-fast `model.py` (a whole decoder in a few hundred lines,
preallocated KV cache), Hugging Face `modeling_llama.py` (the numerics the oracle test holds us
to: float32 RMSNorm, RoPE frequencies), vLLM `models/llama.py` (one flat batch of tokens per
step, fused QKV and gate/up projections, `load_weights` from an iterator of named tensors),
Meta's original `llama/model.py` (RoPE as a complex multiply on interleaved pairs).

Q/K rows are kept in interleaved-RoPE order (llama.cpp's; see gguf_loader.py), so RoPE is one
in-place complex multiply; attention scores do not depend on the order of a head's dimensions.
Every step runs each linear layer once over all scheduled tokens of all sequences.

Precision: `dtype` is the KV cache's. Activations (the residual stream, norms, RoPE) are float32
except on the all-bfloat16 path (`weights="bf16"` with a bfloat16 cache), which keeps today's
bfloat16 numerics. `weights` says how the projections are held (linear.py): `native` (GGUF
quantized kernels for small batches, float32 GEMMs for large ones), `bf16` or `fp32`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelArchConfig
from .attention import AttentionMetadata, PagedAttention, contiguous_attention
from .block_quant import BLOCK_QUANT_TYPES, BlockQuant, QuantizedEmbedding
from .cpu_kernels import CpuKernels, DecoderLayer, QuantMatrix
from .gguf_loader import QuantizedTensor
from .linear import QUANT_MAX_ROWS, Linear, _param

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS = ("native", "bf16", "fp32")


def default_weights(dtype: str) -> str:
    """`native` (quantized kernels where the file has them) unless the float32 path is asked
    for: float32 means float32 weights and activations throughout (the oracle tests' path)."""
    return "fp32" if dtype == "float32" else "native"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * F.rms_norm(x32, (x.shape[-1],), None, eps).to(x.dtype)


class Rotary:
    """RoPE on interleaved pairs (dims 2i, 2i+1) as a complex multiply, in place."""

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [head_dim / 2] float32, as HF computes it
        self._cos = self._sin = torch.empty(0, head_dim // 2)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= num_positions, head_dim / 2] float32 for the fused kernels; grown
        by doubling, computed exactly as `freqs` computes them per step."""
        if self._cos.shape[0] < num_positions:
            n = max(num_positions, 2 * self._cos.shape[0], 256)
            angles = torch.arange(n).float()[:, None] * self.inv_freq[None, :]  # [n, hd / 2]
            self._cos, self._sin = angles.cos(), angles.sin()
        return self._cos, self._sin

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens] -> e^(i * pos * inv_freq) [num_tokens, 1, head_dim / 2]
        complex64 (broadcast over heads)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, hd / 2]
        return torch.polar(torch.ones_like(angles), angles)[:, None, :]

    @staticmethod
    def apply_(x: torch.Tensor, freqs: torch.Tensor) -> None:
        """Rotate x [num_tokens, heads, head_dim] float32 in place (x may be a strided view)."""
        num_tokens, heads, head_dim = x.shape
        pairs = torch.view_as_complex(x.view(num_tokens, heads, head_dim // 2, 2))
        pairs.mul_(freqs)  # [num_tokens, heads, head_dim / 2] complex64


class LlamaAttention(nn.Module):
    qkv_proj: Linear
    o_proj: Linear

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        # NOTE: Q, K and V in one matrix: one GEMM per layer instead of three.
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, arch.hidden_size,
                               arch.attention_bias, dtype)
        self.o_proj = Linear(arch.hidden_size, self.q_size, False, dtype)

    def qkv(self, x: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden] -> q [num_tokens, num_heads, hd] and kv [num_tokens,
        2 * num_kv_heads, hd] (K heads, then V heads), both views of one fresh tensor."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        # RoPE as a complex multiply needs float32; on the bfloat16 path it is rounded back.
        qkv32 = qkv.float()
        # Q and K sit side by side in the fused output: one multiply rotates both, in place.
        Rotary.apply_(qkv32[:, :self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), freqs)
        qkv = qkv32.to(dtype)
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        kv = qkv[:, self.q_size:].view(num_tokens, 2 * self.num_kv_heads, self.head_dim)
        return q, kv


class LlamaMLP(nn.Module):
    gate_up_proj: Linear
    down_proj: Linear

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(2 * arch.intermediate_size, arch.hidden_size, False, dtype)
        self.down_proj = Linear(arch.hidden_size, arch.intermediate_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # [num_tokens, hidden_size]


class LlamaDecoderLayer(nn.Module):
    input_layernorm: nn.Parameter
    self_attn: LlamaAttention
    post_attention_layernorm: nn.Parameter
    mlp: LlamaMLP

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, norm_dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.input_layernorm = _param(arch.hidden_size, dtype=norm_dtype)
        self.self_attn = LlamaAttention(arch, dtype)
        self.post_attention_layernorm = _param(arch.hidden_size, dtype=norm_dtype)
        self.mlp = LlamaMLP(arch, dtype)


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
        self._layers = [LlamaDecoderLayer(arch, weight_dtype, self.act_dtype)
                        for _ in range(arch.num_layers)]
        self.layers = nn.ModuleList(self._layers)
        self.norm = _param(arch.hidden_size, dtype=self.act_dtype)
        self.lm_head = Linear(arch.vocab_size, arch.hidden_size, False, weight_dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        # native: a quantized embedding is looked up from its blocks, not a dense table
        self.embed_quant: QuantizedEmbedding | None = None
        # native with the kernels: small decode steps run every layer in one kernel call
        self._one_call = False
        self._one_call_layers: tuple[tuple[int, ...], ctypes.Array] | None = None
        self.rotary = Rotary(arch.head_dim, arch.rope_theta)
        # The fused paged path (float32 activations) runs on the compiled CPU kernels; without
        # them (no compiler) or on the bfloat16 path, the same steps run as torch ops.
        self.kernels = CpuKernels.load() if self.act_dtype == torch.float32 else None
        self.paged_attention = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                              self.kernels)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [num_tokens] (all sequences of the step, flattened in metadata order) ->
        final-normed hidden states [num_tokens, hidden_size]. Writes the step's K/V."""
        if self.kernels is not None:
            return self._run_fused(input_ids, attn_metadata, kv_caches)
        return self._run(input_ids, attn_metadata.positions, kv_caches, attn_metadata)

    @torch.inference_mode()
    def forward_contiguous(self, input_ids: torch.Tensor, start_pos: int,
                           cache: list[torch.Tensor]) -> torch.Tensor:
        """The oracle: one sequence's tokens at start_pos.. over a contiguous cache
        (`make_contiguous_cache`). Returns [num_tokens, hidden_size]."""
        positions = torch.arange(start_pos, start_pos + input_ids.shape[0])
        return self._run(input_ids, positions, cache, start_pos)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             kv_caches: list[torch.Tensor], attn: AttentionMetadata | int) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        eps, act_dtype = self.arch.rms_norm_eps, self.act_dtype
        freqs = self.rotary.freqs(positions)  # [num_tokens, 1, head_dim / 2] complex64
        # NOTE: a fresh tensor (embedding output), so the residual adds below go in place.
        h = self.embed(input_ids).to(act_dtype)  # [num_tokens, hidden]
        for layer, kv_cache in zip(self._layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_layernorm, eps)  # [num_tokens, hidden_size]
            q, kv = layer.self_attn.qkv(x, freqs, act_dtype)
            if isinstance(attn, AttentionMetadata):
                o = self.paged_attention(q, kv, kv_cache, attn)  # [num_tokens, q_size]
            else:
                o = contiguous_attention(q, kv, kv_cache, attn)  # [num_tokens, q_size]
            h.add_(layer.self_attn.o_proj(o))  # [num_tokens, hidden_size]
            x = rms_norm(h, layer.post_attention_layernorm, eps)
            h.add_(layer.mlp(x))  # [num_tokens, hidden_size]
        return rms_norm(h, self.norm, eps)

    def _run_fused(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """`_run` on the compiled kernels: per layer two GEMMs and one kernel around each,
        so a one-token step is ~9 calls a layer instead of ~30 torch ops (the Python and
        dispatch cost of a decode step). Residual adds are fused into the next RMSNorm, RoPE
        into the K/V store, and each kernel writes the dtype its consumer reads."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        kernels, eps, arch = self.kernels, self.arch.rms_norm_eps, self.arch
        assert kernels is not None
        n = input_ids.shape[0]
        cos, sin = self.rotary.tables(max(meta.seq_lens))  # [positions, head_dim / 2]
        with_kv = bool(meta.prefills)  # only prefills read this step's K/V outside the cache
        layers = self._layers
        h = self.embed(input_ids).float()  # [n, hidden] residual stream
        if self._one_call and meta.num_decodes == meta.num_seqs and n <= QUANT_MAX_ROWS:
            # NOTE: a few decodes: the whole step in one kernel call. The ~9 calls a layer
            # below cost ~3 us of Python and ctypes each, 15-20% of a one-token step.
            out = kernels.decode_layers(
                self._decoder_layers(kv_caches), h, arch.intermediate_size, self.norm, eps,
                arch.num_heads, kv_caches[0], meta.positions, cos, sin, meta.slot_mapping,
                meta.block_tables, meta.seq_lens_tensor, self.paged_attention.scale)
            if out is None:
                raise RuntimeError("decode_layers: a shape checked at load has no kernel")
            return out
        first = layers[0]
        x = kernels.add_rms_norm(h, None, first.input_layernorm, eps,
                                 first.self_attn.qkv_proj.input_dtype(n))
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(x)  # [n, q_size + 2 * kv_size]
            q, kv = kernels.rope_store(qkv, arch.num_heads, arch.num_kv_heads, meta.positions,
                                       cos, sin, meta.slot_mapping, kv_cache, with_kv)
            o = self.paged_attention.attend(  # [n, q_size]
                q, kv, kv_cache, meta, q.new_empty(q.shape, dtype=attn.o_proj.input_dtype(n)))
            x = kernels.add_rms_norm(h, attn.o_proj(o), layer.post_attention_layernorm, eps,
                                     mlp.gate_up_proj.input_dtype(n))  # h += o_proj(o)
            act = kernels.silu_mul(mlp.gate_up_proj(x), mlp.down_proj.input_dtype(n))
            if i + 1 < len(layers):
                norm, dtype = layers[i + 1].input_layernorm, layers[i + 1].self_attn.qkv_proj
                x = kernels.add_rms_norm(h, mlp.down_proj(act), norm, eps, dtype.input_dtype(n))
            else:
                x = kernels.add_rms_norm(h, mlp.down_proj(act), self.norm, eps, torch.float32)
        return x

    def _decoder_layers(self, kv_caches: list[torch.Tensor]) -> ctypes.Array:
        """The layers as the one-call kernel reads them, built once per set of caches."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._one_call_layers is None or self._one_call_layers[0] != key:
            structs = []
            for layer, cache in zip(self._layers, kv_caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                structs.append(DecoderLayer(
                    *(p.quant.struct for p in projections),  # type: ignore[union-attr]
                    layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr(),
                    cache.data_ptr()))
            self._one_call_layers = (key, (DecoderLayer * len(structs))(*structs))
        return self._one_call_layers[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> a fresh [n, hidden_size] tensor (the residual adds go in place)."""
        if self.embed_quant is not None:
            return self.embed_quant(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] (only the rows being sampled) -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()

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
        return [torch.zeros(shape, dtype=self.dtype) for _ in range(arch.num_layers)]

    def make_contiguous_cache(self, max_len: int) -> list[torch.Tensor]:
        """For `forward_contiguous`: one [2, num_kv_heads, max_len, head_dim] tensor per layer."""
        arch = self.arch
        shape = (2, arch.num_kv_heads, max_len, arch.head_dim)
        return [torch.zeros(shape, dtype=self.dtype) for _ in range(arch.num_layers)]

    # ---- weights --------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
                     ) -> None:
        """Copy named tensors in Hugging Face layout and names (`model.layers.0.self_attn.
        q_proj.weight`, ...) into the fused parameters, converting dtype on the way.

        Takes an iterator so a loader can dequantize one tensor at a time. A `QuantizedTensor`
        is dequantized into the dense weight and, with `weights="native"`, also kept for the
        projection's quantized form. Call it once: afterwards the projections build their forms
        (linear.py) and free the dense copies they no longer need.
        """
        arch = self.arch
        q, kv = arch.q_size, arch.kv_size
        Target = tuple[torch.Tensor, slice | None, Linear | None]
        tied_head = self.lm_head if arch.tie_word_embeddings else None
        targets: dict[str, Target] = {
            "model.embed_tokens.weight": (self.embed_tokens, None, tied_head),
            "model.norm.weight": (self.norm, None, None),
        }
        if not arch.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, None, self.lm_head)
        qkv_parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv),
                     "v_proj": slice(q + kv, q + 2 * kv)}
        ffn = arch.intermediate_size
        for i, layer in enumerate(self._layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[p + "input_layernorm.weight"] = (layer.input_layernorm, None, None)
            targets[p + "post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm, None, None)
            targets[p + "self_attn.o_proj.weight"] = (attn.o_proj.weight, None, attn.o_proj)
            for proj, part in qkv_parts.items():
                targets[p + f"self_attn.{proj}.weight"] = (
                    attn.qkv_proj.weight, part, attn.qkv_proj)
                if attn.qkv_proj.bias is not None:
                    targets[p + f"self_attn.{proj}.bias"] = (attn.qkv_proj.bias, part, None)
            targets[p + "mlp.gate_proj.weight"] = (
                mlp.gate_up_proj.weight, slice(0, ffn), mlp.gate_up_proj)
            targets[p + "mlp.up_proj.weight"] = (
                mlp.gate_up_proj.weight, slice(ffn, 2 * ffn), mlp.gate_up_proj)
            targets[p + "mlp.down_proj.weight"] = (mlp.down_proj.weight, None, mlp.down_proj)

        native = self.weights == "native"
        for name, tensor in weights:
            if name not in targets:
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue  # some tied checkpoints still store the head: the embedding wins
                raise ValueError(f"unexpected weight {name!r} for {arch.architecture}")
            param, rows, linear = targets.pop(name)
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}")
            if isinstance(tensor, QuantizedTensor):
                if native and linear is not None:
                    linear.add_quantized(rows, tensor)
                if (native and param is self.embed_tokens
                        and tensor.qtype in BLOCK_QUANT_TYPES):
                    self.embed_quant = QuantizedEmbedding(
                        BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape))
                tensor = tensor.dequantize()
            dest.copy_(tensor)
        if targets:
            missing = sorted(targets)
            raise ValueError(f"missing {len(missing)} weights, e.g. {missing[:3]}")
        # NOTE: the dense table stays only where lookups still need it; the tied head then
        # keeps just its packed copy.
        keep_embedding = self.embed_quant is None
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize(native, self.kernels,
                                keep_dense=keep_embedding and module.weight is self.embed_tokens,
                                int8=module is not self.lm_head)
        if not keep_embedding:
            self.embed_tokens = nn.Parameter(self.embed_tokens.new_empty(0), requires_grad=False)
        self._one_call = (self.kernels is not None and self.paged_attention.kernels is not None
                          and all(isinstance(p.quant, QuantMatrix) for layer in self._layers
                                  for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)))
        logger.info("weights %s: %.0f MiB in the projections", self.weights,
                    sum(m.nbytes for m in self.modules() if isinstance(m, Linear)) / 2**20)
