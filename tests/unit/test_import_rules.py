"""DESIGN.md's import rules, checked by importing each module in a fresh interpreter.

docs/architecture.md draws the same layers: the engine (worker/engine/) below the worker process
(worker/), both below the CLI; the broker beside them. Nothing in the engine talks to Redis.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# module -> prefixes of modules it must not pull in
RULES = {
    "llmq.broker.keys": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.client": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.aio": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.embedded": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.multiplex": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.protocol": ("torch", "redis", "llmq.broker", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker.result_reader": ("torch", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker.aio_result_reader": ("torch", "llmq.worker", "llmq.cli", "llmq.gateway"),
    "llmq.broker.control": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.worker.engine.request": ("torch", "redis"),
    "llmq.worker.engine.outputs": ("torch", "redis"),
    "llmq.worker.engine.sampling_params": ("torch", "redis"),
    "llmq.worker.engine.config": ("torch", "redis"),
    "llmq.worker.engine.block_pool": ("torch", "redis"),
    "llmq.worker.engine.kv_cache_manager": ("torch", "redis"),
    "llmq.worker.engine.scheduler": ("torch", "redis"),
    "llmq.worker.engine.parallel_sampling": ("torch", "redis"),
    "llmq.worker.engine.detokenizer": ("torch", "redis"),
    # NOTE: the gate compiles grammars with it: only the runner's half needs torch, lazily.
    "llmq.worker.engine.structured_output": ("torch", "redis", "llmq.broker"),
    "llmq.worker.engine.input_processor": ("torch", "redis"),
    "llmq.worker.metrics": ("torch", "redis"),
    "llmq.worker.heartbeat_counters": ("torch", "redis"),
    "llmq.worker.health_server": ("torch", "redis"),
    "llmq.worker.engine.model_runner": ("redis",),
    "llmq.worker.engine.sampler": ("redis",),
    "llmq.worker.engine.model.llama": ("redis", "llmq.broker"),
    "llmq.worker.engine.model.loader": ("redis", "llmq.broker"),
    "llmq.worker.engine.engine_core": ("redis",),
    "llmq.worker.worker": ("llmq.cli",),
    "llmq.cli.main": ("torch", "llmq.worker.engine.model", "llmq.worker.engine.engine_core"),
    **{f"llmq.gateway.{name}": ("torch", "llmq.worker", "llmq.cli")
       for name in ("app", "completions", "files", "batches", "batch_job", "batch_store",
                    "openai_batch", "openai_request", "openai_response", "api_keys",
                    "pool_view", "state", "settings", "metrics", "errors", "dashboard",
                    "dashboard_session", "dead_letter_view", "pool_series")},
}

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("module", sorted(RULES))
def test_module_imports_only_what_its_layer_allows(module: str) -> None:
    # Given a fresh interpreter, When the module is imported
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                         check=True).stdout
    loaded = json.loads(out)
    # Then none of the forbidden packages came with it
    forbidden = [m for m in loaded
                 if any(m == p or m.startswith(p + ".") for p in RULES[module])]
    assert forbidden == [], f"{module} pulls in {forbidden[:5]}"


ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = sorted(
    "llmq.worker." + ".".join(path.relative_to(ROOT / "worker").with_suffix("").parts)
    for path in (ROOT / "worker" / "engine").rglob("*.py") if path.name != "__init__.py")


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_nothing_in_the_engine_talks_to_redis_or_reaches_up(module: str) -> None:
    # Given a fresh interpreter, When an engine module is imported
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                         check=True).stdout
    loaded = json.loads(out)
    # Then no redis, nothing of the broker (the wire contract is llmq.protocol), nothing above
    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")
    forbidden = [m for m in loaded
                 if under(m, "redis") or under(m, "llmq.cli") or under(m, "llmq.gateway")
                 or under(m, "llmq.broker")
                 or (under(m, "llmq.worker") and m != "llmq.worker"
                     and not under(m, "llmq.worker.engine"))]
    assert forbidden == [], f"{module} pulls in {forbidden[:5]}"
