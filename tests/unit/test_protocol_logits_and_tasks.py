"""The wire's logits extras and tasks: what a producer may send, and the errors naming the field
when it may not (checked by the same decoder the worker uses)."""

from __future__ import annotations

import pytest

from llmq.protocol import parse_request
from llmq.protocol.errors import InvalidRequest


def parse(body: str):
    return parse_request(body.encode(), "json")


def test_logits_extras_reach_the_engines_params() -> None:
    request = parse('{"prompt": "Hi", "logit_bias": {"7": -100, "3": 2.5}, '
                    '"allowed_token_ids": [3, 7], "bad_words": ["sea"], "prompt_logprobs": 2}')
    kwargs = request.sampling_kwargs()
    assert kwargs["logit_bias"] == ((3, 2.5), (7, -100.0))
    assert kwargs["allowed_token_ids"] == (3, 7)
    assert kwargs["bad_words"] == ("sea",)
    assert kwargs["prompt_logprobs"] == 2 and kwargs["task"] == "generate"


@pytest.mark.parametrize(("body", "says"), [
    ('{"prompt": "Hi", "logit_bias": {"7": 100.5}}', "`$.logit_bias[...]`"),
    ('{"prompt": "Hi", "logit_bias": {"x": 1}}', "in `$.logit_bias`"),
    ('{"prompt": "Hi", "allowed_token_ids": []}', "`$.allowed_token_ids`"),
    ('{"prompt": "Hi", "bad_words": [""]}', "`$.bad_words[0]`"),
    ('{"prompt": "Hi", "prompt_logprobs": 21}', "`$.prompt_logprobs`"),
    ('{"prompt": "Hi", "task": "classify"}', "`$.task`"),
    ('{"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": true}',
     "`add_generation_prompt` false"),
    ('{"prompt": "Hi", "continue_final_message": true}',
     "`continue_final_message` needs `messages`"),
    ('{"prompt_token_ids": [1], "add_special_tokens": false}', "applies to `prompt` only"),
    ('{"prompt": "Hi", "task": "detokenize"}', "detokenize needs `prompt_token_ids`"),
    ('{"prompt_token_ids": [1], "task": "tokenize"}', "tokenize needs `prompt` or `messages`"),
    ('{"prompt": "Hi", "task": "embed", "n": 2, "logprobs": 1}', "drop `logprobs`, `n`"),
])
def test_bad_values_are_refused_naming_the_field(body: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    assert says in str(info.value)
