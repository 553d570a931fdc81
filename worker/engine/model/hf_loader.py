"""Hugging Face folder weights (config.json + *.safetensors) -> named tensors.

References: transformers' safetensors checkpoints (`model.safetensors` or sharded
`model-0000x-of-0000y.safetensors` with an index), vLLM `model_loader/weight_utils.py`.
Q and K rows (and biases) are permuted from HF's half-split order into the interleaved-RoPE
order the model uses (see gguf_loader.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .arch import ModelArchConfig
from .gguf_loader import split_fused, to_interleaved
from .pooling import hf_pooling

logger = logging.getLogger(__name__)

# Mixtral's checkpoint names -> the Qwen3-MoE/OLMoE ones the model loads.
_MIXTRAL_PARTS = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(re.escape(k) for k in _MIXTRAL_PARTS))
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_arch(path: str | Path) -> ModelArchConfig:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder: no config.json")
    return ModelArchConfig.from_hf_config(json.loads(config_path.read_text()),
                                          pooling=hf_pooling(path))


def iter_hf_weights(path: str | Path, arch: ModelArchConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file of the folder, in file order."""
    norm_offset = arch.family.norm_offset
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tensor = f.get_tensor(name)
                name = _MIXTRAL_NAMES.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], name)
                if norm_offset and name.endswith("norm.weight"):
                    tensor = tensor.float() + 1  # Gemma scales by 1 + w, as GGUF stores it
                for part_name, part in split_fused(name, tensor, arch):
                    yield part_name, to_interleaved(part_name, part, arch)
