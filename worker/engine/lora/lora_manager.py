"""LoraManager: the adapters of an adapter directory, loaded on first use, kept in an LRU.

After vLLM v1's `LRUCacheWorkerLoRAManager` (`--max-loras` adapters resident, the least recently
used evicted for a new one; `load_lora_adapter` / `unload_lora_adapter`). An adapter is a
subfolder `<lora_dir>/<name>/` in PEFT's format (peft_adapter.py) or a file
`<lora_dir>/<name>.gguf` in llama.cpp's (gguf_adapter.py); the name is the one requests give.

Eviction only drops the LRU's reference: a request that holds the adapter (in its
SamplingParams) keeps it alive until it finishes, and while it lives a request for the same
name gets that same object back instead of a second load (the weak map below). So an adapter
is freed once it is both out of the LRU and idle. Thread-safe: the gate loads adapters on the
worker's intake thread while the control stream may load or unload on another.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from llmq.protocol.names import is_valid_name
from llmq.worker.engine.lora.adapter import LoraAdapter
from llmq.worker.engine.lora.gguf_adapter import GGUF_SUFFIX, load_gguf_adapter
from llmq.worker.engine.lora.lora_error import LoraError
from llmq.worker.engine.lora.peft_adapter import is_peft_adapter, load_peft_adapter
from llmq.worker.engine.model.arch import ModelArchConfig

logger = logging.getLogger(__name__)

# NOTE: the heartbeat lists the directory every renewal; on a network volume holding many
# adapters that is thousands of stat calls, so a listing is reused for a few seconds.
AVAILABLE_TTL_S = 5.0


class LoraManager:
    def __init__(self, lora_dir: str | Path, arch: ModelArchConfig, max_loras: int = 4,
                 max_lora_rank: int = 64) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.lora_dir = Path(lora_dir)
        self.arch = arch
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._lru: OrderedDict[str, LoraAdapter] = OrderedDict()  # most recent last
        self._live: weakref.WeakValueDictionary[str, LoraAdapter] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._available: tuple[float, list[str]] = (-AVAILABLE_TTL_S - 1, [])

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, loaded from the directory if no one holds it; LoraError (naming
        it and the problem) for a name that is not there or an adapter that cannot be served."""
        with self._lock:
            adapter = self._lru.get(name) or self._live.get(name)
            if adapter is None:
                adapter = self._load(name)
            self._lru[name] = adapter
            self._lru.move_to_end(name)
            while len(self._lru) > self.max_loras:
                evicted, _ = self._lru.popitem(last=False)
                logger.info("LoRA adapter %s evicted from the LRU (max_loras %d)", evicted,
                            self.max_loras)
            return adapter

    def unload(self, name: str) -> bool:
        """Drop `name` from the LRU (running requests keep their copy until they finish);
        False when it was not loaded. The next request for it reads it from disk again."""
        with self._lock:
            found = self._lru.pop(name, None) is not None
            self._live.pop(name, None)
            return found

    def loaded(self) -> list[str]:
        """Adapters in memory: in the LRU or held by a running request."""
        with self._lock:
            return sorted(set(self._lru) | set(self._live.keys()))

    def exists(self, name: str) -> bool:
        """Whether `name` is an adapter of the directory (loaded or not)."""
        if not is_valid_name(name) or name.startswith("."):
            return False
        with self._lock:
            if name in self._lru or name in self._live:
                return True
        return (is_peft_adapter(self.lora_dir / name)
                or (self.lora_dir / f"{name}{GGUF_SUFFIX}").is_file())

    def available(self) -> list[str]:
        """Adapter names the directory holds (loadable or not: a load checks the files), as
        listed at most AVAILABLE_TTL_S ago."""
        listed_at, names = self._available
        if time.monotonic() - listed_at > AVAILABLE_TTL_S:
            names = self._list_directory()
            self._available = (time.monotonic(), names)
        return names

    def _list_directory(self) -> list[str]:
        if not self.lora_dir.is_dir():
            return []
        names = {p.name for p in self.lora_dir.iterdir() if p.is_dir() and is_peft_adapter(p)}
        names |= {p.name[:-len(GGUF_SUFFIX)] for p in self.lora_dir.glob(f"*{GGUF_SUFFIX}")}
        return sorted(n for n in names if is_valid_name(n))

    def _load(self, name: str) -> LoraAdapter:
        # NOTE: the name is checked before it touches the file system: `../x` is no adapter.
        if not is_valid_name(name) or name.startswith("."):
            raise LoraError(f"{name!r} is not a valid LoRA adapter name")
        start = time.perf_counter()
        folder, gguf_file = self.lora_dir / name, self.lora_dir / f"{name}{GGUF_SUFFIX}"
        if folder.is_dir() and is_peft_adapter(folder):
            adapter = load_peft_adapter(name, folder, self.arch, self.max_lora_rank)
        elif gguf_file.is_file():
            adapter = load_gguf_adapter(name, gguf_file, self.arch, self.max_lora_rank)
        else:
            raise LoraError(f"unknown LoRA adapter {name!r}: no {folder}/adapter_config.json "
                            f"nor {gguf_file} (available: {', '.join(self.available()) or 'none'})")
        self._live[name] = adapter
        logger.info("LoRA adapter %s loaded (rank %d, %.1f MiB) in %.3f s", name, adapter.rank,
                    adapter.nbytes / 2**20, time.perf_counter() - start)
        return adapter
