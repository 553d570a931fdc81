"""OpenAI request bodies -> llmq requests, for the HTTP routes and for batch file lines alike.

Each endpoint's body is a msgspec Struct: `ChatCompletionBody` (`messages`: string content or
text parts) for /v1/chat/completions, `CompletionBody` (`prompt`: one string, or one list of token
ids) for /v1/completions, both on `OpenAIBody`, the fields the two share. An HTTP body is decoded
from its bytes by a long-lived typed decoder (`decode_body`); a batch line's, parsed already with
its line, is converted into the same Struct (`parse_body`).

Sampling fields carry the llmq request's names and pass onto it as they are
(`max_completion_tokens` is `max_tokens`; vLLM's extras `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`, `include_stop_str_in_output`, llmq's
`speculative` too; chat: `chat_template_kwargs`, `add_generation_prompt`); `user` and `metadata`
ride in the request's `metadata`. `n` (completions over one prefill) passes as it is; the
output constraints (`response_format`, vLLM's `structured_outputs` and `guided_*`, llmq's
`guided`) become the wire's `response_format` or `guided` (gateway/structured_outputs.py).
`logit_bias` (token ids as strings, OpenAI's shape) becomes the wire's map of ids; vLLM's
`allowed_token_ids`, `bad_words`, `prompt_logprobs` (not with `stream`, as vLLM refuses it),
chat's `continue_final_message` and completions' `add_special_tokens` pass as they are (chat
takes `add_special_tokens: false`, what it does anyway). `echo` with `logprobs` or
`max_tokens: 0` asks for the prompt's logprobs (gateway/echo.py). A
field llmq cannot honour (`best_of`, `functions`...) is refused, and so is a field no Struct
declares: never silently ignored. The whole request is then checked by the worker's own decoder,
so what passes here runs there, and the bounds (`temperature` <= 2, `n` <= 64...) live in one
place, the wire contract (llmq.protocol.requests): the Structs check types.

To take a new OpenAI or vLLM field: declare it, typed and defaulting to None, on the Struct of
each endpoint that has it, and map it onto the llmq request in that Struct's `llmq_request`.

References: https://platform.openai.com/docs/api-reference/chat/create and /completions/create;
vLLM's entrypoints/openai/protocol.py (`ChatCompletionRequest`, `CompletionRequest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta, Struct

from llmq.broker.commands import build_submission
from llmq.gateway.body_errors import BodyError, decode_error, path_of
from llmq.gateway.echo import EchoError, EchoPlan, plan_echo
from llmq.gateway.structured_outputs import ConstraintError, StructuredOutputs, constraint_of
from llmq.gateway.tool_calls import ToolCallError, grammar_for
from llmq.protocol import MAX_LOGPROBS
from llmq.protocol.errors import InvalidRequest

__all__ = ["CHAT", "COMPLETIONS", "BodyError", "ChatCompletionBody", "ChatMessage",
           "CompletionBody", "Endpoint", "OpenAIBody", "OpenAIRequest", "decode_body",
           "llmq_message", "llmq_prompts", "parse_body"]

COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
Endpoint = Literal["/v1/completions", "/v1/chat/completions"]

# OpenAI body fields that are llmq request fields of the same name.
_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
             "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
             "ignore_eos", "stop_token_ids", "priority", "include_stop_str_in_output",
             "allowed_token_ids", "bad_words", "prompt_logprobs", "speculative")
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]


@dataclass(frozen=True)
class OpenAIRequest:
    endpoint: Endpoint
    request: dict[str, Any]  # the llmq request fields, without `id` and `stream`
    model: str | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: int | None = None  # None: no log-probabilities; n: the sampled token's + top n
    n: int = 1  # completions: the response has choices 0..n-1
    tool_calls: bool = False  # the output is read as tool calls (gateway/tool_calls.py)
    more_prompts: tuple[dict[str, Any], ...] = ()  # completions: the requests of prompts 1...
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    echo: bool = False  # completions: each choice's text begins with its prompt
    echo_plan: EchoPlan | None = None  # completions: how a whole answer's echo is reshaped


# -- the bodies -----------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    """`stream_options`: usage at the end, and with vLLM's `continuous_usage_stats` on every
    chunk (the tokens so far)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's: accepted, llmq sends no padding


class OpenAIBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """The body fields both endpoints take (types only: the worker's decoder checks bounds)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    response_format: dict[str, Any] | None = None  # checked as the wire's ResponseFormat
    # vLLM's and llmq's output constraints (gateway/structured_outputs.py)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided: dict[str, Any] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    speculative: bool | None = None  # llmq's: false never drafts (docs/protocol.md)
    # the response's shape, and what rides along
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # accepted, with no effect on the generated text
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # chat only (gateway/tool_calls.py); on /v1/completions refused unless empty or null
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # refused unless empty or null: OpenAI's deprecated functions
    functions: list[Any] | None = None

    # Fields a batch line refuses like undeclared ones: those that shape an HTTP response (the
    # batch output has no place for them; `stream` is taken when false), and `tool_choice`.
    not_in_batch: ClassVar[tuple[str, ...]] = ("stream_options", "tool_choice")

    def llmq_request(self) -> dict[str, Any]:
        """The llmq request's fields (without `id`, `stream` and `metadata`); BodyError for a
        field llmq cannot honour."""
        if self.functions:
            raise BodyError("`functions` is not supported", "functions")
        request = {name: value for name in _SAMPLING if (value := getattr(self, name)) is not None}
        if self.logit_bias:
            request["logit_bias"] = _logit_bias(self.logit_bias)
        if self.prompt_logprobs is not None and self.stream:
            raise BodyError("`prompt_logprobs` are not available when `stream` is true",
                            "prompt_logprobs")
        if self.n is not None and self.n != 1:
            request["n"] = self.n
        try:
            request.update(constraint_of(
                response_format=self.response_format, structured_outputs=self.structured_outputs,
                guided=self.guided, guided_json=self.guided_json, guided_regex=self.guided_regex,
                guided_choice=self.guided_choice, guided_grammar=self.guided_grammar))
        except ConstraintError as exc:
            raise BodyError(str(exc), exc.param) from None
        try:
            request.update(self.tool_fields("guided" in request or "response_format" in request))
        except ToolCallError as exc:
            raise BodyError(str(exc), exc.param) from None
        return request

    def tool_fields(self, constrained: bool) -> dict[str, Any]:
        """The wire fields for `tools` and `tool_choice` (here: none; chat takes tools)."""
        if self.tools:
            raise BodyError("`tools` are only for /v1/chat/completions", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise BodyError("`tool_choice` needs `tools`", "tool_choice")
        return {}

    def reads_tool_calls(self) -> bool:
        """Whether the output is read as tool calls (`tool_choice` other than none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def logprobs_count(self) -> int | None:
        """Log-probabilities to return: None for none, n for the sampled token's and the top n."""
        return None

    def param_of(self, llmq_field: str) -> str:
        """The body field an llmq request field came from."""
        return llmq_field


def _logit_bias(biases: dict[str, float]) -> dict[str, float]:
    """OpenAI's `logit_bias`, its keys checked to be token ids (JSON keys, as on the wire)."""
    if bad := [token_id for token_id in biases if not token_id.isdigit()]:
        raise BodyError(f"`logit_bias` keys are token ids, got {bad[0]!r:.40}", "logit_bias")
    return {str(int(token_id)): bias for token_id, bias in biases.items()}


class ContentPart(Struct, kw_only=True):
    """One part of a message's content; only `text` parts carry meaning here."""

    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    """One chat message; other keys (`refusal`, `audio`...) are ignored."""

    role: str  # the worker's decoder checks it is one it renders
    content: str | list[ContentPart] | None = None
    # an assistant turn's calls, a tool turn's answer to one (checked by the wire's Message)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionBody(OpenAIBody, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's new name for max_tokens
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables
    add_generation_prompt: bool | None = None  # vLLM's: false, no assistant turn is opened
    continue_final_message: bool | None = None  # vLLM's: the last message is continued
    # vLLM's (default false): the rendered template is tokenized as it is, as here; true
    # (BOS again before the template's own) the wire has no way to ask for
    add_special_tokens: bool | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None

    # NOTE: `tools` too: a batch output line is not read for tool calls (yet).
    not_in_batch: ClassVar[tuple[str, ...]] = (*OpenAIBody.not_in_batch, "logprobs",
                                               "top_logprobs", "tools")

    def llmq_request(self) -> dict[str, Any]:
        request = super().llmq_request()
        if self.max_completion_tokens is not None:
            request["max_tokens"] = self.max_completion_tokens
        request["messages"] = [llmq_message(i, m) for i, m in enumerate(self.messages)]
        if self.chat_template_kwargs:
            request["chat_template_kwargs"] = self.chat_template_kwargs
        if self.add_generation_prompt is False:
            request["add_generation_prompt"] = False
        if self.continue_final_message:
            request["continue_final_message"] = True
        if self.add_special_tokens:
            raise BodyError("`add_special_tokens: true` is not supported for chat: the chat "
                            "template's text is tokenized as it is (vLLM's default, false)",
                            "add_special_tokens")
        if (logprobs := self.logprobs_count()) is not None:
            request["logprobs"] = logprobs
        return request

    def tool_fields(self, constrained: bool) -> dict[str, Any]:
        if not self.tools:
            return super().tool_fields(constrained)
        grammar = grammar_for(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        if grammar is None:
            return {"tools": self.tools}
        if constrained:
            raise ToolCallError("`tool_choice` constrains the output to tool calls, and so does "
                                "a response format or guided decoding: give one", "tool_choice")
        return {"tools": self.tools, "guided": {"grammar": grammar}}

    def logprobs_count(self) -> int | None:
        if self.logprobs:
            return self.top_logprobs or 0
        if self.top_logprobs is not None:
            raise BodyError("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return None

    def param_of(self, llmq_field: str) -> str:
        if llmq_field.startswith("max_tokens") and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return llmq_field


def llmq_message(index: int, message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        if not all(part.type == "text" and part.text is not None for part in content):
            raise BodyError(f"messages[{index}]: only text content parts are supported",
                            f"messages[{index}].content")
        content = "".join(part.text or "" for part in content)
    fields = {"tool_calls": message.tool_calls, "tool_call_id": message.tool_call_id,
              "name": message.name}
    return {"role": message.role, "content": content,
            **{name: value for name, value in fields.items() if value is not None}}


# `prompt`: a string, token ids, or a list of one of those (the OpenAI client's batch shape).
Prompt = str | list[str | int | list[int]]


class CompletionBody(OpenAIBody, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /v1/completions."""

    prompt: Prompt
    logprobs: LogprobCount | None = None
    echo: bool | None = None  # the prompt begins each choice's text (string prompts)
    add_special_tokens: bool | None = None  # vLLM's: false adds no BOS to a string prompt
    # accepted at the value that changes nothing
    best_of: int | None = None
    suffix: str | None = None

    not_in_batch: ClassVar[tuple[str, ...]] = (*OpenAIBody.not_in_batch, "logprobs", "echo",
                                               "best_of", "suffix")

    def llmq_request(self) -> dict[str, Any]:
        for name, harmless in (("best_of", 1), ("suffix", "")):
            if getattr(self, name) not in (None, harmless):
                raise BodyError(f"`{name}` is not supported", name)
        request = super().llmq_request()
        request.update(llmq_prompts(self.prompt)[0])
        request.update(self.echo_plan()[0])
        if self.add_special_tokens is False and "prompt" in request:
            request["add_special_tokens"] = False
        if self.logprobs is not None:
            request["logprobs"] = self.logprobs
        return request

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def echo_plan(self) -> tuple[dict[str, Any], EchoPlan | None]:
        """The wire fields `echo` adds (gateway/echo.py), and how the answer is reshaped."""
        try:
            return plan_echo(echo=bool(self.echo), logprobs=self.logprobs,
                             prompt_logprobs=self.prompt_logprobs, max_tokens=self.max_tokens,
                             stream=bool(self.stream), token_ids=not isinstance(
                                 self.prompt, str) and not all(isinstance(one, str)
                                                               for one in self.prompt))
        except EchoError as exc:
            raise BodyError(str(exc), exc.param) from None

    def param_of(self, llmq_field: str) -> str:
        return "prompt" if llmq_field.startswith("prompt_token_ids") else llmq_field


def llmq_prompts(prompt: Prompt) -> list[dict[str, Any]]:
    """Each prompt of `prompt` as llmq request fields: a string, token ids, or a list of
    either (several prompts, as the OpenAI client sends a batch of them)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if prompt and all(isinstance(token, int) for token in prompt):
        return [{"prompt_token_ids": prompt}]
    if prompt and all(isinstance(one, str) for one in prompt):
        return [{"prompt": one} for one in prompt]
    if prompt and all(isinstance(one, list) and one and all(isinstance(t, int) for t in one)
                      for one in prompt):
        return [{"prompt_token_ids": one} for one in prompt]
    raise BodyError("`prompt` must be a string, a list of token ids, or a list of either",
                    "prompt")


# -- decoding -------------------------------------------------------------------------------------

_BODIES: dict[str, type[ChatCompletionBody] | type[CompletionBody]] = {
    CHAT: ChatCompletionBody, COMPLETIONS: CompletionBody}
_decoders: dict[str, msgspec.json.Decoder[ChatCompletionBody]
                | msgspec.json.Decoder[CompletionBody]] = {
    CHAT: msgspec.json.Decoder(ChatCompletionBody),
    COMPLETIONS: msgspec.json.Decoder(CompletionBody)}


def decode_body(endpoint: Endpoint, raw: bytes) -> OpenAIRequest:
    """An HTTP request's JSON body, validated as the worker will; BodyError saying why not."""
    try:
        body = _decoders[endpoint].decode(raw)
    except msgspec.ValidationError as exc:
        raise decode_error(str(exc), endpoint) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    return _translate(endpoint, body, batch=False)


def parse_body(endpoint: str, body: Any, *, batch: bool = False) -> OpenAIRequest:
    """A body already parsed from JSON (a batch file line's), validated as the worker will;
    BodyError saying why not.

    `batch`: a line of a batch file, whose output format has no place for what shapes an HTTP
    response: the body's `not_in_batch` fields are refused, `stream` unless false, and `user`
    and `metadata` are ignored.
    """
    if endpoint not in _BODIES:
        raise BodyError(f"`url` must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    known: Endpoint = CHAT if endpoint == CHAT else COMPLETIONS
    try:
        decoded = msgspec.convert(body, _BODIES[known])
    except msgspec.ValidationError as exc:
        raise decode_error(str(exc), known) from None
    return _translate(known, decoded, batch)


def _translate(endpoint: Endpoint, body: ChatCompletionBody | CompletionBody,
               batch: bool) -> OpenAIRequest:
    if batch:
        if body.stream:
            raise BodyError("`stream` must be false in a batch", "stream")
        for name in body.not_in_batch:
            if getattr(body, name) is not None:
                raise BodyError(f"body field `{name}` is not supported for {endpoint}", name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(include_usage and body.stream_options
                      and body.stream_options.continuous_usage_stats)
    if include_usage and not body.stream:
        raise BodyError("`stream_options` is only allowed with `stream: true`", "stream_options")
    request = body.llmq_request()
    if not batch:
        riders = {"user": body.user, "metadata": body.metadata}
        if metadata := {name: value for name, value in riders.items() if value is not None}:
            request["metadata"] = metadata
    try:
        build_submission(request)  # the worker's own decoder
    except InvalidRequest as exc:
        field = path_of(str(exc))
        raise BodyError(str(exc), None if field is None else body.param_of(field)) from None
    more: list[dict[str, Any]] = []
    if isinstance(body, CompletionBody) and len(prompts := llmq_prompts(body.prompt)) > 1:
        if batch or body.stream:
            raise BodyError("several prompts in one body are answered whole, not streamed nor "
                            "in a batch (one prompt per line): send one request per prompt",
                            "prompt")
        more = [{**request, **prompt} for prompt in prompts[1:]]
        for index, one in enumerate(more, 1):
            try:
                build_submission(one)
            except InvalidRequest as exc:
                raise BodyError(f"prompt[{index}]: {exc}", "prompt") from None
    return OpenAIRequest(endpoint, request, body.model, bool(body.stream), include_usage,
                         body.logprobs_count(), request.get("n", 1), body.reads_tool_calls(),
                         tuple(more), continuous, bool(getattr(body, "echo", False)),
                         body.echo_plan()[1] if isinstance(body, CompletionBody) else None)
