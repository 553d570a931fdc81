"""Loading models: GGUF files of every supported tensor type, Hugging Face folders, and the
files we refuse, each refused at load with a message naming what is wrong."""

from __future__ import annotations

import dataclasses
import os

import gguf
import pytest
import torch

from llmq.worker.engine.model.loader import load_model
from tests.fixtures.tiny_gguf import write_hf_folder, write_tiny_llama

Q = gguf.GGMLQuantizationType
PROMPT = "The quick brown fox jumps over the lazy dog 12345."


def prompt_logits(loaded, text: str = PROMPT) -> torch.Tensor:
    """[num_tokens, vocab] float32 logits of `text`, one contiguous prefill."""
    model = loaded.model
    ids = torch.tensor(loaded.tokenizer.encode(text))
    hidden = model.forward_contiguous(ids, 0, model.make_contiguous_cache(len(ids)))
    return model.compute_logits(hidden)


def transformers_logits(path, ids: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_the_tiny_gguf_loads_and_runs(tiny_model_path):
    # When the tiny model is loaded and prefills a prompt
    loaded = load_model(tiny_model_path)
    logits = prompt_logits(loaded)

    # Then it is the model that was written, with its tokenizer, and it answers at once
    arch = loaded.arch
    assert (arch.architecture, arch.num_layers, arch.hidden_size) == ("llama", 2, 64)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert loaded.tokenizer.eos_token_id == 2
    assert logits.shape == (len(loaded.tokenizer.encode(PROMPT)), 512)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("architecture", "tied", "weight_type", "hidden"), [
    ("llama", True, Q.Q4_1, 64),
    ("llama", False, Q.Q8_0, 64),
    ("llama", True, Q.Q4_0, 64),
    ("llama", False, Q.Q5_1, 64),
    ("llama", True, Q.F16, 64),
    ("llama", True, Q.BF16, 64),
    ("llama", True, Q.Q4_K, 256),
    ("llama", True, Q.Q6_K, 256),
    ("qwen2", False, Q.Q8_0, 64),
    ("qwen2", True, Q.Q5_0, 64),
])
def test_a_gguf_gives_the_logits_transformers_reads_from_it(
        tmp_path, architecture, tied, weight_type, hidden):
    # Given a tiny GGUF of this architecture, head and tensor type (Q/K permuted by llama.cpp's
    # rule for llama, biased QKV for qwen2)
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, architecture=architecture, tie_word_embeddings=tied,
                     weight_type=weight_type, hidden=hidden, intermediate=2 * hidden,
                     heads=4, kv_heads=2, seed=7)

    # When we and transformers both load it
    loaded = load_model(path)
    ids = loaded.tokenizer.encode(PROMPT)
    ours = prompt_logits(loaded)

    # Then the logits at every position agree
    assert loaded.arch.attention_bias == (architecture == "qwen2")
    assert loaded.arch.tie_word_embeddings == tied
    expected = transformers_logits(path, ids)
    assert (ours - expected).abs().max() < 1e-4 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_hugging_face_folder_gives_the_same_logits_as_the_gguf(tmp_path, architecture):
    # Given the same tiny model as a GGUF and as an HF folder (safetensors, un-permuted Q/K)
    kwargs = {"architecture": architecture, "tie_word_embeddings": architecture == "llama"}
    weights = write_tiny_llama(tmp_path / "tiny.gguf", **kwargs)
    folder = write_hf_folder(tmp_path / "hf", weights, **kwargs)

    # When both are loaded
    from_gguf = load_model(tmp_path / "tiny.gguf")
    from_folder = load_model(folder)

    # Then they are the same model with the same tokenizer
    # (GGUF stores rms_norm_eps as float32)
    assert from_folder.arch == dataclasses.replace(from_gguf.arch, rms_norm_eps=1e-5)
    assert from_folder.tokenizer.encode(PROMPT) == from_gguf.tokenizer.encode(PROMPT)
    assert from_folder.tokenizer.eos_token_id == 2
    torch.testing.assert_close(prompt_logits(from_folder), prompt_logits(from_gguf),
                               rtol=1e-5, atol=1e-5)


def test_a_hugging_face_folder_missing_a_weight_is_refused(tmp_path):
    weights = write_tiny_llama(tmp_path / "tiny.gguf")
    del weights["model.layers.1.mlp.up_proj.weight"]
    folder = write_hf_folder(tmp_path / "hf", weights)

    with pytest.raises(ValueError, match=r"missing 1 weights.*layers\.1\.mlp\.up_proj"):
        load_model(folder)


@pytest.mark.parametrize("architecture", ["gpt2", "mamba"])
def test_an_unsupported_architecture_is_refused_by_name(tmp_path, architecture):
    path = tmp_path / "other.gguf"
    write_tiny_llama(path, architecture=architecture)

    with pytest.raises(ValueError, match=f"unsupported GGUF architecture '{architecture}'"):
        load_model(path)


def test_an_unsupported_model_type_in_config_json_is_refused_by_name(tmp_path):
    weights = write_tiny_llama(tmp_path / "tiny.gguf")
    folder = write_hf_folder(tmp_path / "hf", weights)
    config = (folder / "config.json").read_text().replace('"llama"', '"falcon_h1"')
    (folder / "config.json").write_text(config)

    with pytest.raises(ValueError, match="unsupported model_type 'falcon_h1'"):
        load_model(folder)


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.TQ2_0])
def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path, qtype):
    # Given a GGUF where one projection is stored in a type we do not load
    path = tmp_path / "odd.gguf"
    write_tiny_llama(path, hidden=256, intermediate=256,
                     override_types={"model.layers.1.self_attn.v_proj.weight": qtype})

    # Then loading it fails, naming the type and the tensor
    with pytest.raises(ValueError, match=f"unsupported GGUF tensor type {qtype.name} "
                                         r"\(tensor blk\.1\.attn_v\.weight\)"):
        load_model(path)


def test_an_unknown_dtype_or_path_is_refused(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tiny_model_path, "float16")
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_model(tmp_path / "nothing-here.bin")


def test_bfloat16_load_keeps_weights_and_cache_in_bfloat16(tiny_model_path, tiny_model):
    loaded = load_model(tiny_model_path, "bfloat16", weights="bf16")

    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert loaded.model.make_kv_caches(2, 16)[0].dtype == torch.bfloat16
    f32_bytes = tiny_model.model.kv_cache_bytes_per_block(16)
    assert loaded.model.kv_cache_bytes_per_block(16) * 2 == f32_bytes
    ours, reference = prompt_logits(loaded), prompt_logits(tiny_model)
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.model
def test_the_default_model_loads_as_smollm2(default_model_f32):
    arch = default_model_f32.arch
    assert arch.architecture == "llama"
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.max_position_embeddings) == (49152, 1e5, 8192)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert default_model_f32.model.lm_head.weight is default_model_f32.model.embed_tokens
