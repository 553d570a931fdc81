"""The README's five-minute tour, run as written: every command it shows, in its order.

The bash blocks of the "Five-minute tour" section are joined into one script and run with the
venv's `llmq` first on PATH, a private run folder and the tiny model (through the `LLMQ_*`
variables the engine flags read), so the tour stays true as the code changes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cli_harness import subprocess_env
from tests.fixtures.redis_servers import require_binary

pytestmark = [pytest.mark.redis, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"


def tour_script() -> str:
    text = README.read_text()
    section = text.split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 5, "the tour lost its commands"
    return "set -euo pipefail\n" + "\n".join(blocks)


def test_the_readme_tour_runs_as_written(tmp_path_factory: pytest.TempPathFactory,
                                         tiny_model_path: Path) -> None:
    require_binary("valkey")
    run_dir = tmp_path_factory.mktemp("tour-run")
    work = tmp_path_factory.mktemp("tour")
    env = subprocess_env(run_dir=run_dir, LLMQ_MODEL=str(tiny_model_path),
                         LLMQ_DTYPE="float32", LLMQ_MAX_MODEL_LEN="256",
                         LLMQ_KV_CACHE_MEMORY_BYTES="8000000")
    # NOTE: no redis-cli is added: the tour's raw-producer block must work with the venv alone.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        result = subprocess.run(["bash", "-c", tour_script()], cwd=work, env=env, text=True,
                                capture_output=True, timeout=240)
    finally:
        subprocess.run([sys.executable, "-m", "llmq.cli.main", "down"], env=env,
                       capture_output=True, timeout=120)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "llmq is up: 2 worker(s)" in result.stdout
    results = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
    assert [r["line"] for r in results] == [1, 2] and "(2 already done)" in result.stderr
    batch = [json.loads(x) for x in (work / "batch-results.jsonl").read_text().splitlines()]
    assert [b["custom_id"] for b in batch] == ["q1", "q2"]
    assert '"request_id":"from-cli"' in result.stdout and "TTFT ms" in result.stdout
    assert not (run_dir / "redis.sock").exists()
