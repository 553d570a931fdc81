"""Shared fixtures: real Redis-compatible servers and model files, each in its own module.

Tests that run the real default model in torch are marked `slow` here, from the fixture they use
(seconds to a minute each): `make check` leaves them to `make test`, and keeps the `model` tests
that only read the default model's GGUF (its tokenizer and template).

Also the per-test time limits: pyproject.toml's `timeout` (120 s) fails a hung test; the modules
below take longer by design and get their own limit (a test's own `@pytest.mark.timeout` still
wins). A limit covers the test with its fixtures, so a module's first test also pays for starting
its servers and workers.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "tests.fixtures.redis_servers",
    "tests.fixtures.redis_cluster",
    "tests.fixtures.models",
    "tests.fixtures.acl_server",
]

# NOTE: every process the tests start (pytest's own, workers, CLIs) runs the kernel forms by
# assumption (worker/engine/model/form_choice.py `fixed`), the same on every host: forms chosen by
# measurement can differ between two processes timing at once on a busy machine, and two
# processes' greedy tokens with them at a near tie. tests/model/test_form_choice.py tests the
# measurement itself; `LLMQ_FORMS=measure make test` runs the whole suite on it.
os.environ.setdefault("LLMQ_FORMS", "fixed")

# Fixtures that load SmolLM2's weights into torch.
REAL_MODEL_FIXTURES = ("default_model_f32",)

# module -> seconds, each about twice the longest wait the module allows itself
LONG_TIMEOUTS = {
    "tests/e2e/test_chaos.py": 600,  # a 120 s soak, then every request settled and checked
    "tests/e2e/test_worker_e2e.py": 900,  # the real model, 16 requests against generate()
    "tests/e2e/test_readme.py": 480,  # the whole tour, `llmq up` to `llmq down` (waits 240 s)
    "tests/e2e/test_gateway_load.py": 600,  # a thousand streams at once (waits 300 s)
    "tests/e2e/test_cli_up.py": 360,  # `make run` end to end (waits 180 s)
    "tests/e2e/test_worker_observability.py": 400,  # the real model loading, seen by /readyz
    "tests/e2e/test_dashboard_browser.py": 240,  # Chromium, a pool and a gateway per module
    "tests/cluster/test_cluster.py": 300,  # six servers, failover and slot migration
    "tests/cluster/test_cluster_frontends.py": 240,
    "tests/cluster/test_sentinel.py": 240,  # a promotion under load (waits 60 s per step)
    "tests/integration/test_worker_reliability.py": 240,  # worker processes killed and restarted
    "tests/integration/test_recovery.py": 240,
    "tests/integration/test_worker_control.py": 300,  # waits up to 150 s for RSS to drop
    # SmolLM2 in torch beside its float32 or transformers oracle: 50-90 s per test when the
    # machine is busy (2026-12-01, load 7 on 2 cores)
    "tests/model/test_native_weights.py": 300,
    "tests/model/test_llama_oracle.py": 300,
    "tests/engine/test_engine_real_model.py": 300,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if stale := sorted(p for p in LONG_TIMEOUTS if not (config.rootpath / p).is_file()):
        raise pytest.UsageError(f"LONG_TIMEOUTS names missing test modules: {stale}")
    # NOTE: the long modules first (a stable sort keeps each module's own order): `make test`
    # hands whole modules to its pytest processes in this order, and a soak started last would
    # run alone at the end while the other processes sit idle.
    items.sort(key=lambda item: -LONG_TIMEOUTS.get(
        item.path.relative_to(config.rootpath).as_posix(), 0))
    for item in items:
        if any(name in REAL_MODEL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        seconds = LONG_TIMEOUTS.get(item.path.relative_to(config.rootpath).as_posix())
        if seconds is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds))
