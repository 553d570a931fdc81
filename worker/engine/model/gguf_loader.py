"""GGUF weights -> named float32 tensors in Hugging Face layout, one tensor at a time.

References: gguf-py (`GGUFReader`, `gguf.quants.dequantize`), llama.cpp's
`convert_hf_to_gguf.py` (`LlamaModel.permute`, the Q/K row permutation undone here) and
transformers' `modeling_gguf_pytorch_utils.py` (the same reverse permutation and name map).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch

from .arch import ModelArchConfig

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
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows (pair index, half) -> (half, pair index).

    llama.cpp keeps Q/K in interleaved-RoPE order; the model here uses HF's half-split RoPE.
    """
    head_dim_half = rows.shape[0] // num_heads // 2
    return (rows.reshape(num_heads, head_dim_half, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    """Fail before any dequantizing if a tensor's type is not one we load."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"unsupported GGUF tensor type {tensor.tensor_type.name} "
                f"(tensor {tensor.name}); supported: "
                f"{', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}")


def iter_gguf_weights(reader: gguf.GGUFReader, arch: ModelArchConfig
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor in F.linear layout) for every tensor of the file."""
    check_tensor_types(reader)
    # NOTE: only llama's converter permutes Q/K; qwen2 is written in half-split order already.
    permuted = arch.architecture == "llama"
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        # [out, in] float32; GGUF lists dims innermost first, so reverse them
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = data.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
        if permuted and ".q_proj." in name:
            data = unpermute_qk(data, arch.num_heads)
        elif permuted and ".k_proj." in name:
            data = unpermute_qk(data, arch.num_kv_heads)
        if not data.flags.writeable:
            # F32 tensors come back as read-only memmaps of the file: torch wants its own copy.
            data = np.array(data)
        yield name, torch.from_numpy(data)
