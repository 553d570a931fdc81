"""A batch step under LoRA adapters paused for an interactive request (worker/engine/
step_interrupt.py): the steps beside it set their own adapters, and it resumes under its own,
so every request still gets the tokens it gets alone."""

from __future__ import annotations

from llmq.protocol import Request
from llmq.worker.engine.input_processor import InputProcessor
from tests.engine.test_step_pauses import Run
from tests.fixtures.models import one_torch_thread
from tests.model.test_lora import NEW_TOKENS, _engine, _run, lora_setup, prompts  # noqa: F401


def test_a_paused_step_under_adapters_resumes_under_them_after_other_adapters_ran(
        lora_setup, prompts) -> None:  # noqa: F811 - the fixtures imported above
    one_torch_thread()
    base, loras = lora_setup
    engine = _engine(base, loras)
    # Given batch requests under two adapters and the base model, two interactive ones under
    # a third adapter and the base model, and what each gets alone
    batch = {"b-full": (prompts[0], "full"), "b-qv": (prompts[1], "qv"),
             "b-base": (prompts[2], None)}
    online = {"o-wide": (prompts[1], "wide"), "o-base": (prompts[0], None)}
    alone = {name: _run(engine, [request])[0].new_token_ids
             for name, request in {**batch, **online}.items()}
    gate = InputProcessor.for_engine(engine)

    def add(name: str, prompt: list[int], lora: str | None, *, is_batch: bool) -> None:
        processed = gate.process(Request(prompt_token_ids=prompt, lora=lora, temperature=0.0,
                                         max_tokens=NEW_TOKENS, ignore_eos=True))
        engine.add_request(name, processed.prompt_token_ids, processed.sampling_params,
                           batch=is_batch)

    run = Run(engine, 0)
    for name, (prompt, lora) in batch.items():
        add(name, prompt, lora, is_batch=True)
    # When a batch step pauses after its first layer for each interactive request
    for name, (prompt, lora) in online.items():
        run.pause_a_step()
        add(name, prompt, lora, is_batch=False)
        while (name, 0) not in run.tokens:
            run.step()
    run.finish()
    # Then the paused steps resumed (none dropped) and every request got what it gets alone
    assert engine.step_interrupt.num_paused == 2 and engine.step_interrupt.num_dropped == 0
    for name, tokens in alone.items():
        assert run.outputs(name, 1) == [tokens], name
