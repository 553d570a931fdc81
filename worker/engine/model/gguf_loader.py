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
_ARCH_TENSORS = frozenset({"rope_freqs.weight"})
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


def permute_qk(rows: Any, num_heads: int) -> Any:
    """llama.cpp's `permute`: per head, HF half-split rows (half, pair index) -> interleaved
    (pair index, half). Works on any trailing shape (float rows or raw quantized blocks)."""
    head_dim_half = rows.shape[0] // num_heads // 2
    return (rows.reshape(num_heads, 2, head_dim_half, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


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
        if keep_quantized and quantized and len(shape) == 2:
            data: np.ndarray = np.asarray(tensor.data).reshape(shape[0], -1)  # [out, row_bytes]
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            quantized = False
        if half_split and ".q_proj." in name:
            data = permute_qk(data, arch.num_heads)
        elif half_split and ".k_proj." in name:
            data = permute_qk(data, arch.num_kv_heads)
        elif half_split and name.endswith(("q_norm.weight", "k_norm.weight")):
            data = permute_qk(data, 1)  # one head's [head_dim] weights
        if quantized:
            yield name, QuantizedTensor(tensor.tensor_type, np.ascontiguousarray(data), shape)
            continue
        if not data.flags.writeable:
            # F32 tensors come back as read-only memmaps of the file: torch wants its own copy.
            data = np.array(data)
        yield name, torch.from_numpy(data)
