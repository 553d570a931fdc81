"""The worker's settings table (deploy/env.md), read the way the deployment tests need it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV_TABLE = ROOT / "deploy" / "env.md"

_ROW = re.compile(r"^\| `(LLMQ_[A-Z0-9_]+)` \| (?:`(--[a-z0-9-]+)`|\(none\)) \|", re.M)


def worker_settings() -> dict[str, str | None]:
    """Environment variable -> `llmq worker` flag (None for variables with no flag)."""
    rows = {m.group(1): m.group(2) for m in _ROW.finditer(ENV_TABLE.read_text())}
    assert rows, f"no rows found in {ENV_TABLE}"
    return rows
