"""GGUF weights -> named tensors with Hugging Face names, one tensor at a time.

References: gguf-py (`GGUFReader`, `gguf.quants.dequantize`), llama.cpp's
`convert_hf_to_gguf.py` (`LlamaModel.permute`: Q/K rows in interleaved-RoPE order) and
transformers' `modeling_gguf_pytorch_utils.py` (the name map).

Q and K rows are yielded in interleaved-RoPE order (pairs of adjacent rows rotate together),
llama.cpp's order: the model rotates them with one complex multiply (llama.py `Rotary`).
Llama GGUFs store them so already; other GGUFs (and HF folders) are permuted into it, and so
are the per-head Q/K norm weights (Qwen3), which scale the same dimensions.

Quantized tensors can be yielded as `QuantizedTensor` (their raw blocks) instead of float32, for
`--weights native`: the model builds its quantized forms from the blocks and dequantizes the
rest.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from .arch import ModelArchConfig
from .families import GGUF_INTERLEAVED_QK

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# What gguf.quants.dequantize handles and we have checked: plain floats, the legacy block
# quants, and the K-quants. IQ* and ternary types are refused at load rather than half-supported.
SUPPORTED_TENSOR_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [experts, ...]: split per expert
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # Gemma 2/3: on the attention output
    "post_ffw_norm": "post_feedforward_layernorm",  # Gemma 2/3: on the MLP output
}
# NOTE: `ffn_norm` is the norm before the MLP in every family: Llama's checkpoints call it
# post_attention_layernorm, Gemma 2/3's pre_feedforward_layernorm (their
# post_attention_layernorm is the norm on the attention output).
_SANDWICH_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
# Tensors the arch config reads (arch.py), not weights of the model.
_ARCH_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                           "rope_factors_short.weight"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, sandwich_norms: bool = False) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (in the names of
    a Gemma 2/3 checkpoint with `sandwich_norms`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _SANDWICH_NAMES if sandwich_norms else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def permute_qk(rows: Any, num_heads: int, rotary_dim: int | None = None) -> Any:
    """llama.cpp's `permute`: per head, HF half-split rows (half, pair index) -> interleaved
    (pair index, half), over the first `rotary_dim` rows of each head (all by default; the
    rest, not rotated, keep their order). Works on numpy arrays and torch tensors of any
    trailing shape (float rows or raw quantized blocks)."""
    head_dim = rows.shape[0] // num_heads
    rotary_dim = rotary_dim or head_dim
    half = rotary_dim // 2
    one_head = [half * (i % 2) + i // 2 for i in range(rotary_dim)] + list(
        range(rotary_dim, head_dim))
    order = np.array([h * head_dim + i for h in range(num_heads) for i in one_head])
    return rows[torch.from_numpy(order) if isinstance(rows, torch.Tensor) else order]


def split_fused(name: str, rows: Any, arch: ModelArchConfig) -> list[tuple[str, Any]]:
    """Phi-3's fused checkpoint tensors (`qkv_proj`, `gate_up_proj`) -> their parts by rows,
    in the names the model loads; any other tensor unchanged."""
    if ".self_attn.qkv_proj." in name:
        q, kv = arch.q_size, arch.kv_size
        return [(name.replace("qkv_proj", "q_proj"), rows[:q]),
                (name.replace("qkv_proj", "k_proj"), rows[q:q + kv]),
                (name.replace("qkv_proj", "v_proj"), rows[q + kv:q + 2 * kv])]
    if ".mlp.gate_up_proj." in name:
        ffn = arch.intermediate_size
        return [(name.replace("gate_up_proj", "gate_proj"), rows[:ffn]),
                (name.replace("gate_up_proj", "up_proj"), rows[ffn:])]
    return [(name, rows)]


def to_interleaved(name: str, rows: Any, arch: ModelArchConfig) -> Any:
    """Q/K rows (and Q/K norm weights, which scale the same dimensions) of a half-split
    checkpoint in the interleaved-RoPE order the model uses; other tensors unchanged."""
    rotary_dim = arch.rope.rotary_dim(arch.head_dim)
    if ".q_proj." in name:
        return permute_qk(rows, arch.num_heads, rotary_dim)
    if ".k_proj." in name:
        return permute_qk(rows, arch.num_kv_heads, rotary_dim)
    if name.endswith(("q_norm.weight", "k_norm.weight")):  # one head's or all heads'
        return permute_qk(rows, rows.shape[0] // arch.head_dim, rotary_dim)
    return rows


@dataclass
class QuantizedTensor:
    """A block-quantized GGUF matrix as stored: rows of raw blocks."""

    qtype: gguf.GGMLQuantizationType
    data: np.ndarray  # [out_features, row_bytes] uint8
    shape: tuple[int, int]  # [out_features, in_features]

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32."""
        return torch.from_numpy(gguf.quants.dequantize(self.data, self.qtype).reshape(self.shape))


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    """Fail before any dequantizing if a tensor's type is not one we load."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"unsupported GGUF tensor type {tensor.tensor_type.name} "
                f"(tensor {tensor.name}); supported: "
                f"{', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}")


def iter_gguf_weights(reader: gguf.GGUFReader, arch: ModelArchConfig,
                      keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, tensor in F.linear layout) for every tensor of the file: float32, or
    with `keep_quantized` a `QuantizedTensor` for every block-quantized matrix."""
    check_tensor_types(reader)
    # NOTE: only llama's converter permutes Q/K; the others are written in half-split order.
    half_split = (reader.fields["general.architecture"].contents()
                  not in GGUF_INTERLEAVED_QK)
    for tensor in reader.tensors:
        if tensor.name in _ARCH_TENSORS:
            continue
        name = hf_name(tensor.name, arch.family.sandwich_norms)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF: innermost first
        quantized = tensor.tensor_type not in (Q.F32, Q.F16, Q.BF16)
        if keep_quantized and quantized and len(shape) >= 2:
            # [out, row_bytes], or [experts, out, row_bytes]
            data: np.ndarray = np.asarray(tensor.data).reshape(*shape[:-1], -1)
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            quantized = False
        if name.endswith("mlp.up_proj.weight") and shape[0] == 2 * arch.intermediate_size:
            name = name.replace("up_proj", "gate_up_proj")  # Phi-3: gate and up in ffn_up
        if ".mlp.experts." in name:  # [experts, out, in]: one tensor per expert
            parts = [(name.replace(".experts.", f".experts.{e}."), data[e])
                     for e in range(shape[0])]
        else:
            parts = split_fused(name, data, arch)
        for part_name, part in parts:
            if half_split:
                part = to_interleaved(part_name, part, arch)
            if quantized:
                yield part_name, QuantizedTensor(tensor.tensor_type, np.ascontiguousarray(part),
                                                 (part.shape[0], shape[-1]))
            else:
                # F32 tensors come back as read-only memmaps of the file: torch wants a copy.
                yield part_name, torch.from_numpy(np.array(part) if not part.flags.writeable
                                                  else np.ascontiguousarray(part))
