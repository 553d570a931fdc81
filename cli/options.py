"""Option groups shared by several commands, each flag with its `LLMQ_*` environment variable.

Connection flags map onto `BrokerSettings` fields, engine flags 1:1 onto `EngineConfig` fields and
sampling flags onto `SamplingParams`, so a flag, its variable and its field always share one name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import click

Command = TypeVar("Command", bound=Callable[..., Any])


def _apply(options: list[Callable[[Command], Command]]) -> Callable[[Command], Command]:
    def decorate(fn: Command) -> Command:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


redis_url_option = click.option(
    "--redis-url", envvar="LLMQ_REDIS_URL", default=None, metavar="URL",
    help="redis://, rediss:// (TLS) or unix:// URL, user:password@ for ACL users "
         "(default: the server `llmq up` started).")

connection_options = _apply([
    redis_url_option,
    click.option("--prefix", envvar="LLMQ_PREFIX", default="llmq", show_default=True,
                 help="Key prefix."),
    click.option("--queue", envvar="LLMQ_QUEUE", default="default", show_default=True,
                 help="Queue (the stream <prefix>:q:<queue>)."),
])

class ConnectionFlags(TypedDict):
    """The connection flags, as `Client(**...)` and `open_client(**...)` take them."""

    redis_url: str | None
    prefix: str
    queue: str


def connection_kwargs(kwargs: dict[str, Any]) -> ConnectionFlags:
    """Pop the connection flags out of a command's kwargs, ready for Client(**...)."""
    return ConnectionFlags(redis_url=kwargs.pop("redis_url"), prefix=kwargs.pop("prefix"),
                           queue=kwargs.pop("queue"))


engine_options = _apply([
    click.option("--model", envvar="LLMQ_MODEL", default="", show_default=False,
                 help="A .gguf file or a Hugging Face folder. Default: SmolLM2-135M-Instruct."),
    click.option("--dtype", envvar="LLMQ_DTYPE", type=click.Choice(["float32", "bfloat16"]),
                 default="bfloat16", show_default=True,
                 help="KV-cache dtype; float32 also means float32 weights and activations."),
    click.option("--weights", envvar="LLMQ_WEIGHTS", type=click.Choice(["native", "bf16", "fp32"]),
                 default=None, help="How the projections are held: native (a GGUF's own "
                 "quantization, each projection on the kernel form measured fastest on this CPU: "
                 "LLMQ_FORMS), "
                 "bf16 or fp32. Default: native (fp32 with --dtype float32)."),
    click.option("--threads", envvar="LLMQ_THREADS", type=click.IntRange(min=1), default=1,
                 show_default=True, help="torch threads (run one worker per core instead)."),
    click.option("--max-num-seqs", envvar="LLMQ_MAX_NUM_SEQS", type=click.IntRange(min=1),
                 default=64, show_default=True, help="Requests batched per step."),
    click.option("--max-num-batched-tokens", envvar="LLMQ_MAX_NUM_BATCHED_TOKENS",
                 type=click.IntRange(min=1), default=1024, show_default=True,
                 help="Tokens per step (prefill chunks + decodes)."),
    click.option("--max-batch-prefill-tokens", envvar="LLMQ_MAX_BATCH_PREFILL_TOKENS",
                 type=click.IntRange(min=1), default=128, show_default=True,
                 help="Prompt tokens of batch-lane requests per step: smaller keeps the step an "
                      "interactive request arrives during short, larger runs batch prefill "
                      "in fewer, longer steps."),
    click.option("--max-model-len", envvar="LLMQ_MAX_MODEL_LEN", type=click.IntRange(min=2),
                 default=None, help="Context length (default: the model's, capped at 8192)."),
    click.option("--block-size", envvar="LLMQ_BLOCK_SIZE", type=click.IntRange(min=1),
                 default=16, show_default=True, help="Tokens per KV-cache block."),
    click.option("--kv-cache-memory-bytes", envvar="LLMQ_KV_CACHE_MEMORY_BYTES",
                 type=click.IntRange(min=1), default=1 << 30, show_default=True,
                 help="KV-cache budget in bytes."),
    click.option("--scheduling-policy", envvar="LLMQ_SCHEDULING_POLICY",
                 type=click.Choice(["fcfs", "priority"]), default="fcfs", show_default=True),
    click.option("--speculative-method", envvar="LLMQ_SPECULATIVE_METHOD",
                 type=click.Choice(["ngram", "draft"]), default=None,
                 help="Speculative decoding: ngram is prompt lookup (drafts copied from the "
                      "prompt and output so far), draft a smaller model of the same tokenizer "
                      "(--draft-model). Default: off."),
    click.option("--draft-model", envvar="LLMQ_DRAFT_MODEL", default=None,
                 help="draft: the draft model, a .gguf file or a Hugging Face folder sharing "
                      "the model's vocabulary (e.g. SmolLM2-135M for a larger SmolLM2)."),
    click.option("--num-speculative-tokens", envvar="LLMQ_NUM_SPECULATIVE_TOKENS",
                 type=click.IntRange(1, 32), default=4, show_default=True,
                 help="The most draft tokens verified per step (each request adapts its own "
                      "count to its acceptance)."),
    click.option("--prompt-lookup-max", envvar="LLMQ_PROMPT_LOOKUP_MAX",
                 type=click.IntRange(1, 16), default=3, show_default=True,
                 help="ngram: the longest n-gram a draft is looked up by."),
    click.option("--prompt-lookup-min", envvar="LLMQ_PROMPT_LOOKUP_MIN",
                 type=click.IntRange(1, 16), default=2, show_default=True,
                 help="ngram: the shortest n-gram a draft is looked up by."),
    click.option("--lora-dir", envvar="LLMQ_LORA_DIR", default=None,
                 type=click.Path(file_okay=False),
                 help="LoRA adapters, one per subfolder (PEFT: adapter_config.json + "
                      "adapter_model.safetensors) or <name>.gguf (llama.cpp); a request names "
                      "one in `lora`. Default: none served."),
    click.option("--max-loras", envvar="LLMQ_MAX_LORAS", type=click.IntRange(min=1), default=4,
                 show_default=True,
                 help="LoRA adapters kept loaded (the least recently used is evicted)."),
    click.option("--max-lora-rank", envvar="LLMQ_MAX_LORA_RANK", type=click.IntRange(min=1),
                 default=64, show_default=True,
                 help="The largest LoRA rank accepted (a larger adapter is refused)."),
    click.option("--batch-invariant", envvar="LLMQ_BATCH_INVARIANT", is_flag=True,
                 default=False,
                 help="Every request's tokens and logprobs bitwise the same whatever shares "
                      "its step, however its prompt was chunked, with or without a prefix-"
                      "cache hit (a batch job killed and rerun gives the same output); "
                      "slower prefill: docs/operations.md."),
])

