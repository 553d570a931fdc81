"""load_model: a .gguf file or a Hugging Face folder -> model, tokenizer and arch, together.

References: vLLM `model_loader` (one entry point dispatching on the checkpoint format),
llama.cpp (model and tokenizer from the one GGUF file).

The GGUF header is read once (gguf_reader.py) and shared by the arch config, the weights and
the tokenizer, which is built on a thread while the weights load (docs/models.md, "Loading").
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arch import ModelArchConfig
from .form_choice import FormChoice
from .gguf_loader import check_tensor_types, iter_gguf_weights
from .gguf_reader import FastGGUFReader
from .hf_loader import iter_hf_weights, read_hf_arch
from .llama import DTYPES, WEIGHTS, LlamaForCausalLM, default_weights
from .repack_cache import RepackCache

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any  # llmq.worker.engine.model.tokenizer.Tokenizer
    arch: ModelArchConfig


def load_model(path: str | Path, dtype: str = "float32", weights: str | None = None,
               batch_invariant: bool = False) -> LoadedModel:
    """Load a .gguf file or a Hugging Face folder (config.json + *.safetensors +
    tokenizer.json). Unsupported architectures, quant types or dtypes raise ValueError.

    `dtype` is the KV cache's; `weights` (native | bf16 | fp32; default `native`, `fp32` with
    a float32 dtype) how the projections are held: see llama.py. A Hugging Face folder has no
    quantized tensors, so `native` holds it as float32."""
    # NOTE: imported here, not at the top, so the model loads stay importable on their own.
    from .tokenizer import Tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    weights = weights or default_weights(dtype)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    path = Path(path)
    start = time.perf_counter()
    if path.is_file() and path.suffix == ".gguf":
        reader = FastGGUFReader(path)
        arch = ModelArchConfig.from_gguf(reader)
        check_tensor_types(reader)  # before the slow parts, so a bad file fails fast
        # NOTE: the tokenizer is built beside the weights: its Python loops hold the GIL, the
        # weights' repacking (oneDNN, the forms' decoding) mostly does not, and on a warm
        # start the two take about as long.
        with ThreadPoolExecutor(1, thread_name_prefix="llmq-tokenizer") as pool:
            building = pool.submit(Tokenizer.from_gguf, reader)
            model = LlamaForCausalLM(arch, dtype, weights)
            native = weights == "native"
            fingerprint = reader.fingerprint() if native else ""
            model.load_weights(
                iter_gguf_weights(reader, arch, keep_quantized=native),
                RepackCache.for_model(path, fingerprint) if native else None,
                FormChoice.for_model(path, fingerprint, model.kernels,
                                     # the one form whose rows are bitwise batch-invariant
                                     "quant" if batch_invariant else None)
                if native else None)
            tokenizer = building.result()
    elif path.is_dir():
        arch = read_hf_arch(path)
        model = LlamaForCausalLM(arch, dtype, weights)
        model.load_weights(iter_hf_weights(path, arch))
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model folder")
    model.eval()
    if batch_invariant:
        model.make_batch_invariant()
    _return_freed_memory()
    logger.info("loaded %s (%s, %d layers, %s cache, %s weights) in %.2f s", path.name,
                arch.architecture, arch.num_layers, dtype, weights, time.perf_counter() - start)
    return LoadedModel(model=model, tokenizer=tokenizer, arch=arch)


def _return_freed_memory() -> None:
    """Hand the load's freed temporaries back to the OS.

    NOTE: glibc keeps freed heap memory in its arenas; after a cold load (each projection's
    blocks decoded, its forms built and then mapped from the repack cache instead) that is
    ~1 GB of a 1B model, counted in the worker's RSS until something reuses it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, or no way to
        pass
