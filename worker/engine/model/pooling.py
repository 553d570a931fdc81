"""Pooling: how `/v1/embeddings` turns a prompt's final hidden states into one vector.

Read from the model, as vLLM and llama.cpp do:
- a Hugging Face folder's sentence-transformers config: `modules.json` names a
  `sentence_transformers.models.Pooling` module whose folder (e.g. `1_Pooling/config.json`) sets
  `pooling_mode_mean_tokens`, `pooling_mode_lasttoken` or `pooling_mode_cls_token`;
- a GGUF's `<arch>.pooling_type` (llama.cpp's `enum llama_pooling_type`: 0 none, 1 mean, 2 cls,
  3 last, 4 rank).

With neither, LAST: vLLM's pooler for a generative model run as an embedding model
(`--convert embed`, `as_embedding_model`) takes the last token's hidden state and normalises it
(docs.vllm.ai "Pooling Models": embed -> LAST, normalised; MEAN before 0.8). Under a causal
mask the last position is the only one that has seen the whole prompt, which is why decoder
embedding models (e5-mistral, gte-Qwen2, Qwen3-Embedding) are trained to pool there.
Only mean, last and cls are computed; any other mode fails at load, by name.
"""

from __future__ import annotations

import json
from pathlib import Path

MEAN, LAST, CLS = "mean", "last", "cls"
POOLINGS = (MEAN, LAST, CLS)
DEFAULT_POOLING = LAST

# llama.cpp's enum llama_pooling_type (gguf-py's `PoolingType`), by value
_GGUF_POOLING = {0: "none", 1: MEAN, 2: CLS, 3: LAST, 4: "rank"}

# sentence-transformers' Pooling config keys -> the mode each switches on
_ST_MODES = {
    "pooling_mode_mean_tokens": MEAN, "pooling_mode_lasttoken": LAST,
    "pooling_mode_cls_token": CLS, "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_POOLING_TYPE = "sentence_transformers.models.Pooling"


def check_pooling(pooling: str, where: str) -> str:
    """The pooling if it is computed here; else a ValueError naming it and `where` it came from."""
    if pooling not in POOLINGS:
        raise ValueError(f"unsupported pooling {pooling!r} ({where}); supported: "
                         f"{', '.join(POOLINGS)}")
    return pooling


def gguf_pooling(value: int | None, arch: str) -> str:
    """The pooling a GGUF's `<arch>.pooling_type` value names (absent: the default)."""
    if value is None:
        return DEFAULT_POOLING
    where = f"{arch}.pooling_type {value}"
    return check_pooling(_GGUF_POOLING.get(int(value), f"unknown value {value}"), where)


def hf_pooling(folder: str | Path) -> str:
    """The pooling of a Hugging Face folder's sentence-transformers Pooling module (none: the
    default)."""
    folder = Path(folder)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return DEFAULT_POOLING
    modules = json.loads(modules_path.read_text())
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING_TYPE), None)
    if pooling is None:
        return DEFAULT_POOLING
    config_path = folder / pooling.get("path", "") / "config.json"
    if not config_path.is_file():
        raise ValueError(f"modules.json names a Pooling module but {config_path} is missing")
    config = json.loads(config_path.read_text())
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    where = f"{config_path.relative_to(folder)}"
    if len(modes) != 1:
        # NOTE: sentence-transformers concatenates the vectors of several modes; a vector of
        # another width than the model's is not something this engine computes.
        raise ValueError(f"unsupported pooling: {len(modes)} modes switched on in {where} "
                         f"({', '.join(modes) or 'none'}); exactly one of "
                         f"{', '.join(POOLINGS)} is supported")
    return check_pooling(modes[0], where)
