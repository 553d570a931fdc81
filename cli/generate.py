"""`llmq generate`: the engine in-process, no Redis (like vLLM's offline `LLM.generate`).

A prompt goes through the same gate as a request read from Redis (the wire decoder, then the
worker's `InputProcessor`), so it is refused here exactly as a worker would refuse it.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import click
import msgspec

from llmq.cli.options import engine_config_kwargs, engine_options, sampling_kwargs, sampling_options


@click.command()
@click.argument("prompt", required=False)
@click.option("--chat", "chat", metavar="TEXT",
              help="A user message, rendered with the model's chat template.")
@click.option("-f", "--file", "file", type=click.File("r"),
              help="JSONL of wire-format requests; each line carries its own sampling fields.")
@click.option("-o", "--output", type=click.File("w"), default="-",
              help="Where -f results go (JSONL).")
@engine_options
@sampling_options
def generate(prompt: str | None, chat: str | None, file: TextIO | None, output: TextIO,
             **kwargs: Any) -> None:
    """Generate in-process: stream one PROMPT (or --chat message), or run a JSONL file (-f)."""
    if sum(x is not None for x in (prompt, chat, file)) != 1:
        raise click.UsageError("give exactly one of PROMPT, --chat TEXT or -f FILE")
    from llmq.protocol import parse_request
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore
    from llmq.worker.engine.input_processor import InputProcessor

    body = ({"prompt": prompt} if chat is None
            else {"messages": [{"role": "user", "content": chat}]})
    try:
        config = EngineConfig(**engine_config_kwargs(kwargs))
        # NOTE: parsed before the model loads, so a bad flag costs nothing.
        request = None if file is not None else parse_request(
            msgspec.json.encode({**body, **sampling_kwargs(kwargs)}), "json")
    except ValueError as e:  # InvalidRequest included
        raise click.BadParameter(str(e)) from None
    try:
        engine = EngineCore(config)
    except ValueError as e:  # a model or draft model that cannot be served
        raise click.ClickException(str(e)) from None
    if file is not None:
        from llmq.cli.generate_file import run_file
        run_file(engine, file, output)
        return
    assert request is not None
    processed = InputProcessor.for_engine(engine).process(request)
    engine.add_request("generate", processed.prompt_token_ids, processed.sampling_params,
                       priority=processed.priority)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finish_reason == "error":
                raise click.ClickException(f"{out.error_code}: {out.error_message}")
    sys.stdout.write("\n")
