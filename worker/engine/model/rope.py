"""RoPE: its parameters read from either config.json generation or GGUF, and the rotation.

References: transformers `modeling_rope_utils.py` (`_compute_default_rope_parameters`,
`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`; transformers 5 writes
`rope_parameters` with `rope_theta` and `rope_type` inside, transformers 4 a top-level
`rope_theta` and a `rope_scaling` dict), llama.cpp's `convert_hf_to_gguf.py` (Llama 3's scaling
baked into `rope_freqs.weight` as one divisor per frequency; the `<arch>.rope.*` keys) and
Meta's `llama/model.py` (RoPE as a complex multiply on interleaved pairs).

Every key is read or refused: a RoPE parameter this module does not apply changes the
model's output at some positions, so running without it would be silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# rope_type -> the keys it reads (beyond _HF_COMMON)
_HF_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    # Phi-3.5 / Phi-4-mini; `su` is its older name
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
}
_HF_ALIASES = {"su": "longrope"}
_HF_COMMON = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# `<arch>.rope.*` GGUF keys this module reads; `scaling.original_context_length` (but for
# longrope) and `scaling.finetuned` describe the training, not the rotation.
_GGUF_KEYS = frozenset({"freq_base", "freq_base_swa", "dimension_count", "scaling.type",
                        "scaling.factor", "scaling.original_context_length",
                        "scaling.finetuned", "scaling.attn_factor"})


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3
    # GGUF `rope_freqs.weight`: each frequency is divided by its factor (Llama 3 from GGUF)
    freq_factors: tuple[float, ...] | None = None
    partial: float = 1.0  # the fraction of each head's dimensions rotated (Phi-4-mini: 0.75)
    # longrope: per-frequency divisors, `long_factor` for sequences past
    # original_max_position_embeddings (transformers decides by the sequence's length)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0  # longrope: cos and sin are scaled by it

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial)

    def inv_freq(self, head_dim: int, long: bool = False) -> torch.Tensor:
        """[rotary_dim / 2] float32, computed as transformers computes it."""
        dim = self.rotary_dim(head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if self.short_factor is not None and self.long_factor is not None:
            factors = self.long_factor if long else self.short_factor
            if len(factors) != dim // 2:
                raise ValueError(f"longrope has {len(factors)} factors, rotary dim {dim} "
                                 f"needs {dim // 2}")
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta ** exponents)
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.freq_factors is not None:
            if len(self.freq_factors) != head_dim // 2:
                raise ValueError(f"rope_freqs.weight has {len(self.freq_factors)} factors, "
                                 f"head_dim {head_dim} needs {head_dim // 2}")
            return inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.scaling == "linear":
            return inv_freq / self.factor
        if self.scaling == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # transformers' _compute_llama3_parameters, op for op (same float32 rounding)
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((old_context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    @classmethod
    def from_hf(cls, params: dict[str, Any], where: str, config: dict[str, Any] | None = None
                ) -> RopeConfig:
        """One RoPE dict (`rope_parameters`, or `rope_scaling` with `rope_theta` merged in);
        `where` names it in errors; `config` is the whole config.json (longrope and partial
        RoPE read top-level keys there too)."""
        config = config or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = _HF_ALIASES.get(rope_type, rope_type)
        if rope_type not in _HF_KEYS:
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {where}; "
                             f"supported: {sorted(_HF_KEYS)}")
        unknown = set(params) - _HF_COMMON - _HF_KEYS[rope_type]
        if unknown:
            raise ValueError(f"unsupported RoPE parameter(s) {sorted(unknown)} for rope_type "
                             f"{rope_type!r} in {where}")
        theta = float(params.get("rope_theta", 10000.0))
        partial = float(params.get("partial_rotary_factor",
                                   config.get("partial_rotary_factor", 1.0)))
        if rope_type == "default":
            return cls(theta=theta, partial=partial)
        if rope_type == "longrope":
            return cls._longrope(params, theta, partial, where, config)
        if "factor" not in params:
            raise ValueError(f"{where}: rope_type {rope_type!r} needs a factor")
        if rope_type == "linear":
            return cls(theta=theta, scaling="linear", factor=float(params["factor"]),
                       partial=partial)
        missing = _HF_KEYS["llama3"] - set(params)
        if missing:
            raise ValueError(f"{where}: rope_type 'llama3' lacks {sorted(missing)}")
        return cls(theta=theta, scaling="llama3", factor=float(params["factor"]),
                   low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(
                       params["original_max_position_embeddings"]), partial=partial)

    @classmethod
    def _longrope(cls, params: dict[str, Any], theta: float, partial: float, where: str,
                  config: dict[str, Any]) -> RopeConfig:
        # transformers' _compute_longrope_parameters
        original = params.get("original_max_position_embeddings",
                              config.get("original_max_position_embeddings"))
        if original is None or "short_factor" not in params or "long_factor" not in params:
            raise ValueError(f"{where}: longrope needs short_factor, long_factor and "
                             "original_max_position_embeddings")
        factor = params.get("factor") or config.get("max_position_embeddings", original) / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = (1.0 if factor <= 1.0
                                else math.sqrt(1 + math.log(factor) / math.log(original)))
        return cls(theta=theta, scaling="longrope", partial=partial,
                   original_max_position_embeddings=int(original),
                   short_factor=tuple(float(f) for f in params["short_factor"]),
                   long_factor=tuple(float(f) for f in params["long_factor"]),
                   attention_factor=float(attention_factor))


def hf_rope(config: dict[str, Any], layer_types: tuple[str, ...]
            ) -> dict[str, RopeConfig]:
    """config.json -> a RopeConfig per layer type ("full_attention", "sliding_attention").

    transformers 5: `rope_parameters` (one dict, or one per layer type, as Gemma 3 writes).
    transformers 4: top-level `rope_theta` + `rope_scaling` (+ Gemma 3's
    `rope_local_base_freq` for its sliding layers)."""
    params = config.get("rope_parameters")
    if params:
        if set(params) <= {"full_attention", "sliding_attention"}:
            missing = set(layer_types) - set(params)
            if missing:
                raise ValueError(f"rope_parameters lacks {sorted(missing)}")
            return {t: RopeConfig.from_hf(p, f"rope_parameters.{t}", config)
                    for t, p in params.items()}
        if config.get("rope_scaling") not in (None, {}, params):
            raise ValueError("config.json has both rope_parameters and a different "
                             "rope_scaling: which one the model was trained with is unclear")
        full = RopeConfig.from_hf(
            {"rope_theta": config.get("rope_theta", 10000.0), **params}, "rope_parameters",
            config)
        return dict.fromkeys(layer_types, full)
    legacy = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
    full = RopeConfig.from_hf(legacy, "rope_scaling", config)
    ropes = dict.fromkeys(layer_types, full)
    if "sliding_attention" in ropes and "rope_local_base_freq" in config:
        ropes["sliding_attention"] = RopeConfig(theta=float(config["rope_local_base_freq"]))
    return ropes


def gguf_rope(values: dict[str, Any], tensors: dict[str, tuple[float, ...]], arch: str,
              head_dim: int) -> dict[str, RopeConfig]:
    """The `<arch>.rope.*` keys (without the prefix) and the RoPE tensors (`rope_freqs`,
    `rope_factors_long` / `_short`, by name without `.weight`) -> a RopeConfig per layer
    type."""
    unknown = set(values) - _GGUF_KEYS
    if unknown:
        raise ValueError(f"unsupported GGUF RoPE key(s) "
                         f"{sorted(f'{arch}.rope.{k}' for k in unknown)}")
    theta = float(values.get("freq_base", 10000.0))
    partial = int(values.get("dimension_count", head_dim)) / head_dim
    scaling = values.get("scaling.type", "none")
    freq_factors = tensors.get("rope_freqs")
    if "rope_factors_long" in tensors:  # Phi-3.5 / Phi-4-mini: longrope, however typed
        if "scaling.original_context_length" not in values:
            raise ValueError(f"GGUF longrope factors without "
                             f"{arch}.rope.scaling.original_context_length")
        full = RopeConfig(theta=theta, scaling="longrope", partial=partial,
                          original_max_position_embeddings=int(
                              values["scaling.original_context_length"]),
                          short_factor=tensors["rope_factors_short"],
                          long_factor=tensors["rope_factors_long"],
                          attention_factor=float(values.get("scaling.attn_factor", 1.0)))
    elif scaling == "none":
        full = RopeConfig(theta=theta, freq_factors=freq_factors, partial=partial)
    elif scaling == "linear" and freq_factors is None:
        full = RopeConfig(theta=theta, scaling="linear", partial=partial,
                          factor=float(values.get("scaling.factor", 1.0)))
    else:
        raise ValueError(f"unsupported GGUF RoPE scaling type {scaling!r}"
                         + (" with rope_freqs.weight" if freq_factors is not None else ""))
    local = RopeConfig(theta=float(values.get("freq_base_swa", theta)), partial=partial)
    return {"full_attention": full, "sliding_attention": local}


class Rotary:
    """RoPE on interleaved pairs (dims 2i, 2i+1) as a complex multiply, in place."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        self.inv_freq = rope.inv_freq(head_dim)  # [rotary_dim / 2] float32
        self.inv_freq_long = (rope.inv_freq(head_dim, long=True)
                              if rope.long_factor is not None else None)
        self.long_after = rope.original_max_position_embeddings
        self.attention_factor = rope.attention_factor
        # NOTE: what the fused kernels' RoPE does: every dimension, one table, unscaled
        self.plain = (rope.rotary_dim(head_dim) == head_dim and self.inv_freq_long is None
                      and self.attention_factor == 1.0)
        self._cos = self._sin = torch.empty(0, head_dim // 2)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= num_positions, head_dim / 2] float32 for the fused kernels; grown
        by doubling, computed exactly as `freqs` computes them per step."""
        if self._cos.shape[0] < num_positions:
            n = max(num_positions, 2 * self._cos.shape[0], 256)
            angles = torch.arange(n).float()[:, None] * self.inv_freq[None, :]  # [n, hd / 2]
            self._cos, self._sin = angles.cos(), angles.sin()
        return self._cos, self._sin

    def freqs(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
              ) -> torch.Tensor:
        """positions [num_tokens] -> attention_factor * e^(i * pos * inv_freq) [num_tokens, 1,
        rotary_dim / 2] complex64 (broadcast over heads). With longrope, `seq_lens`
        [num_tokens] (each token's sequence length this step) picks the long factors for
        tokens of sequences past original_max_position_embeddings, as transformers does."""
        pos = positions.float()[:, None]
        angles = pos * self.inv_freq[None, :]  # [num_tokens, rotary_dim / 2]
        if self.inv_freq_long is not None and seq_lens is not None:
            long = (seq_lens > self.long_after)[:, None]  # [num_tokens, 1]
            angles = torch.where(long, pos * self.inv_freq_long[None, :], angles)
        magnitude = torch.full_like(angles, self.attention_factor)
        return torch.polar(magnitude, angles)[:, None, :]

    @staticmethod
    def apply_(x: torch.Tensor, freqs: torch.Tensor) -> None:
        """Rotate x [num_tokens, heads, head_dim] float32 in place (x may be a strided view);
        with partial RoPE only its first 2 * freqs.shape[-1] dimensions."""
        num_tokens, heads, _ = x.shape
        rotary_dim = 2 * freqs.shape[-1]
        pairs = torch.view_as_complex(x[..., :rotary_dim].view(
            num_tokens, heads, rotary_dim // 2, 2))
        pairs.mul_(freqs)  # [num_tokens, heads, rotary_dim / 2] complex64
