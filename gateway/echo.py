"""`echo` on /v1/completions beyond its text: with `logprobs`, and with `max_tokens: 0`.

As OpenAI's legacy completions and vLLM answer it (lm-eval's loglikelihood requests rest on it):
each choice's `logprobs.tokens` / `token_logprobs` / `top_logprobs` / `text_offset` begin with
the prompt's tokens, the first one's log-probability and alternatives null (nothing comes before
it), then continue with the completion's, whose offsets follow the prompt's text. The prompt's
come from the wire's `prompt_logprobs` (the worker scores the prompt in one pass), asked for
with the body's `logprobs` count; the vLLM-shaped `prompt_logprobs` of the choice stay only when
the body asked for them itself. `max_tokens: 0` (vLLM takes it with `echo`) runs one token, which
the answer leaves out: the text is the prompt, its logprobs the prompt's, `completion_tokens` 0.

Only whole answers: vLLM refuses `prompt_logprobs` on a stream, and a stream with `echo` sends
the prompt's text alone (a token-id prompt has none there: the gateway has no tokenizer). The
text of a token-id prompt is the worker's detokenization of it (gateway/completions.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmq.protocol import Done, TokenLogprob
from llmq.protocol.token_text import token_bytes, token_text

__all__ = ["EchoError", "EchoPlan", "plan_echo"]

_NEG_INF = -9999.0  # what OpenAI reports for a log-probability of -inf (as openai_response.py)


class EchoError(ValueError):
    """A body whose `echo` cannot be answered; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EchoPlan:
    """How a whole completions answer with `echo` is reshaped (`apply`)."""

    logprobs: bool = False  # the prompt's logprobs precede the completion's
    prompt_only: bool = False  # max_tokens 0: the prompt alone is the answer
    keep_prompt_logprobs: bool = False  # the body asked for vLLM's `prompt_logprobs` itself

    def apply(self, body: dict[str, Any], done: Done, echo: str) -> dict[str, Any]:
        """The `text_completion` object `body` (with `echo` before each text) reshaped."""
        prompt = None
        if self.logprobs and done.prompt_logprobs is not None:
            prompt = _prompt_logprobs(done.prompt_logprobs, echo)
        for choice in body["choices"]:
            if self.prompt_only:
                choice.update(text=echo, finish_reason="length")
            if prompt is not None:
                choice["logprobs"] = _joined(prompt, None if self.prompt_only
                                             else choice.get("logprobs"), len(echo))
            if not self.keep_prompt_logprobs:
                choice.pop("prompt_logprobs", None)
        if self.prompt_only:
            usage = body["usage"]
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return body


def plan_echo(*, echo: bool, logprobs: int | None, prompt_logprobs: int | None,
              max_tokens: int | None, stream: bool, token_ids: bool
              ) -> tuple[dict[str, Any], EchoPlan | None]:
    """(the wire fields `echo` adds or overrides, the plan for the answer); EchoError for a
    body whose echo cannot be answered. `token_ids`: a prompt is token ids."""
    if max_tokens == 0 and not echo:
        raise EchoError("`max_tokens` must be >= 1 (0 only with `echo`, for the prompt's "
                        "logprobs)", "max_tokens")
    if not echo:
        return {}, None
    if stream and (logprobs is not None or max_tokens == 0 or token_ids):
        raise EchoError("`echo` with `logprobs`, `max_tokens: 0` or token-id prompts is not "
                        "available when `stream` is true (prompt logprobs are not streamed)",
                        "echo")
    fields: dict[str, Any] = {}
    if logprobs is not None:
        fields["prompt_logprobs"] = max(logprobs, prompt_logprobs or 0)
    if max_tokens == 0:
        fields["max_tokens"] = 1  # the wire runs at least one token; the answer drops it
    return fields, EchoPlan(logprobs is not None, max_tokens == 0, prompt_logprobs is not None)


@dataclass(frozen=True)
class _PromptLogprobs:
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _prompt_logprobs(entries: list[TokenLogprob | None], echo: str) -> _PromptLogprobs:
    """The prompt's tokens in completions' logprobs shape. The first token has no entry: its
    text is what the others' leave of the prompt's text."""
    names = ["" if e is None else e.token or f"token_id:{e.token_id}" for e in entries]
    rest = b"".join(token_bytes(name) for name in names[1:])
    whole = echo.encode()
    if entries and whole.endswith(rest):
        names[0] = token_text(whole[:len(whole) - len(rest)])
    offsets, offset = [], 0
    for name in names:
        offsets.append(offset)
        offset += len(token_bytes(name).decode(errors="replace"))
    tops: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            tops.append(None)
            continue
        top_names = entry.top_tokens or [f"token_id:{t}" for t in entry.top_token_ids]
        top = {name: _finite(v) for name, v in zip(top_names, entry.top_logprobs, strict=False)}
        top.setdefault(names[len(tops)], _finite(entry.logprob))  # vLLM: the token is among them
        tops.append(top)
    return _PromptLogprobs(names, [None if e is None else _finite(e.logprob) for e in entries],
                           tops, offsets)


def _finite(value: float | None) -> float:
    return _NEG_INF if value is None else max(value, _NEG_INF)


def _joined(prompt: _PromptLogprobs, completion: dict[str, Any] | None,
            echo_length: int) -> dict[str, Any]:
    """The prompt's logprobs, then the completion's with its offsets after the prompt's text."""
    after = completion or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    return {"tokens": prompt.tokens + after["tokens"],
            "token_logprobs": prompt.token_logprobs + after["token_logprobs"],
            "top_logprobs": prompt.top_logprobs + after["top_logprobs"],
            "text_offset": prompt.text_offset + [echo_length + o for o in after["text_offset"]]}
