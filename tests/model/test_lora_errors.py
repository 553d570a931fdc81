"""Adapters a worker cannot serve are refused at the gate, by name, and the engine keeps serving.

An unknown adapter, an adapter made for another base model (its shapes do not fit), one of a
rank above `max_lora_rank`, and corrupt files each give an invalid_request whose message names
the adapter and the problem; the next request under a good adapter runs as ever. The LRU keeps
at most `max_loras` adapters, except those a running request still holds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.fixtures.models import one_torch_thread
from tests.fixtures.tiny_hf import write_tiny_hf
from tests.fixtures.tiny_lora import write_peft_adapter

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base HF folder, adapter directory with one good adapter and every kind of bad one)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = tmp_path_factory.mktemp("lora-errors")
    base = write_tiny_hf("llama3", root / "base")
    other = write_tiny_hf("llama3-untied", root / "other")  # one KV head, not two
    loras = root / "loras"
    good = write_peft_adapter(base, loras / "good", r=4, alpha=8)
    write_peft_adapter(base, loras / "wide", r=16, alpha=8)
    write_peft_adapter(other, loras / "other-base", r=4, alpha=8)
    shutil.copytree(good, loras / "truncated")
    weights = loras / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    shutil.copytree(good, loras / "bad-config")
    (loras / "bad-config" / "adapter_config.json").write_text("{not json")
    return base, loras


@pytest.fixture(scope="module")
def engine(lora_setup):
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore
    from llmq.worker.engine.model.loader import load_model

    base, loras = lora_setup
    cfg = EngineConfig(model=str(base), dtype="float32", lora_dir=str(loras), num_kv_blocks=32,
                       max_lora_rank=8, max_loras=2)
    return EngineCore(cfg, load_model(base, "float32"))


def _request(lora: str | None):
    from llmq.protocol import Request

    return Request(prompt_token_ids=[5, 6, 7, 8], lora=lora, temperature=0.0, max_tokens=4,
                   ignore_eos=True)


@pytest.mark.parametrize("name, problem", [
    ("missing", "unknown LoRA adapter 'missing'"),
    ("other-base", "do not fit the base model"),
    ("wide", "rank 16 is above the maximum, max_lora_rank 8"),
    ("truncated", "adapter_model.safetensors is corrupt"),
    ("bad-config", "adapter_config.json cannot be read"),
])
def test_an_unservable_adapter_is_an_invalid_request_naming_it(engine, name: str, problem: str
                                                                ) -> None:
    from llmq.protocol.errors import ErrorCode, RequestRejected
    from llmq.worker.engine.input_processor import InputProcessor

    one_torch_thread()
    gate = InputProcessor.for_engine(engine)
    # When a request names an adapter the worker cannot serve
    with pytest.raises(RequestRejected) as rejected:
        gate.process(_request(name))
    # Then it is refused as invalid_request, naming the adapter and what is wrong
    assert rejected.value.code == ErrorCode.INVALID_REQUEST
    assert repr(name) in str(rejected.value) and problem in str(rejected.value)
    # And the engine still serves a good adapter and the base model
    processed = gate.process(_request("good"))
    out = engine.generate([processed.prompt_token_ids], processed.sampling_params)[0]
    assert out.finish_reason == "length" and len(out.new_token_ids) == 4


def test_a_worker_without_an_adapter_directory_refuses_any_adapter(lora_setup) -> None:
    from llmq.protocol.errors import RequestRejected
    from llmq.worker.engine.input_processor import InputProcessor

    gate = InputProcessor(None, vocab_size=320, max_model_len=64)
    with pytest.raises(RequestRejected, match="serves no LoRA adapters"):
        gate.process(_request("good"))


def test_the_lru_keeps_max_loras_adapters_and_those_still_in_use(lora_setup) -> None:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine.model.arch import ModelArchConfig
    from llmq.worker.engine.model.hf_loader import read_hf_arch

    base, loras = lora_setup
    arch: ModelArchConfig = read_hf_arch(base)
    shutil.copytree(loras / "good", loras.parent / "lru" / "a", dirs_exist_ok=True)
    shutil.copytree(loras / "good", loras.parent / "lru" / "b", dirs_exist_ok=True)
    manager = LoraManager(loras.parent / "lru", arch, max_loras=1)
    assert manager.available() == ["a", "b"] and manager.loaded() == []
    # Given adapter `a` held (as a running request's params hold it) and then `b` loaded
    held = manager.get("a")
    manager.get("b")
    # Then `a` is out of the LRU but still loaded, and asking for it gives the same object
    assert manager.loaded() == ["a", "b"]
    assert manager.get("a") is held
    # When nothing holds `b` any more and `a` takes the LRU's one place, `b` is freed
    manager.get("a")
    assert manager.loaded() == ["a"]
    # And unloading drops it once no request holds it: the next request reads it again
    del held
    assert manager.unload("a") and manager.loaded() == []
    assert not manager.unload("a")
