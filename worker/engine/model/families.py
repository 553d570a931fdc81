"""The model families llmq runs, and what each changes in the shared Llama-style decoder.

References: transformers' `Llama/Mistral/Ministral/Qwen2/Qwen3Config` and their modeling files
(what each family adds to Llama's block), llama.cpp's `convert_hf_to_gguf.py` (which HF
architectures it writes under which GGUF `general.architecture`, and whether it permutes Q/K
rows into interleaved-RoPE order: only its `LlamaModel` does).

A family is data, not code: the decoder (llama.py) reads these flags. Anything a family's
config may switch on that the decoder does not implement is refused in arch.py, by name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool  # default of Q/K/V projection biases (Qwen2 always has them)
    qk_norm: bool  # RMSNorm over each head of Q and K before RoPE (Qwen3)
    # a config's `sliding_window` applies to every layer (Mistral) rather than only to the
    # layers `layer_types` names (Ministral, Qwen2/3 with use_sliding_window)
    window_on_all_layers: bool = False


FAMILIES = {
    "llama": Family("llama", qkv_bias=False, qk_norm=False),
    "mistral": Family("mistral", qkv_bias=False, qk_norm=False, window_on_all_layers=True),
    "ministral": Family("ministral", qkv_bias=False, qk_norm=False),
    "qwen2": Family("qwen2", qkv_bias=True, qk_norm=False),
    "qwen3": Family("qwen3", qkv_bias=False, qk_norm=True),
}

# GGUF `general.architecture` -> family. llama.cpp writes Mistral and Ministral as `llama`.
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted into interleaved order.
GGUF_INTERLEAVED_QK = frozenset({"llama"})


def family(name: object, label: str = "model architecture", where: str = "") -> Family:
    """The family called `name`; else a ValueError: `unsupported <label> <name><where>`."""
    if name not in FAMILIES:
        raise ValueError(f"unsupported {label} {name!r}{where}; supported: {sorted(FAMILIES)}")
    return FAMILIES[str(name)]
