"""`llmq generate`: the engine in-process, no Redis (like vLLM's offline `LLM.generate`)."""

from __future__ import annotations

import sys

import click

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
def generate(prompt: str | None, chat: str | None, file, output, **kwargs) -> None:
    """Generate in-process: stream one PROMPT (or --chat message), or run a JSONL file (-f)."""
    if sum(x is not None for x in (prompt, chat, file)) != 1:
        raise click.UsageError("give exactly one of PROMPT, --chat TEXT or -f FILE")
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.engine_core import EngineCore
    from llmq.worker.engine.sampling_params import SamplingParams

    try:
        config = EngineConfig(**engine_config_kwargs(kwargs))
        params = SamplingParams(**sampling_kwargs(kwargs))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    engine = EngineCore(config)
    if file is not None:
        from llmq.cli.generate_file import run_file
        run_file(engine, file, output)
        return
    if chat is not None:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": chat}])
    token_ids = engine.tokenizer.encode(prompt)
    engine.add_request("generate", token_ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finish_reason == "error":
                raise click.ClickException(f"{out.error_code}: {out.error_message}")
    sys.stdout.write("\n")
