"""LlamaForCausalLM: a Llama-family decoder (Llama, SmolLM, TinyLlama, Qwen2) in plain torch.

References: nanoGPT `model.py` and gpt-fast `model.py` (a whole decoder in a few hundred lines,
preallocated KV cache), Hugging Face `modeling_llama.py` (the numerics the oracle test holds us
to: float32 RMSNorm, half-split RoPE), vLLM `models/llama.py` (one flat batch of tokens per step,
fused QKV and gate/up projections, `load_weights` from an iterator of named tensors).

Weights are kept in Hugging Face layout (Q/K rows un-permuted), so RoPE is the half-split kind.
Every step runs each linear layer once over all scheduled tokens of all sequences.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelArchConfig
from .attention import AttentionMetadata, PagedAttention, contiguous_attention

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # NOTE: torch.empty, not zeros: load_weights overwrites every element, and untouched
    # pages cost no memory until then.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """y = x W^T (+ b), with W prepacked for oneDNN once the weights are loaded.

    NOTE: measured on this machine (AMD Zen 5, one thread): torch's default float32 GEMM
    (MKL) runs 2-2.5x slower than oneDNN on a prepacked weight (whole-model float32 prefill
    ~2x faster), and bfloat16 F.linear re-packs the weight into oneDNN's blocked layout on
    every call (up to 4x slower for a one-token GEMM). These are the ops torch.compile's CPU
    freezing pass emits; F.linear is the fallback when oneDNN is missing.
    """

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self._packed: torch.Tensor | None = None

    def pack(self, keep_dense: bool = False) -> None:
        """Pack the loaded weight for oneDNN and, unless it is shared (a tied head), free the
        dense copy: the packed one replaces it, and keeping both doubles the weights' RSS."""
        if self._packed is not None or not _onednn_available():
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_dense:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self._packed, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * F.rms_norm(x32, (x.shape[-1],), None, eps).to(x.dtype)


class Rotary:
    """Half-split RoPE (HF `rotate_half` convention), computed per step from positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [head_dim / 2] float32, as HF computes it

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        # [num_tokens, 1, head_dim / 2]: broadcast over heads
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] -> rotated copy, same shape."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # [num_tokens, heads, head_dim / 2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        # Q and K sit side by side in the fused output: one RoPE call rotates both.
        qk = qkv[:, :self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = Rotary.apply(qk, cos, sin)  # [num_tokens, num_heads + num_kv_heads, head_dim]
        q = qk[:, :self.num_heads]  # [num_tokens, num_heads, head_dim]
        k = qk[:, self.num_heads:]  # [num_tokens, num_kv_heads, head_dim]
        v = qkv[:, self.q_size + self.kv_size:].view(
            num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        return q, k, v


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

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = _param(arch.hidden_size, dtype=dtype)
        self.self_attn = LlamaAttention(arch, dtype)
        self.post_attention_layernorm = _param(arch.hidden_size, dtype=dtype)
        self.mlp = LlamaMLP(arch, dtype)


class LlamaForCausalLM(nn.Module):
    """The decoder. `forward` is the paged path the model runner drives; `forward_contiguous`
    is the one-sequence oracle."""

    embed_tokens: nn.Parameter
    norm: nn.Parameter
    lm_head: Linear

    def __init__(self, arch: ModelArchConfig, dtype: str | torch.dtype = "float32") -> None:
        super().__init__()
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        # typed list for the hot loop; the ModuleList registers the same layers
        self._layers = [LlamaDecoderLayer(arch, dtype) for _ in range(arch.num_layers)]
        self.layers = nn.ModuleList(self._layers)
        self.norm = _param(arch.hidden_size, dtype=dtype)
        self.lm_head = Linear(arch.vocab_size, arch.hidden_size, False, dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        self.rotary = Rotary(arch.head_dim, arch.rope_theta)
        self.paged_attention = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [num_tokens] (all sequences of the step, flattened in metadata order) ->
        final-normed hidden states [num_tokens, hidden_size]. Writes the step's K/V."""
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
        eps = self.arch.rms_norm_eps
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [num_tokens, 1, head_dim / 2]
        h = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden_size]
        for layer, kv_cache in zip(self._layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_layernorm, eps)  # [num_tokens, hidden_size]
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            if isinstance(attn, AttentionMetadata):
                o = self.paged_attention(q, k, v, kv_cache, attn)  # [num_tokens, q_size]
            else:
                o = contiguous_attention(q, k, v, kv_cache, attn)  # [num_tokens, q_size]
            h = h + layer.self_attn.o_proj(o)  # [num_tokens, hidden_size]
            x = rms_norm(h, layer.post_attention_layernorm, eps)
            h = h + layer.mlp(x)  # [num_tokens, hidden_size]
        return rms_norm(h, self.norm, eps)

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
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors in Hugging Face layout and names (`model.layers.0.self_attn.
        q_proj.weight`, ...) into the fused parameters, converting dtype on the way.

        Takes an iterator so a loader can dequantize one tensor at a time. Call it once:
        afterwards the projections are packed for oneDNN and their dense copies freed.
        """
        arch = self.arch
        q, kv = arch.q_size, arch.kv_size
        targets: dict[str, tuple[torch.Tensor, slice | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None),
            "model.norm.weight": (self.norm, None),
        }
        if not arch.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, None)
        qkv_parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv),
                     "v_proj": slice(q + kv, q + 2 * kv)}
        ffn = arch.intermediate_size
        for i, layer in enumerate(self._layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[p + "input_layernorm.weight"] = (layer.input_layernorm, None)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None)
            targets[p + "self_attn.o_proj.weight"] = (attn.o_proj.weight, None)
            for proj, part in qkv_parts.items():
                targets[p + f"self_attn.{proj}.weight"] = (attn.qkv_proj.weight, part)
                if attn.qkv_proj.bias is not None:
                    targets[p + f"self_attn.{proj}.bias"] = (attn.qkv_proj.bias, part)
            targets[p + "mlp.gate_proj.weight"] = (mlp.gate_up_proj.weight, slice(0, ffn))
            targets[p + "mlp.up_proj.weight"] = (mlp.gate_up_proj.weight, slice(ffn, 2 * ffn))
            targets[p + "mlp.down_proj.weight"] = (mlp.down_proj.weight, None)

        for name, tensor in weights:
            if name not in targets:
                if name == "lm_head.weight" and arch.tie_word_embeddings:
                    continue  # some tied checkpoints still store the head: the embedding wins
                raise ValueError(f"unexpected weight {name!r} for {arch.architecture}")
            param, rows = targets.pop(name)
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
        if targets:
            missing = sorted(targets)
            raise ValueError(f"missing {len(missing)} weights, e.g. {missing[:3]}")
        # NOTE: LLMQ_ONEDNN_LINEAR=0 keeps plain F.linear, for comparing the two.
        if os.environ.get("LLMQ_ONEDNN_LINEAR", "1") != "0":
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack(keep_dense=module.weight is self.embed_tokens)
