"""Requests answered from the prompt (embed, tokenize, detokenize), prompt logprobs, and vLLM's
logits extras (logit_bias, allowed_token_ids, bad_words), through the one gate and the real
engine (tiny random Llama, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from llmq.protocol import Message, Request
from llmq.protocol.errors import ErrorCode, RequestRejected
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.outputs import EngineCoreOutput


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_model_path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_path), dtype="float32",
                                   num_kv_blocks=256), loaded=tiny_model)


def run(engine: EngineCore, request: Request) -> EngineCoreOutput:
    """The request through the gate and the engine; its finished output (choice 0)."""
    processed = InputProcessor.for_engine(engine).process(request)
    request_id = f"r{id(request)}"
    engine.add_request(request_id, processed.prompt_token_ids, processed.sampling_params)
    for _ in range(500):
        for output in engine.step():
            if output.request_id == request_id and output.finished and output.index == 0:
                return output
    raise AssertionError("the request never finished")


def generated(engine: EngineCore, **fields) -> list[int]:
    processed = InputProcessor.for_engine(engine).process(Request(**fields))
    (out,) = engine.generate([processed.prompt_token_ids], processed.sampling_params)
    return out.new_token_ids


def pairs(tokens: list[int]) -> set[tuple[int, int]]:
    return set(zip(tokens, tokens[1:], strict=False))


PROMPT_IDS = [100 + (j * 37) % 400 for j in range(40)]


def test_an_embedding_is_the_last_final_hidden_state_at_unit_length(engine, tiny_model):
    # Given a prompt of 40 token ids, and a model that names no pooling (vLLM's default for a
    # generative model then: the last token, normalised; tests/engine/test_pooling.py has the
    # others)
    # When it is embedded
    out = run(engine, Request(prompt_token_ids=PROMPT_IDS, task="embed"))
    # Then the vector has the model's width and unit length, and is the model's own final
    # hidden state at the last position, normalised
    assert out.finish_reason == "stop" and out.usage.prompt_tokens == 40
    assert out.usage.completion_tokens == 0
    vector = torch.tensor(out.embedding)
    assert vector.shape == (tiny_model.arch.hidden_size,)
    assert math.isclose(float(vector.norm()), 1.0, rel_tol=1e-5)
    model = tiny_model.model
    hidden = model.forward_contiguous(torch.tensor(PROMPT_IDS), 0,
                                      model.make_contiguous_cache(40))
    expected = torch.nn.functional.normalize(hidden.float()[-1], dim=0)
    assert torch.allclose(vector, expected, atol=1e-5)


def test_an_embedding_does_not_depend_on_other_work_in_the_engine(engine):
    # Given an embedding computed alone
    alone = run(engine, Request(prompt_token_ids=PROMPT_IDS, task="embed")).embedding
    # When the same prompt is embedded while generations run
    for i in range(3):
        engine.add_request(f"busy-{i}", PROMPT_IDS[i:], InputProcessor.for_engine(engine).process(
            Request(prompt_token_ids=PROMPT_IDS[i:], max_tokens=8)).sampling_params)
    busy = run(engine, Request(prompt_token_ids=PROMPT_IDS, task="embed")).embedding
    while engine.has_unfinished_requests():
        engine.step()
    # Then it is the same vector
    assert busy == pytest.approx(alone, abs=1e-6)


def test_tokenize_answers_the_ids_the_gate_makes_and_their_strings(engine):
    request = Request(messages=[Message(role="user", content="Hi there")], task="tokenize")
    expected = InputProcessor.for_engine(engine).process(request).prompt_token_ids
    out = run(engine, request)
    assert out.tokens.token_ids == expected
    assert len(out.tokens.token_strs) == len(expected)
    assert out.tokens.max_model_len == engine.config.max_model_len


def test_detokenize_is_tokenize_backwards(engine):
    ids = run(engine, Request(prompt="The sea is calm", task="tokenize",
                              add_special_tokens=False)).tokens.token_ids
    out = run(engine, Request(prompt_token_ids=ids, task="detokenize"))
    assert out.text == "The sea is calm"


def test_prompt_logprobs_score_every_prompt_token_but_the_first(engine, tiny_model):
    # Given a generation request asking for its prompt's logprobs with the top 3
    out = run(engine, Request(prompt_token_ids=PROMPT_IDS[:12], max_tokens=2,
                              prompt_logprobs=3))
    found = out.prompt_logprobs
    # Then there is one entry per prompt token, the first None
    assert len(found) == 12 and found[0] is None
    # And each is the token's log-probability given the tokens before it, with its rank
    model = tiny_model.model
    hidden = model.forward_contiguous(torch.tensor(PROMPT_IDS[:12]), 0,
                                      model.make_contiguous_cache(12))
    logprobs = model.compute_logits(hidden).log_softmax(-1)
    for position in range(1, 12):
        entry, row = found[position], logprobs[position - 1]
        assert entry.token_id == PROMPT_IDS[position]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        assert entry.top_token_ids == row.topk(3).indices.tolist()
        assert entry.token is not None and len(entry.top_tokens) == 3


def test_allowed_token_ids_are_the_only_tokens_sampled(engine):
    allowed = [120, 121, 122]
    tokens = generated(engine, prompt_token_ids=PROMPT_IDS, max_tokens=20, temperature=1.0,
                       seed=3, ignore_eos=True, allowed_token_ids=allowed)
    assert len(tokens) == 20 and set(tokens) <= set(allowed)


def test_a_large_logit_bias_forces_its_token_and_a_negative_one_bans_it(engine):
    free = generated(engine, prompt_token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0,
                     ignore_eos=True)
    forced = generated(engine, prompt_token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0,
                       ignore_eos=True, logit_bias={321: 100.0})
    banned = generated(engine, prompt_token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0,
                       ignore_eos=True, logit_bias={free[0]: -100.0})
    assert forced == [321] * 8
    assert banned[0] != free[0]


def test_bad_words_are_never_generated(engine):
    # Given a seeded output over two tokens, 118 and 458 ("sea" is 118 458 in this vocabulary),
    # that writes "sea" somewhere
    fields = dict(prompt_token_ids=PROMPT_IDS, max_tokens=40, temperature=1.0, seed=1,
                  ignore_eos=True, allowed_token_ids=[118, 458])
    free = generated(engine, **fields)
    assert (118, 458) in pairs(free), "precondition: the free output writes it"
    # When "sea" is a bad word
    banned = generated(engine, **fields, bad_words=["sea"])
    # Then 458 never follows 118, and a one-token bad word is never sampled at all
    assert (118, 458) not in pairs(banned)
    one_token = generated(engine, **{**fields, "allowed_token_ids": [481, 100]},
                          bad_words=["hello"])  # "hello" is 481
    assert set(one_token) == {100}


@pytest.mark.parametrize(("fields", "code", "says"), [
    ({"logit_bias": {10**6: 1.0}}, ErrorCode.INVALID_TOKEN_ID, "logit_bias: token id 1000000"),
    ({"allowed_token_ids": [5, 10**6]}, ErrorCode.INVALID_TOKEN_ID, "allowed_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(engine, fields, code,
                                                                       says):
    with pytest.raises(RequestRejected) as info:
        InputProcessor.for_engine(engine).process(Request(prompt="Hi", **fields))
    assert info.value.code == code and says in info.value.message


def test_continue_final_message_ends_the_prompt_inside_the_last_message(engine):
    # Given a conversation whose last turn is a partial assistant answer
    messages = [Message(role="user", content="Name a colour."),
                Message(role="assistant", content="The colour is")]
    gate = InputProcessor.for_engine(engine)
    continued = gate.process(Request(messages=messages, add_generation_prompt=False,
                                     continue_final_message=True)).prompt_token_ids
    closed = gate.process(Request(messages=messages,
                                  add_generation_prompt=False)).prompt_token_ids
    # Then the prompt is the closed conversation cut right after the answer's text
    text = engine.tokenizer.decode(continued, skip_special_tokens=False)
    assert text.endswith("The colour is")
    assert closed[:len(continued)] == continued and len(closed) > len(continued)


def test_an_aborted_embedding_ends_cancelled_without_a_vector(engine):
    processed = InputProcessor.for_engine(engine).process(
        Request(prompt_token_ids=PROMPT_IDS, task="embed"))
    engine.add_request("to-abort", processed.prompt_token_ids, processed.sampling_params)
    engine.abort(["to-abort"])
    (out,) = [o for o in engine.step() if o.request_id == "to-abort"]
    assert out.finish_reason == "cancelled" and out.embedding is None
    assert not engine.has_unfinished_requests()
