"""ModelArchConfig: the shape of a Llama-style decoder, read from GGUF metadata or config.json.

References: Hugging Face `LlamaConfig` / `Qwen2Config` / `Qwen3Config` / `MistralConfig` (field
meanings; transformers 5's `layer_types`), llama.cpp's
`convert_hf_to_gguf.py` and gguf-py's `constants.Keys` (the `<arch>.*` metadata keys).
Only what the model in `llama.py` can run is accepted; anything else fails here, at load,
with a ValueError that names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gguf

from .families import GGUF_FAMILIES, Family, family
from .pooling import DEFAULT_POOLING, check_pooling, gguf_pooling
from .rope import RopeConfig, gguf_rope, hf_rope

logger = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"

@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # a family of families.py
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int  # the context length the model was trained for
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2-style bias on the Q, K and V projections
    rope: RopeConfig = RopeConfig()  # of the full-attention layers
    rope_local: RopeConfig | None = None  # of the sliding layers, when it differs (Gemma 3)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of Q and K, before RoPE
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    embedding_multiplier: float | None = None  # granite: embeddings times this
    residual_multiplier: float | None = None  # granite: attention/MLP outputs times this
    logits_scaling: float | None = None  # granite: logits divided by this
    # mixture of experts (moe.py): 0 experts means a dense MLP in every layer
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in an MoE model
    pooling: str = DEFAULT_POOLING  # of /v1/embeddings: mean | last | cls (pooling.py)

    def __post_init__(self) -> None:
        family(self.architecture)
        check_pooling(self.pooling, "pooling")
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
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if self.sliding_window and self.sliding_window >= self.max_position_embeddings:
            # NOTE: a window as long as the context never slides (Phi-3.5's 262144): full
            # attention, which keeps the compiled decode-attention kernel
            object.__setattr__(self, "sliding_window", None)
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"unsupported layer type(s) {sorted(unknown)} in layer_types")
        if self.num_experts and not 0 < self.experts_per_tok <= self.num_experts:
            raise ValueError(f"experts_per_tok must be in 1..{self.num_experts}, "
                             f"got {self.experts_per_tok}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but no sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def family(self) -> Family:
        return family(self.architecture)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def cache_window(self) -> int | None:
        """The window every layer slides with, when all do: then a sequence's KV blocks that
        fell out of it can be freed (a full-attention layer still needs them)."""
        return self.sliding_window if set(self.layer_types) == {SLIDING} else None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == SLIDING and self.rope_local is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelArchConfig:
        """Read `general.architecture` and the `<arch>.*` keys llama.cpp writes."""
        arch = _gguf_value(reader, "general.architecture")
        if arch not in GGUF_FAMILIES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_FAMILIES)}")
        fam = family(GGUF_FAMILIES[arch])
        num_experts = int(_gguf_value(reader, f"{arch}.expert_count", 0))
        if arch == "llama" and num_experts:
            fam = family("mixtral")  # llama.cpp writes Mixtral as llama with experts
        _refuse_gguf_features(reader, arch)

        def key(name: str, default: Any = None) -> Any:
            value = _gguf_value(reader, f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        tensor_names = {t.name for t in reader.tensors}
        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        # NOTE: the embedding's rows, not the token list: some files pad the embedding, and
        # the model's logits are as wide as its head.
        vocab = _embedding_rows(reader)
        head_dim = int(_gguf_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
        prefix = f"{arch}.rope."
        rope_keys = {name[len(prefix):]: field.contents() for name, field
                     in reader.fields.items() if name.startswith(prefix)}
        if fam.local_rope_base is not None:  # older Gemma 3 GGUFs lack rope.freq_base_swa
            rope_keys.setdefault("freq_base_swa", fam.local_rope_base)
        ropes = gguf_rope(rope_keys, _rope_tensors(reader), arch, head_dim)
        window = _gguf_value(reader, f"{arch}.attention.sliding_window")
        num_layers = int(key("block_count"))
        attn_softcap = _gguf_value(reader, f"{arch}.attn_logit_softcapping")
        final_softcap = _gguf_value(reader, f"{arch}.final_logit_softcapping")
        scale = _gguf_value(reader, f"{arch}.attention.scale")
        if scale is None and fam.large_size_layers == num_layers:
            # NOTE: Gemma GGUFs carry no query_pre_attn_scalar: llama.cpp scales by head_dim
            # ** -0.5, but by (hidden / heads) ** -0.5 for the 27B models, which it knows by
            # their layer count (llama-model.cpp, LLM_TYPE_27B); so does this.
            scale = (hidden / num_heads) ** -0.5
        granite = {name: _gguf_value(reader, f"{arch}.{name}")
                   for name in ("embedding_scale", "residual_scale", "logit_scale")}
        return cls(
            architecture=fam.name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope=ropes[FULL],
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_local=ropes[SLIDING] if fam.swa_pattern else None,
            sliding_window=int(window) if window else None,
            layer_types=_gguf_layer_types(reader, arch, fam, num_layers, window),
            attn_scale=float(scale) if scale else None,
            attn_softcap=float(attn_softcap) if attn_softcap else None,
            final_softcap=float(final_softcap) if final_softcap else None,
            embedding_multiplier=_positive(granite["embedding_scale"]),
            residual_multiplier=_positive(granite["residual_scale"]),
            logits_scaling=_positive(granite["logit_scale"]),
            num_experts=num_experts,
            experts_per_tok=int(_gguf_value(reader, f"{arch}.expert_used_count", 0)),
            moe_intermediate_size=int(_gguf_value(
                reader, f"{arch}.expert_feed_forward_length", key("feed_forward_length")))
            if num_experts else 0,
            norm_topk_prob=bool(_gguf_value(reader, f"{arch}.expert_weights_norm",
                                            fam.norm_topk_prob)),
            dense_layers=tuple(i for i in range(num_layers) if num_experts
                               and f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
            pooling=gguf_pooling(_gguf_value(reader, f"{arch}.pooling_type"), arch),
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any],
                       pooling: str = DEFAULT_POOLING) -> ModelArchConfig:
        """Read a Hugging Face config.json (already parsed); `pooling` is the folder's
        (pooling.hf_pooling: config.json does not say)."""
        fam = family(config.get("model_type"), "model_type", " in config.json")
        _refuse_hf_features(config, fam)
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        window = config.get("sliding_window")
        if "layer_types" in config and not fam.window_on_all_layers:
            layer_types = tuple(config["layer_types"])
        elif config.get("use_sliding_window"):  # transformers 4 Qwen2: from max_window_layers
            first = int(config.get("max_window_layers", num_layers))
            layer_types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
        elif fam.window_on_all_layers or fam.swa_pattern:  # transformers 4 Mistral, Gemma
            layer_types = fam.layer_types(num_layers, window,
                                          config.get("sliding_window_pattern"))
        else:
            layer_types = (FULL,) * num_layers
        if "use_sliding_window" in config and not config["use_sliding_window"]:
            layer_types = (FULL,) * num_layers  # Qwen: the window is off whatever else is set
        ropes = hf_rope(config, tuple(sorted(set(layer_types))))
        return cls(
            architecture=fam.name,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # NOTE: Qwen2 always has the QKV bias; the others only when `attention_bias` says so.
            attention_bias=bool(config.get("attention_bias", fam.qkv_bias)),
            rope=ropes.get(FULL, ropes.get(SLIDING, RopeConfig())),
            rope_local=ropes.get(SLIDING),
            qk_norm=fam.qk_norm,
            sliding_window=int(window) if window and SLIDING in layer_types else None,
            layer_types=layer_types,
            attn_scale=(float(config["query_pre_attn_scalar"]) ** -0.5
                        if config.get("query_pre_attn_scalar")
                        else _positive(config.get("attention_multiplier"))),
            attn_softcap=_positive(config.get("attn_logit_softcapping")),
            final_softcap=_positive(config.get("final_logit_softcapping")),
            embedding_multiplier=_positive(config.get("embedding_multiplier")),
            residual_multiplier=_positive(config.get("residual_multiplier")),
            logits_scaling=_positive(config.get("logits_scaling")),
            **_hf_experts(config, fam, num_layers),
            pooling=pooling,
        )


# activation names in config.json -> the MLP a family runs
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _refuse_hf_features(config: dict[str, Any], fam: Family) -> None:
    """config.json switches that change the computation and the decoder does not have."""
    for key in ("hidden_activation", "hidden_act"):
        if key in config and _ACTIVATIONS.get(config[key]) != fam.mlp_act:
            raise ValueError(f"unsupported {key} {config[key]!r} for {fam.name} "
                             f"(its MLP runs {fam.mlp_act})")
        if key in config:
            break  # Gemma: hidden_activation wins over a stale hidden_act
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias: true (the MLP projections have no bias)")
    if config.get("clip_qkv"):
        raise ValueError(f"unsupported clip_qkv ({config['clip_qkv']})")
    if config.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention: true (decoders are causal)")


def _hf_experts(config: dict[str, Any], fam: Family, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (none for a dense model)."""
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    if config.get("shared_expert_intermediate_size") or config.get("n_shared_experts"):
        raise ValueError("unsupported shared experts (shared_expert_intermediate_size)")
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return {
        "num_experts": num_experts,
        "experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config.get("moe_intermediate_size")
                                     or config["intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", fam.norm_topk_prob)),
        "dense_layers": tuple(i for i in range(num_layers)
                              if i in dense_only or (i + 1) % step),
    }


