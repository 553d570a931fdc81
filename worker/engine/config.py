"""EngineConfig: every knob of the engine core, checked once at construction.

Names follow vLLM (`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `block_size`) so
vLLM users know them; `llmq generate` / `llmq worker` flags map 1:1 onto the fields, with
`LLMQ_<FIELD>` environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmq.worker.engine.spec_decode.speculator import SpeculativeConfig

DTYPES = ("float32", "bfloat16")
WEIGHTS = ("native", "bf16", "fp32")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    model: str = ""  # a .gguf file or a Hugging Face folder; "" means the default model
    dtype: str = "bfloat16"  # the KV cache's (and the activations' on the all-bf16 path)
    # How the projections are held: native (a GGUF's own quantization through int4 kernels for
    # small batches, float32 GEMMs for large ones), bf16 or fp32. None: native, or fp32 when
    # dtype is float32 (llama.py `default_weights`).
    weights: str | None = None
    threads: int = 1  # torch intra-op threads; one worker process per core fills a machine
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_bytes: int = 1 << 30  # KV budget; ignored when num_kv_blocks is set
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 1024  # tokens per step (prefill chunks + decodes)
    # Prompt tokens of batch-lane requests per step: bounds the step an interactive request
    # arrives during (worker/engine/lane_priority.py; the trade-off: docs/performance.md).
    max_batch_prefill_tokens: int = 128
    scheduling_policy: str = "fcfs"
    max_num_preemptions: int = 8  # a request preempted more often fails with code "preempted"
    # Speculative decoding (worker/engine/spec_decode/): None is off; "ngram" is prompt lookup,
    # "draft" a smaller model of the same tokenizer, `draft_model` (a .gguf or a HF folder).
    speculative_method: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4  # the most draft tokens verified per step
    prompt_lookup_max: int = 3  # the longest n-gram a draft is looked up by
    prompt_lookup_min: int = 2  # the shortest
    # LoRA adapters (worker/engine/lora/): a directory of them (None: none served), how many
    # stay loaded (least recently used evicted first), and the largest rank accepted.
    lora_dir: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    # Batch-invariant decoding (model/llama.py `make_batch_invariant`): every row's logits
    # bitwise the same whatever shares its step, however its prompt was chunked and whether
    # its prefix came from the cache, at a cost in speed (docs/operations.md)
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights is not None and self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}")
        for name in ("threads", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_batch_prefill_tokens", "kv_cache_memory_bytes", "max_loras",
                     "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_preemptions < 0:
            raise ValueError(f"max_num_preemptions must be >= 0, got {self.max_num_preemptions}")
        speculative = self.speculative_config
        if speculative is not None and (problem := speculative.problem()):
            raise ValueError(problem)
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method 'draft' needs a draft_model (--draft-model: "
                             "a .gguf file or a Hugging Face folder)")
        if self.draft_model and self.speculative_method != "draft":
            raise ValueError(f"draft_model {self.draft_model!r} is only used with "
                             f"speculative_method 'draft', got {self.speculative_method!r}")

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens,
                                 self.prompt_lookup_max, self.prompt_lookup_min)
