"""ModelArchConfig: the shape of a Llama-family decoder, read from GGUF metadata or config.json.

References: Hugging Face `LlamaConfig` / `Qwen2Config` (field meanings), llama.cpp's
`convert_hf_to_gguf.py` and gguf-py's `constants.Keys` (the `<arch>.*` metadata keys).
Only what the model in `llama.py` can run is accepted; anything else fails here, at load,
with a ValueError that names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gguf

logger = logging.getLogger(__name__)

# GGUF `general.architecture` / HF `model_type` -> whether Q and K carry a bias.
SUPPORTED_ARCHITECTURES = {"llama": False, "qwen2": True}


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int  # the context length the model was trained for
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2-style bias on the Q, K and V projections

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelArchConfig:
        """Read `general.architecture` and the `<arch>.*` keys llama.cpp writes."""
        arch = _gguf_value(reader, "general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            value = _gguf_value(reader, f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        tensor_names = {t.name for t in reader.tensors}
        _reject_gguf_rope_scaling(reader, arch, tensor_names)
        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        # NOTE: the embedding's rows, not the token list: some files pad the embedding, and
        # the model's logits are as wide as its head.
        vocab = _embedding_rows(reader)
        head_dim = int(_gguf_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
        rope_dim = _gguf_value(reader, f"{arch}.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise ValueError(
                f"partial RoPE (rope.dimension_count {rope_dim} != head_dim {head_dim}) "
                "is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        """Read a Hugging Face config.json (already parsed)."""
        arch = config.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r} in config.json; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if config.get("use_sliding_window"):
            raise ValueError("unsupported sliding-window attention (use_sliding_window: true)")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}")
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # NOTE: Qwen2 always has the QKV bias; Llama only when `attention_bias` says so.
            attention_bias=bool(config.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
        )


def _gguf_value(reader: gguf.GGUFReader, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _embedding_rows(reader: gguf.GGUFReader) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dims innermost first: [hidden, vocab]
    raise ValueError("GGUF file has no token_embd.weight")


def _reject_gguf_rope_scaling(reader: gguf.GGUFReader, arch: str, tensor_names: set[str]) -> None:
    # NOTE: Llama 3.1+ stores per-frequency factors in `rope_freqs.weight`; running such a
    # model without them is silently wrong past the original context, so refuse it instead.
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("unsupported RoPE scaling: the GGUF holds rope_freqs.weight (Llama 3.1+)")
    scaling = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"unsupported RoPE scaling type {scaling!r}")
