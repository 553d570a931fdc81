"""llmq.worker.engine.model: Llama-family models, their loaders and tokenizers.

Exports resolve lazily (PEP 562): `default_model` and `tokenizer` are imported by modules that
must not pull in torch, so importing this package itself imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelArchConfig": "arch",
    "AttentionMetadata": "attention",
    "LlamaForCausalLM": "llama",
    "LoadedModel": "loader",
    "load_model": "loader",
    "Tokenizer": "tokenizer",
    "ensure_default_model": "default_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
