"""The model families llmq runs, and what each changes in the shared Llama-style decoder.

References: transformers' Llama, Mistral, Ministral, Qwen2, Qwen3, Gemma2 and Gemma3Text configs
and modeling files (what each family adds to Llama's block), llama.cpp's
`convert_hf_to_gguf.py` (which HF architectures it writes under which GGUF
`general.architecture`, and whether it permutes Q/K rows into interleaved-RoPE order: only its
`LlamaModel` does) and llama.cpp's `llama-model.cpp` (its sliding-window layer patterns).

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
    qk_norm_full: bool = False  # OLMoE: the Q/K norm is over all heads at once
    # a config's `sliding_window` applies to every layer (Mistral) rather than only to the
    # layers `layer_types` names (Ministral, Qwen2/3 with use_sliding_window)
    window_on_all_layers: bool = False
    mlp_act: str = "silu"  # SwiGLU; Gemma's GeGLU is "gelu_tanh"
    # Gemma: HF stores each RMSNorm weight as w and scales by 1 + w (GGUF stores 1 + w)
    norm_offset: bool = False
    # Gemma 2/3: the attention and MLP outputs are RMSNormed before the residual add
    sandwich_norms: bool = False
    scaled_embedding: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    # Where a file has no layer_types (GGUF, transformers 4 configs), llama.cpp's rule: layer i
    # slides when i % pattern < pattern - 1 (None: every layer slides when a window is set)
    swa_pattern: int | None = None
    # mixture of experts: whether the top-k routing weights are renormalised to sum to 1
    # where the file does not say (llama.cpp's build_moe_ffn `norm_w` per architecture)
    norm_topk_prob: bool = True
    # GGUF defaults llama.cpp hard-codes (llama-model.cpp): the RoPE base of sliding layers
    # when the file has no rope.freq_base_swa, and the layer count of the model size whose
    # scores it scales by (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (Gemma 27B)
    local_rope_base: float | None = None
    large_size_layers: int | None = None

    def layer_types(self, num_layers: int, window: int | None, pattern: int | None = None
                    ) -> tuple[str, ...]:
        """full_attention / sliding_attention per layer, by `swa_pattern` (or `pattern`)."""
        pattern = pattern or self.swa_pattern
        if not window:
            return ("full_attention",) * num_layers
        return tuple("sliding_attention" if pattern is None or i % pattern < pattern - 1
                     else "full_attention" for i in range(num_layers))


FAMILIES = {
    "llama": Family("llama", qkv_bias=False, qk_norm=False),
    "mistral": Family("mistral", qkv_bias=False, qk_norm=False, window_on_all_layers=True),
    "ministral": Family("ministral", qkv_bias=False, qk_norm=False),
    "qwen2": Family("qwen2", qkv_bias=True, qk_norm=False),
    # Phi-3/3.5/4-mini: fused qkv_proj and gate_up_proj (split at load), longrope and
    # partial RoPE (rope.py), a sliding window on every layer where the config sets one
    "phi3": Family("phi3", qkv_bias=False, qk_norm=False, window_on_all_layers=True),
    # Mixture of experts (moe.py): Qwen3-MoE (Qwen3's attention), OLMoE (Q/K norm over all
    # heads, top-k weights not renormalised); Mixtral is `mixtral` in HF, `llama` in GGUF
    "qwen3_moe": Family("qwen3_moe", qkv_bias=False, qk_norm=True),
    "olmoe": Family("olmoe", qkv_bias=False, qk_norm=True, qk_norm_full=True,
                    norm_topk_prob=False),
    "mixtral": Family("mixtral", qkv_bias=False, qk_norm=False, window_on_all_layers=True),
    # granite: Llama's block with four scalar multipliers (arch.py reads them)
    "granite": Family("granite", qkv_bias=False, qk_norm=False),
    "qwen3": Family("qwen3", qkv_bias=False, qk_norm=True),
    "gemma2": Family("gemma2", qkv_bias=False, qk_norm=False, mlp_act="gelu_tanh",
                     norm_offset=True, sandwich_norms=True, scaled_embedding=True,
                     swa_pattern=2, large_size_layers=46),
    "gemma3": Family("gemma3", qkv_bias=False, qk_norm=True, mlp_act="gelu_tanh",
                     norm_offset=True, sandwich_norms=True, scaled_embedding=True,
                     swa_pattern=6, local_rope_base=10000.0, large_size_layers=62),
}
# HF model_type spellings of a family
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}

# GGUF `general.architecture` -> family. llama.cpp writes Mistral and Ministral as `llama`.
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3", "granite": "granite", "phi3": "phi3",
                 "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted into interleaved order.
GGUF_INTERLEAVED_QK = frozenset({"llama", "granite"})


def family(name: object, label: str = "model architecture", where: str = "") -> Family:
    """The family called `name`; else a ValueError: `unsupported <label> <name><where>`."""
    name = HF_MODEL_TYPES.get(str(name), name)
    if name not in FAMILIES:
        raise ValueError(f"unsupported {label} {name!r}{where}; supported: {sorted(FAMILIES)}")
    return FAMILIES[str(name)]
