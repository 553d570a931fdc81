"""`echo` with `logprobs` and `max_tokens: 0` as the gateway queues it and reshapes the answer
(gateway/echo.py), without a server: the request fields and the answer's logprobs."""

from __future__ import annotations

from llmq.gateway.openai_request import COMPLETIONS, decode_body
from llmq.protocol import Done, Timings, TokenLogprob, Usage


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_and_max_tokens_0_runs_one():
    parsed = decode_body(COMPLETIONS, b'{"prompt": "Hi there", "echo": true, "logprobs": 2, '
                                      b'"max_tokens": 0}')
    assert parsed.request["prompt_logprobs"] == 2 and parsed.request["max_tokens"] == 1
    assert parsed.echo_plan is not None and parsed.echo_plan.prompt_only
    plain = decode_body(COMPLETIONS, b'{"prompt": "Hi", "echo": true}')
    assert "prompt_logprobs" not in plain.request


def test_the_prompts_tokens_precede_the_completions_with_offsets_after_its_text():
    # Given a prompt "Hi there" of tokens "Hi" " there", and a completion "!" after it
    plan = decode_body(COMPLETIONS, b'{"prompt": "Hi there", "echo": true, "logprobs": 1}'
                       ).echo_plan
    done = Done(request_id="r", attempt=1, finish_reason="length", text="!",
                usage=Usage(2, 1), timings=Timings(0.0, None, 0.0, None),
                prompt_logprobs=[None, TokenLogprob(7, -1.5, [9], [-0.5], " there", [" sea"],
                                                    rank=2)])
    body = {"choices": [{"index": 0, "text": "Hi there!", "finish_reason": "length",
                         "logprobs": {"tokens": ["!"], "token_logprobs": [-0.25],
                                      "top_logprobs": [{"!": -0.25}], "text_offset": [0]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    assert plan is not None
    logprobs = plan.apply(body, done, "Hi there")["choices"][0]["logprobs"]
    # Then the first token's text is what the others leave of the prompt, with null logprobs
    assert logprobs == {"tokens": ["Hi", " there", "!"], "token_logprobs": [None, -1.5, -0.25],
                        "top_logprobs": [None, {" sea": -0.5, " there": -1.5}, {"!": -0.25}],
                        "text_offset": [0, 2, 8]}
