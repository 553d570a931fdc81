"""A worker serving LoRA adapters, against a real server: requests name an adapter on the wire,
bad adapters are refused on the request's own stream while the worker keeps serving, the
heartbeat and `llmq status` list the adapters, and the control stream loads and unloads them."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from llmq import protocol
from llmq.broker import Client
from llmq.broker.control import call_workers
from llmq.cli.status import status
from tests.e2e.gateway_harness import GatewayProcess
from tests.fixtures.tiny_hf import write_tiny_hf
from tests.fixtures.tiny_lora import write_peft_adapter
from tests.integration.worker_harness import (
    HEARTBEAT,
    KEYS,
    LEASE,
    RENEW,
    read_events,
    wait_for,
    wait_terminal,
    xadd_json,
)

pytestmark = pytest.mark.redis

PROMPT = [5, 9, 33, 71, 100, 12, 64, 8]


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(the tiny Llama loaded, its adapter directory: `good`, `also-good`, `other-base`)."""
    from llmq.worker.engine.model.loader import load_model

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = tmp_path_factory.mktemp("worker-lora")
    base = write_tiny_hf("llama3", root / "base")
    other = write_tiny_hf("llama3-untied", root / "other")
    loras = root / "loras"
    write_peft_adapter(base, loras / "good", r=4, alpha=8, seed=1)
    write_peft_adapter(base, loras / "also-good", r=4, alpha=8, seed=2)
    write_peft_adapter(other, loras / "other-base", r=4, alpha=8)
    return load_model(base, "float32"), loras


class LoraWorker:
    """A `Worker` on a thread, its engine serving the adapter directory."""

    def __init__(self, url: str, loaded: Any, lora_dir: Path) -> None:
        from llmq.worker.engine.config import EngineConfig
        from llmq.worker.engine.engine_core import EngineCore
        from llmq.worker.worker import Worker
        from llmq.worker.worker_config import WorkerConfig

        self.engine = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64,
                                              lora_dir=str(lora_dir), max_loras=2), loaded)
        self.worker = Worker(WorkerConfig(redis_url=url, worker_id="lora-worker",
                                          lease_timeout=LEASE, renew_interval=RENEW,
                                          heartbeat_timeout=HEARTBEAT),
                             self.engine, model_name="tiny")
        self.thread = threading.Thread(target=self.worker.run, daemon=True,
                                       kwargs={"install_signal_handlers": False})

    def __enter__(self) -> LoraWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.request_stop()
        self.thread.join(30)


def _tokens(r, request_id: str) -> list[int]:
    return [t for e in read_events(r, request_id) if isinstance(e, protocol.Delta)
            for t in e.token_ids]


def test_a_worker_serves_adapters_refuses_bad_ones_and_lists_them(
        redis_server, redis_client, lora_model, tmp_path: Path) -> None:
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore
    from llmq.worker.engine.sampling_params import SamplingParams

    loaded, loras = lora_model
    # Given what an engine of its own gives the base model and the adapter `good`
    reference = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64,
                                        lora_dir=str(loras)), loaded)
    assert reference.loras is not None
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base_alone = reference.generate([PROMPT], params)[0].new_token_ids
    lora_output = reference.generate([PROMPT], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, lora=reference.loras.get("good")))[0]
    lora_alone = lora_output.new_token_ids
    request = {"prompt_token_ids": PROMPT, "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}
    with LoraWorker(redis_server.url, loaded, loras):
        # When requests for the base model, an adapter, an unknown adapter and an adapter of
        # another base model arrive together
        ids = {name: xadd_json(redis_client, {**request, **({"lora": name} if name else {})})
               for name in (None, "good", "missing", "other-base")}
        # (and one naming the adapter as its `model`, as vLLM's OpenAI server does)
        by_model = xadd_json(redis_client, {**request, "model": "good"})
        done = {name: wait_terminal(redis_client, entry_id) for name, entry_id in ids.items()}
        # Then the bad ones fail on their own streams, as invalid_request naming the adapter
        for bad, problem in (("missing", "unknown LoRA adapter"),
                             ("other-base", "do not fit the base model")):
            error = done[bad]
            assert isinstance(error, protocol.Error), error
            assert error.code == "invalid_request"
            assert repr(bad) in error.message and problem in error.message
        # And the base model and the adapter answer what the engine gives each alone
        for name in (None, "good"):
            assert isinstance(done[name], protocol.Done), done[name]
        assert _tokens(redis_client, ids[None]) == base_alone
        assert _tokens(redis_client, ids["good"]) == lora_alone != base_alone
        assert isinstance(wait_terminal(redis_client, by_model), protocol.Done)
        assert _tokens(redis_client, by_model) == lora_alone

        # And the heartbeat lists the loaded adapter and the directory's adapters
        key = KEYS.worker("lora-worker")
        beat = wait_for(lambda: (b := protocol.decode_heartbeat(redis_client.hgetall(key)))
                        .loras_loaded and b, 10, "a heartbeat listing adapters")
        assert beat.loras_loaded == "good"
        assert beat.loras_available == "also-good,good,other-base"
        shown = CliRunner().invoke(status, ["--redis-url", redis_server.url])
        assert shown.exit_code == 0, shown.output
        assert "LORAS" in shown.output and "good (1 of 3)" in shown.output

        # When the control stream loads another adapter, a bad one, and unloads the first
        client = Client(redis_server.url)
        try:
            (loaded_reply,) = call_workers(client, "load_lora", {"name": "also-good"},
                                           worker="lora-worker")
            (bad_reply,) = call_workers(client, "load_lora", {"name": "other-base"},
                                        worker="lora-worker")
            (unloaded,) = call_workers(client, "unload_lora", {"name": "good"},
                                       worker="lora-worker")
        finally:
            client.close()
        # Then each answers: loaded, refused by name, unloaded
        assert loaded_reply.ok and loaded_reply.result["loaded"] == ["also-good", "good"]
        assert not bad_reply.ok and "'other-base'" in bad_reply.error
        assert unloaded.ok and unloaded.result["unloaded"] is True
        # And the worker still serves the adapter it unloaded: read again on first use
        again = xadd_json(redis_client, {**request, "lora": "good"})
        assert isinstance(wait_terminal(redis_client, again), protocol.Done)
        assert _tokens(redis_client, again) == lora_alone

        # When the gateway fronts the worker
        gateway = GatewayProcess(redis_server.url, tmp_path, keys={}, extra=["--no-auth"]).start()
        try:
            models = httpx.get(gateway.base_url + "/v1/models", timeout=10).json()["data"]
            completion = httpx.post(gateway.base_url + "/v1/completions", timeout=60, json={
                "model": "good", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}).json()
        finally:
            gateway.stop()
        # Then /v1/models lists the adapters after the base model, each naming it as parent
        assert [(m["id"], m.get("parent")) for m in models] == [
            ("tiny", None), ("also-good", "tiny"), ("good", "tiny"), ("other-base", "tiny")]
        # And `model: "good"` is answered by the adapter
        assert completion["choices"][0]["text"] == lora_output.text, completion
