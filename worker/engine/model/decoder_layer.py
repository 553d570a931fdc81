"""One decoder block of the Llama-style families: attention (Q/K/V fused, optional per-head
Q/K norm, RoPE), SwiGLU MLP, the two RMSNorms, and where each weight of a checkpoint goes.

References: Hugging Face `modeling_llama.py` / `modeling_qwen3.py` (the numerics the oracle
tests hold us to: float32 RMSNorm, Qwen3's q_norm/k_norm over each head before RoPE), vLLM
`models/llama.py` (fused QKV and gate/up projections, weights loaded in slices into them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelArchConfig
from .linear import Linear, _param
from .rope import Rotary

if TYPE_CHECKING:  # moe.py builds its experts from this module's LlamaMLP
    from .moe import SparseMoe

# A checkpoint tensor's destination: (parameter, its rows or None for all, the Linear that
# owns it or None): load_weights in llama.py copies into it.
Target = tuple[torch.Tensor, slice | None, Linear | None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * F.rms_norm(x32, (x.shape[-1],), None, eps).to(x.dtype)


class LlamaAttention(nn.Module):
    qkv_proj: Linear
    o_proj: Linear
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, norm_dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.eps = arch.rms_norm_eps
        # NOTE: Q, K and V in one matrix: one GEMM per layer instead of three.
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, arch.hidden_size,
                               arch.attention_bias, dtype)
        self.o_proj = Linear(arch.hidden_size, self.q_size, False, dtype)
        # Qwen3 / Gemma 3 norm each head; OLMoE the whole Q and K vectors
        self.qk_norm_full = arch.family.qk_norm_full
        q_len, k_len = ((self.q_size, self.kv_size) if self.qk_norm_full
                        else (self.head_dim, self.head_dim))
        self.q_norm = _param(q_len, dtype=torch.float32) if arch.qk_norm else None
        self.k_norm = _param(k_len, dtype=torch.float32) if arch.qk_norm else None

    def norm_qk_(self, qkv32: torch.Tensor) -> None:
        """Qwen3: RMSNorm over each head of Q and of K (OLMoE: over all of Q and of K), in
        place in the fused float32 output [num_tokens, q_size + 2 * kv_size], before RoPE."""
        if self.q_norm is None or self.k_norm is None:
            return
        n = qkv32.shape[0]
        q = qkv32[:, :self.q_size]
        k = qkv32[:, self.q_size:self.q_size + self.kv_size]
        if not self.qk_norm_full:
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
        q.copy_(rms_norm(q, self.q_norm, self.eps))
        k.copy_(rms_norm(k, self.k_norm, self.eps))

    def qkv(self, x: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden] -> q [num_tokens, num_heads, hd] and kv [num_tokens,
        2 * num_kv_heads, hd] (K heads, then V heads), both views of one fresh tensor."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        # RoPE as a complex multiply needs float32; on the bfloat16 path it is rounded back.
        qkv32 = qkv.float()
        self.norm_qk_(qkv32)
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

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gelu = arch.family.mlp_act == "gelu_tanh"  # Gemma's GeGLU
        ffn = self.intermediate_size = intermediate_size or arch.intermediate_size
        self.gate_up_proj = Linear(2 * ffn, arch.hidden_size, False, dtype)
        self.down_proj = Linear(arch.hidden_size, ffn, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act.mul_(up))  # [num_tokens, hidden_size]

    def weight_targets(self, prefix: str) -> dict[str, Target]:
        """HF names under `prefix` (`model.layers.3.mlp.`) -> where each goes."""
        ffn = self.intermediate_size
        return {
            prefix + "gate_proj.weight": (self.gate_up_proj.weight, slice(0, ffn),
                                          self.gate_up_proj),
            prefix + "up_proj.weight": (self.gate_up_proj.weight, slice(ffn, 2 * ffn),
                                        self.gate_up_proj),
            prefix + "down_proj.weight": (self.down_proj.weight, None, self.down_proj),
        }


class LlamaDecoderLayer(nn.Module):
    """`post_attention_layernorm` is the norm before the MLP (Llama's name); with Gemma 2/3's
    sandwich norms, `attn_out_norm` and `mlp_out_norm` normalise the attention and MLP
    outputs before they join the residual stream."""

    input_layernorm: nn.Parameter
    self_attn: LlamaAttention
    post_attention_layernorm: nn.Parameter
    mlp: LlamaMLP | SparseMoe
    attn_out_norm: nn.Parameter | None
    mlp_out_norm: nn.Parameter | None

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, norm_dtype: torch.dtype,
                 mlp: SparseMoe | None = None) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.input_layernorm = _param(arch.hidden_size, dtype=norm_dtype)
        self.self_attn = LlamaAttention(arch, dtype, norm_dtype)
        self.post_attention_layernorm = _param(arch.hidden_size, dtype=norm_dtype)
        self.mlp = mlp or LlamaMLP(arch, dtype)
        self.residual_multiplier = arch.residual_multiplier  # granite
        sandwich = arch.family.sandwich_norms
        self.attn_out_norm = _param(arch.hidden_size, dtype=norm_dtype) if sandwich else None
        self.mlp_out_norm = _param(arch.hidden_size, dtype=norm_dtype) if sandwich else None

    @property
    def dense_mlp(self) -> LlamaMLP:
        """The dense MLP, for the fused kernels (which no MoE model reaches: llama.py)."""
        if not isinstance(self.mlp, LlamaMLP):
            raise TypeError("a mixture-of-experts layer has no dense MLP")
        return self.mlp

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """QKV, O, gate/up and down, as the one-call decode kernel takes them."""
        attn, mlp = self.self_attn, self.dense_mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def attn_residual(self, o: torch.Tensor) -> torch.Tensor:
        """The attention's output projection, as it joins the residual stream."""
        y = self.self_attn.o_proj(o)
        if self.attn_out_norm is not None:
            y = rms_norm(y, self.attn_out_norm, self.eps)
        return self.scale_residual(y)

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed stream x, as it joins the residual stream."""
        y = self.mlp(x)
        if self.mlp_out_norm is not None:
            y = rms_norm(y, self.mlp_out_norm, self.eps)
        return self.scale_residual(y)

    def scale_residual(self, y: torch.Tensor) -> torch.Tensor:
        """granite: a block's outputs join the residual stream scaled (in place)."""
        return y if self.residual_multiplier is None else y.mul_(self.residual_multiplier)

    def weight_targets(self, prefix: str) -> dict[str, Target]:
        """HF checkpoint names under `prefix` (`model.layers.3.`) -> where each goes."""
        attn = self.self_attn
        q, kv = attn.q_size, attn.kv_size
        targets: dict[str, Target] = {
            "input_layernorm.weight": (self.input_layernorm, None, None),
            "post_attention_layernorm.weight": (self.post_attention_layernorm, None, None),
            "self_attn.o_proj.weight": (attn.o_proj.weight, None, attn.o_proj),
        }
        targets.update(self.mlp.weight_targets("mlp."))
        qkv_parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv),
                     "v_proj": slice(q + kv, q + 2 * kv)}
        for proj, part in qkv_parts.items():
            targets[f"self_attn.{proj}.weight"] = (attn.qkv_proj.weight, part, attn.qkv_proj)
            if attn.qkv_proj.bias is not None:
                targets[f"self_attn.{proj}.bias"] = (attn.qkv_proj.bias, part, None)
        if self.attn_out_norm is not None and self.mlp_out_norm is not None:  # Gemma's names
            targets["pre_feedforward_layernorm.weight"] = targets.pop(
                "post_attention_layernorm.weight")
            targets["post_attention_layernorm.weight"] = (self.attn_out_norm, None, None)
            targets["post_feedforward_layernorm.weight"] = (self.mlp_out_norm, None, None)
        if attn.q_norm is not None and attn.k_norm is not None:
            targets["self_attn.q_norm.weight"] = (attn.q_norm, None, None)
            targets["self_attn.k_norm.weight"] = (attn.k_norm, None, None)
        return {prefix + name: target for name, target in targets.items()}
