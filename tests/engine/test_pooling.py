"""Embedding pooling as the model says: each mode against a direct computation from the model's
hidden states, and the mode read from a GGUF's `<arch>.pooling_type` and from a Hugging Face
folder's sentence-transformers Pooling config (worker/engine/model/pooling.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmq.worker.engine.model.arch import ModelArchConfig
from llmq.worker.engine.model.hf_loader import read_hf_arch
from llmq.worker.engine.prompt_tasks import PromptTasks

PROMPT_IDS = [100 + (j * 37) % 400 for j in range(40)]


def hidden_states(tiny_model, ids: list[int]) -> torch.Tensor:
    model = tiny_model.model
    return model.forward_contiguous(torch.tensor(ids), 0,
                                    model.make_contiguous_cache(len(ids))).float()


@pytest.mark.parametrize(("pooling", "pool"), [
    ("mean", lambda h: h.mean(0)),
    ("last", lambda h: h[-1]),
    ("cls", lambda h: h[0]),
])
def test_each_pooling_is_its_row_of_the_final_hidden_states_at_unit_length(tiny_model, pooling,
                                                                           pool):
    # Given prompt tasks pooling as the model says
    tasks = PromptTasks(lambda: tiny_model.model, tiny_model.tokenizer, 2048, time.monotonic,
                        pooling)
    # When a prompt is embedded
    vector = torch.tensor(tasks.embed(PROMPT_IDS))
    # Then it is that pooling of the model's own final hidden states, normalised
    expected = torch.nn.functional.normalize(pool(hidden_states(tiny_model, PROMPT_IDS)), dim=0)
    assert torch.allclose(vector, expected, atol=1e-5)


def test_last_token_pooling_spans_chunks(tiny_model):
    # Given a prompt longer than one forward chunk (512 positions)
    ids = [100 + (j * 37) % 400 for j in range(600)]
    tasks = PromptTasks(lambda: tiny_model.model, tiny_model.tokenizer, 2048, time.monotonic,
                        "last")
    # Then the vector is the very last position's, and mean pooling averages every chunk
    expected = torch.nn.functional.normalize(hidden_states(tiny_model, ids)[-1], dim=0)
    assert torch.allclose(torch.tensor(tasks.embed(ids)), expected, atol=1e-5)
    mean = PromptTasks(lambda: tiny_model.model, None, 2048, time.monotonic, "mean")
    expected = torch.nn.functional.normalize(hidden_states(tiny_model, ids).mean(0), dim=0)
    assert torch.allclose(torch.tensor(mean.embed(ids)), expected, atol=1e-5)


def write_gguf(path: Path, pooling_type: int | None) -> Path:
    """A GGUF of the metadata ModelArchConfig reads (and the embedding it sizes the vocabulary
    from), with `llama.pooling_type` when given."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    if pooling_type is not None:
        writer.add_uint32("llama.pooling_type", pooling_type)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("value", "pooling"), [(None, "last"), (1, "mean"), (2, "cls"),
                                                (3, "last")])
def test_a_gguf_pooling_type_is_read(tmp_path, value, pooling):
    path = write_gguf(tmp_path / "m.gguf", value)
    assert ModelArchConfig.from_gguf(gguf.GGUFReader(str(path))).pooling == pooling


@pytest.mark.parametrize(("value", "says"), [(4, "'rank'"), (0, "'none'"), (9, "unknown value 9")])
def test_a_gguf_pooling_type_not_computed_here_is_refused_by_name(tmp_path, value, says):
    path = write_gguf(tmp_path / "m.gguf", value)
    with pytest.raises(ValueError, match="unsupported pooling") as info:
        ModelArchConfig.from_gguf(gguf.GGUFReader(str(path)))
    assert says in str(info.value) and "llama.pooling_type" in str(info.value)


def write_hf_config(folder: Path, pooling_modes: dict[str, bool] | None) -> Path:
    """config.json of a tiny Llama, and a sentence-transformers Pooling module when given."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}))
    if pooling_modes is not None:
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 16, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
             "pooling_mode_lasttoken": False, **pooling_modes}))
    return folder


@pytest.mark.parametrize(("modes", "pooling"), [
    (None, "last"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode_cls_token": True}, "cls"),
])
def test_a_sentence_transformers_pooling_config_is_read(tmp_path, modes, pooling):
    assert read_hf_arch(write_hf_config(tmp_path / "hf", modes)).pooling == pooling


@pytest.mark.parametrize(("modes", "says"), [
    ({"pooling_mode_max_tokens": True}, "max"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "2 modes"),
])
def test_a_sentence_transformers_pooling_not_computed_here_is_refused_by_name(tmp_path, modes,
                                                                              says):
    with pytest.raises(ValueError, match="unsupported pooling") as info:
        read_hf_arch(write_hf_config(tmp_path / "hf", modes))
    assert says in str(info.value) and "1_Pooling/config.json" in str(info.value)
