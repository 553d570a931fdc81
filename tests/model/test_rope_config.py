"""RoPE parameters: both config.json generations and GGUF keys are read, anything else refused.

The silent failure this guards against: transformers 5 writes `rope_parameters` (with
`rope_theta` and `rope_type` inside) instead of top-level `rope_theta` / `rope_scaling`; a loader
reading only the old keys runs a Llama 3.2 with theta 10000 and no scaling, without a word.
"""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.model.arch import ModelArchConfig
from llmq.worker.engine.model.rope import gguf_rope

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
BASE = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 131072}


def test_transformers_5_rope_parameters_give_transformers_own_frequencies():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Given a Llama 3.2-style config.json as transformers 5 writes it
    arch = ModelArchConfig.from_hf_config({**BASE, "rope_parameters": LLAMA3})
    # Then llmq's inverse frequencies are transformers' own, not theta 10000 unscaled
    config = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"},
                                      rope_parameters=LLAMA3)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert arch.rope.theta == 500000.0 and arch.rope.scaling == "llama3"
    torch.testing.assert_close(arch.rope.inv_freq(arch.head_dim), expected, rtol=0, atol=0)


def test_transformers_4_rope_theta_and_rope_scaling_read_the_same():
    legacy = {**BASE, "rope_theta": 500000.0,
              "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}
    assert (ModelArchConfig.from_hf_config(legacy).rope
            == ModelArchConfig.from_hf_config({**BASE, "rope_parameters": LLAMA3}).rope)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "mrope"])
def test_a_rope_type_llmq_does_not_apply_is_refused_by_name(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    for config in ({**BASE, "rope_parameters": params}, {**BASE, "rope_scaling": params}):
        with pytest.raises(ValueError, match=f"unsupported RoPE type '{rope_type}'"):
            ModelArchConfig.from_hf_config(config)


def test_a_rope_key_llmq_does_not_read_is_refused_by_name():
    config = {**BASE, "rope_parameters": {**LLAMA3, "mscale": 1.2}}
    with pytest.raises(ValueError, match=r"unsupported RoPE parameter\(s\) \['mscale'\]"):
        ModelArchConfig.from_hf_config(config)


def test_an_unknown_gguf_rope_key_or_scaling_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"llama\.rope\.scaling\.yarn_log_multiplier"):
        gguf_rope({"freq_base": 1e6, "scaling.yarn_log_multiplier": 0.1}, {}, "llama", 64)
    with pytest.raises(ValueError, match="unsupported GGUF RoPE scaling type 'yarn'"):
        gguf_rope({"freq_base": 1e6, "scaling.type": "yarn"}, {}, "llama", 64)


def test_gguf_rope_freqs_divide_the_frequencies():
    # Given Llama 3.1+ GGUF factors (llama.cpp's convert_hf_to_gguf writes one per frequency)
    factors = tuple(float(f) for f in range(1, 33))
    rope = gguf_rope({"freq_base": 500000.0}, {"rope_freqs": factors}, "llama", 64)
    plain = gguf_rope({"freq_base": 500000.0}, {}, "llama", 64)
    ratio = plain["full_attention"].inv_freq(64) / rope["full_attention"].inv_freq(64)
    torch.testing.assert_close(ratio, torch.tensor(factors))


def test_an_unsupported_feature_in_config_json_is_refused_by_name():
    for extra, message in [({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
                           ({"mlp_bias": True}, "unsupported mlp_bias"),
                           ({"model_type": "olmoe", "clip_qkv": 8.0}, "unsupported clip_qkv"),
                           ({"model_type": "qwen2_moe", "num_experts": 4},
                            "unsupported model_type 'qwen2_moe'")]:
        with pytest.raises(ValueError, match=message):
            ModelArchConfig.from_hf_config({**BASE, **extra})
