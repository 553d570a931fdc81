"""llama.cpp's GGUF LoRA (`convert_lora_to_gguf.py`) -> LoraAdapter.

References: llama.cpp `convert_lora_to_gguf.py` (general.type = adapter, adapter.type = lora,
adapter.lora.alpha; tensors `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r] in
numpy order) and `llama-adapter.cpp` (scale = alpha / rank; no rsLoRA). Like the base model's
GGUFs, only the llama converter writes Q/K rows in interleaved-RoPE order
(gguf_loader.py), so only the other architectures' B rows are permuted here.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import gguf
import torch

from llmq.worker.engine.lora.adapter import LoraAdapter, LoraPart, fuse_parts, scaling
from llmq.worker.engine.lora.lora_error import LoraError
from llmq.worker.engine.model.arch import ModelArchConfig
from llmq.worker.engine.model.families import GGUF_INTERLEAVED_QK

GGUF_SUFFIX = ".gguf"
_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_FLOAT_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                          gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0})


def load_gguf_adapter(name: str, path: Path, arch: ModelArchConfig, max_rank: int
                      ) -> LoraAdapter:
    """LoraError naming the adapter and the problem when it cannot be served."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise LoraError(f"adapter {name!r}: {path.name} is not a readable GGUF file: {e}"
                        ) from None

    def field(key: str) -> Any:
        value = reader.fields.get(key)
        return None if value is None else value.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise LoraError(f"adapter {name!r}: {path.name} is no LoRA adapter (general.type "
                        f"{field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    alpha = field("adapter.lora.alpha")
    if not isinstance(alpha, int | float) or alpha <= 0:
        raise LoraError(f"adapter {name!r}: adapter.lora.alpha must be positive, got {alpha!r}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    digest = hashlib.sha256()
    for tensor in reader.tensors:
        m = _TENSOR_RE.fullmatch(tensor.name)
        if m is None or m.group(2) not in _MODULES:
            raise LoraError(f"adapter {name!r}: unexpected tensor {tensor.name!r} (llmq applies "
                            "LoRA to the decoder layers' q/k/v/o and gate/up/down projections)")
        if tensor.tensor_type not in _FLOAT_TYPES:
            raise LoraError(f"adapter {name!r}: {tensor.name} is {tensor.tensor_type.name}; "
                            f"supported: {', '.join(sorted(t.name for t in _FLOAT_TYPES))}")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # innermost first there
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        digest.update(tensor.name.encode() + data.tobytes())
        key = (int(m.group(1)), _MODULES[m.group(2)])
        pairs.setdefault(key, {})[m.group(3)] = torch.from_numpy(data.copy()).float()
    parts = []
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"} or pair["a"].dim() != 2:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} lacks lora_a or lora_b")
        rank = pair["a"].shape[0]
        parts.append(LoraPart(layer, module, pair["a"], pair["b"],
                              scaling(float(alpha), rank, use_rslora=False)))
    digest.update(str(alpha).encode())
    return fuse_parts(name, parts, arch, max_rank, int.from_bytes(digest.digest()[:16], "little"),
                      half_split=field("general.architecture") not in GGUF_INTERLEAVED_QK)
