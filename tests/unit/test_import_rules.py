"""DESIGN.md's import rules, checked by importing each module in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# module -> prefixes of modules it must not pull in
RULES = {
    "llmq.broker.keys": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.protocol": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.client": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.aio": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.embedded": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.broker.control": ("torch", "llmq.worker", "llmq.cli"),
    "llmq.worker.engine.request": ("torch", "redis"),
    "llmq.worker.engine.outputs": ("torch", "redis"),
    "llmq.worker.engine.sampling_params": ("torch", "redis"),
    "llmq.worker.engine.config": ("torch", "redis"),
    "llmq.worker.engine.block_pool": ("torch", "redis"),
    "llmq.worker.engine.kv_cache_manager": ("torch", "redis"),
    "llmq.worker.engine.scheduler": ("torch", "redis"),
    "llmq.worker.engine.detokenizer": ("torch", "redis"),
    # NOTE: the gate compiles grammars with it: only the runner's half needs torch, lazily.
    "llmq.worker.engine.structured_output": ("torch", "redis", "llmq.broker"),
    "llmq.worker.engine.input_processor": ("torch", "redis"),
    "llmq.worker.metrics": ("torch", "redis"),
    "llmq.worker.health_server": ("torch", "redis"),
    "llmq.worker.engine.model_runner": ("redis", "llmq.broker"),
    "llmq.worker.engine.sampler": ("redis", "llmq.broker"),
    "llmq.worker.engine.model.llama": ("redis", "llmq.broker"),
    "llmq.worker.engine.model.loader": ("redis", "llmq.broker"),
    "llmq.worker.engine.engine_core": ("redis",),
    "llmq.worker.engine_proc": ("llmq.cli",),
    "llmq.cli.main": ("torch", "llmq.worker.engine.model", "llmq.worker.engine.engine_core"),
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