def _refuse_gguf_features(reader: gguf.GGUFReader, arch: str) -> None:
    """GGUF keys of features the decoder does not have."""
    if _gguf_value(reader, f"{arch}.expert_shared_count", 0):
        raise ValueError(f"unsupported shared experts ({arch}.expert_shared_count)")
    gating = _gguf_value(reader, f"{arch}.expert_gating_func")
    if gating not in (None, int(gguf.ExpertGatingFuncType.SOFTMAX)):
        raise ValueError(f"unsupported expert gating function {gating} "
                         f"({arch}.expert_gating_func; softmax is supported)")


def _gguf_layer_types(reader: gguf.GGUFReader, arch: str, fam: Family, num_layers: int,
                      window: Any) -> tuple[str, ...]:
    """Which layers slide: llama.cpp's `attention.sliding_window_pattern`, a bool per layer
    (Ministral's full layers among sliding ones) or a period, else the family's rule."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = _gguf_value(reader, key)
    if not isinstance(pattern, list):
        return fam.layer_types(num_layers, window, int(pattern) if pattern else None)
    if len(pattern) != num_layers:
        raise ValueError(f"{key} has {len(pattern)} entries for {num_layers} layers")
    if not window:
        return (FULL,) * num_layers
    return tuple(SLIDING if sliding else FULL for sliding in pattern)


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _gguf_value(reader: gguf.GGUFReader, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _embedding_rows(reader: gguf.GGUFReader) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dims innermost first: [hidden, vocab]
    raise ValueError("GGUF file has no token_embd.weight")


ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def _rope_tensors(reader: gguf.GGUFReader) -> dict[str, tuple[float, ...]]:
    """Per-frequency RoPE divisors: Llama 3.1+'s `rope_freqs.weight`, Phi-3.5's longrope
    `rope_factors_long/short.weight`; by name without `.weight`."""
    return {tensor.name.removesuffix(".weight"): tuple(
                float(f) for f in gguf.quants.dequantize(tensor.data, tensor.tensor_type).ravel())
            for tensor in reader.tensors
            if tensor.name.removesuffix(".weight") in ROPE_TENSORS}