ENGINE_FIELDS = ("model", "dtype", "weights", "threads", "max_num_seqs", "max_num_batched_tokens",
                 "max_batch_prefill_tokens", "max_model_len", "block_size",
                 "kv_cache_memory_bytes", "scheduling_policy",
                 "speculative_method", "draft_model", "num_speculative_tokens",
                 "prompt_lookup_max", "prompt_lookup_min", "lora_dir", "max_loras", "max_lora_rank",
                 "batch_invariant")


def engine_config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the engine flags out of a command's kwargs, ready for EngineConfig(**...)."""
    return {name: kwargs.pop(name) for name in ENGINE_FIELDS}


sampling_options = _apply([
    click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                 help="Default 256, or fewer when the model's context leaves less room."),
    click.option("--temperature", type=click.FloatRange(min=0), default=None,
                 help="0 is greedy. Default 1.0."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None),
    click.option("--top-k", type=click.IntRange(min=0), default=None, help="0 disables."),
    click.option("--min-p", type=click.FloatRange(min=0, max=1), default=None),
    click.option("--seed", type=click.IntRange(min=0), default=None),
    click.option("--stop", multiple=True, help="A stop string (repeatable)."),
    click.option("--ignore-eos", is_flag=True, default=False),
    click.option("-n", "n", type=click.IntRange(min=1), default=None,
                 help="Completions of the prompt, sampled side by side. Default 1."),
    click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="K",
                 help="Log-probabilities of each sampled token and its top K alternatives."),
    click.option("--json-schema", type=click.File("r"), default=None, metavar="FILE",
                 help="The output is JSON that this JSON schema (a file) accepts."),
    click.option("--regex", default=None, help="The output matches this regular expression."),
    click.option("--choice", multiple=True,
                 help="The output is one of these strings (repeatable)."),
])

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "ignore_eos", "n", "logprobs")


def sampling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the sampling flags the user set (unset ones keep the protocol's defaults); the
    constraint flags become the wire's `response_format` or `guided`."""
    picked = {name: kwargs.pop(name) for name in SAMPLING_FIELDS}
    params = {k: v for k, v in picked.items() if v is not None and v != () and v is not False}
    schema_file, regex, choices = (kwargs.pop("json_schema"), kwargs.pop("regex"),
                                   kwargs.pop("choice"))
    given = [flag for flag, value in (("--json-schema", schema_file), ("--regex", regex),
                                      ("--choice", choices)) if value]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} both constrain the output: give one")
    if schema_file is not None:
        try:
            schema = json.load(schema_file)
        except ValueError as exc:
            raise click.BadParameter(f"{schema_file.name} is not JSON: {exc}",
                                     param_hint="--json-schema") from None
        params["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "response", "schema": schema}}
    elif regex is not None:
        params["guided"] = {"regex": regex}
    elif choices:
        params["guided"] = {"choice": list(choices)}
    return params
