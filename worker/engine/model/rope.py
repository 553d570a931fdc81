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

# rope_type -> the keys it reads (beyond rope_type / type / rope_theta)
_HF_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
}
_HF_COMMON = frozenset({"rope_type", "type", "rope_theta"})
# `<arch>.rope.*` GGUF keys this module reads; `scaling.original_context_length` and
# `scaling.finetuned` describe the training, not the rotation.
_GGUF_KEYS = frozenset({"freq_base", "freq_base_swa", "dimension_count", "scaling.type",
                        "scaling.factor", "scaling.original_context_length",
                        "scaling.finetuned"})


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3
    # GGUF `rope_freqs.weight`: each frequency is divided by its factor (Llama 3 from GGUF)
    freq_factors: tuple[float, ...] | None = None

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim / 2] float32, computed as transformers computes it."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
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
    def from_hf(cls, params: dict[str, Any], where: str) -> RopeConfig:
        """One RoPE dict (`rope_parameters`, or `rope_scaling` with `rope_theta` merged in);
        `where` names it in errors."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _HF_KEYS:
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {where}; "
                             f"supported: {sorted(_HF_KEYS)}")
        unknown = set(params) - _HF_COMMON - _HF_KEYS[rope_type]
        if unknown:
            raise ValueError(f"unsupported RoPE parameter(s) {sorted(unknown)} for rope_type "
                             f"{rope_type!r} in {where}")
        theta = float(params.get("rope_theta", 10000.0))
        if rope_type == "default":
            return cls(theta=theta)
        if "factor" not in params:
            raise ValueError(f"{where}: rope_type {rope_type!r} needs a factor")
        if rope_type == "linear":
            return cls(theta=theta, scaling="linear", factor=float(params["factor"]))
        missing = _HF_KEYS["llama3"] - set(params)
        if missing:
            raise ValueError(f"{where}: rope_type 'llama3' lacks {sorted(missing)}")
        return cls(theta=theta, scaling="llama3", factor=float(params["factor"]),
                   low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(
                       params["original_max_position_embeddings"]))


def hf_rope(config: dict[str, Any], layer_types: tuple[str, ...]
            ) -> dict[str, RopeConfig]:
    """config.json -> a RopeConfig per layer type ("full_attention", "sliding_attention").

    transformers 5: `rope_parameters` (one dict, or one per layer type, as Gemma 3 writes).
    transformers 4: top-level `rope_theta` + `rope_scaling` (+ Gemma 3's
    `rope_local_base_freq` for its sliding layers)."""
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial RoPE (partial_rotary_factor "
                         f"{config['partial_rotary_factor']})")
    params = config.get("rope_parameters")
    if params:
        if set(params) <= {"full_attention", "sliding_attention"}:
            missing = set(layer_types) - set(params)
            if missing:
                raise ValueError(f"rope_parameters lacks {sorted(missing)}")
            return {t: RopeConfig.from_hf(p, f"rope_parameters.{t}") for t, p in params.items()}
        if config.get("rope_scaling") not in (None, {}, params):
            raise ValueError("config.json has both rope_parameters and a different "
                             "rope_scaling: which one the model was trained with is unclear")
        full = RopeConfig.from_hf(
            {"rope_theta": config.get("rope_theta", 10000.0), **params}, "rope_parameters")
        return dict.fromkeys(layer_types, full)
    legacy = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
    full = RopeConfig.from_hf(legacy, "rope_scaling")
    ropes = dict.fromkeys(layer_types, full)
    if "sliding_attention" in ropes and "rope_local_base_freq" in config:
        ropes["sliding_attention"] = RopeConfig(theta=float(config["rope_local_base_freq"]))
    return ropes


def gguf_rope(values: dict[str, Any], freq_factors: tuple[float, ...] | None, arch: str
              ) -> dict[str, RopeConfig]:
    """The `<arch>.rope.*` keys (without the prefix) and `rope_freqs.weight` -> a RopeConfig
    per layer type."""
    unknown = set(values) - _GGUF_KEYS
    if unknown:
        raise ValueError(f"unsupported GGUF RoPE key(s) "
                         f"{sorted(f'{arch}.rope.{k}' for k in unknown)}")
    theta = float(values.get("freq_base", 10000.0))
    scaling = values.get("scaling.type", "none")
    if scaling == "none":
        full = RopeConfig(theta=theta, freq_factors=freq_factors)
    elif scaling == "linear" and freq_factors is None:
        full = RopeConfig(theta=theta, scaling="linear",
                          factor=float(values.get("scaling.factor", 1.0)))
    else:
        raise ValueError(f"unsupported GGUF RoPE scaling type {scaling!r}"
                         + (" with rope_freqs.weight" if freq_factors is not None else ""))
    local = RopeConfig(theta=float(values.get("freq_base_swa", theta)))
    return {"full_attention": full, "sliding_attention": local}


class Rotary:
    """RoPE on interleaved pairs (dims 2i, 2i+1) as a complex multiply, in place."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        self.inv_freq = rope.inv_freq(head_dim)  # [head_dim / 2] float32
        self._cos = self._sin = torch.empty(0, head_dim // 2)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [>= num_positions, head_dim / 2] float32 for the fused kernels; grown
        by doubling, computed exactly as `freqs` computes them per step."""
        if self._cos.shape[0] < num_positions:
            n = max(num_positions, 2 * self._cos.shape[0], 256)
            angles = torch.arange(n).float()[:, None] * self.inv_freq[None, :]  # [n, hd / 2]
            self._cos, self._sin = angles.cos(), angles.sin()
        return self._cos, self._sin

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens] -> e^(i * pos * inv_freq) [num_tokens, 1, head_dim / 2]
        complex64 (broadcast over heads)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, hd / 2]
        return torch.polar(torch.ones_like(angles), angles)[:, None, :]

    @staticmethod
    def apply_(x: torch.Tensor, freqs: torch.Tensor) -> None:
        """Rotate x [num_tokens, heads, head_dim] float32 in place (x may be a strided view)."""
        num_tokens, heads, head_dim = x.shape
        pairs = torch.view_as_complex(x.view(num_tokens, heads, head_dim // 2, 2))
        pairs.mul_(freqs)  # [num_tokens, heads, head_dim / 2] complex64
