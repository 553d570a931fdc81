"""Structured output through the whole engine: schemas, regexes, choices and grammars constrain
what is generated; invalid specs are refused up front; other rows of the batch are untouched.

The tiny random Llama samples almost uniformly, so its outputs walk the grammar's corners that a
real model rarely visits; the real model checks the same contract on realistic output."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from llmq.protocol.errors import RequestRejected
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.sampling_params import SamplingParams, StructuredOutputParams

PROMPT = [100, 101, 102, 103]


def make_engine(loaded, path, **overrides) -> EngineCore:
    fields = {"model": str(path), "dtype": "float32", "num_kv_blocks": 512}
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), loaded=loaded)


def schema_params(schema: dict, **fields) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutputParams("json_schema",
                                                                   json.dumps(schema)), **fields)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the kinds extraction jobs use: nested objects, arrays, enums, bounded
    numbers and strings, required and optional fields."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randrange(1, 12)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randrange(0, schema["maxLength"] + 1)
        return schema
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "caf\u00e9", "a \"quote\"", 7, None],
                                   rng.randrange(1, 5))}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randrange(0, 2), "maxItems": rng.randrange(2, 4)}
    names = rng.sample(["id", "name", "tags", "price", "owner", "size", "kind", "meta"],
                       rng.randrange(1, 5))
    return {"type": "object", "additionalProperties": False,
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7]}


SCHEMAS = [random_schema(random.Random(i)) for i in range(50)]


def test_fifty_generated_schemas_constrain_greedy_and_sampled_output(tiny_model,
                                                                      tiny_model_path):
    # Given 50 schemas, each asked for once greedily and once sampled, all in one batch
    engine = make_engine(tiny_model, tiny_model_path)
    params = ([schema_params(s, max_tokens=200, temperature=0.0) for s in SCHEMAS]
              + [schema_params(s, max_tokens=200, temperature=1.0, seed=i)
                 for i, s in enumerate(SCHEMAS)])
    # When they run
    outs = engine.generate([PROMPT] * len(params), params)
    # Then every output that ended by itself is JSON that the schema accepts
    finished = 0
    for out, schema in zip(outs, SCHEMAS * 2, strict=True):
        if out.finish_reason == "length":
            assert out.usage.completion_tokens == 200  # cut by max_tokens, and said so
            continue
        assert out.finish_reason == "stop", out.error_message
        jsonschema.validate(json.loads(out.text), schema)
        finished += 1
    assert finished >= 90  # the tiny model rarely runs out of tokens: the check is not vacuous


def test_regex_choice_and_grammar_outputs_match(tiny_model, tiny_model_path):
    engine = make_engine(tiny_model, tiny_model_path)
    specs = [("regex", r"[A-Z]{2}-[0-9]{3}"), ("regex", r"(yes|no), because [a-z ]{3,20}\."),
             ("choice", json.dumps(["positive", "negative", "neutral"])),
             ("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),  # GBNF
             ("grammar", 'start: "x=" NUMBER ";"\n%import common.NUMBER')]  # Lark
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                             structured_output=StructuredOutputParams(kind, spec))
              for kind, spec in specs for seed in range(4)]
    outs = engine.generate([PROMPT] * len(params), params)
    patterns = [r"[A-Z]{2}-[0-9]{3}", r"(yes|no), because [a-z ]{3,20}\.",
                "positive|negative|neutral", r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)",
                r"x=[0-9.eE+-]+;"]
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop"
        assert re.fullmatch(patterns[i // 4], out.text), (specs[i // 4], out.text)


@pytest.mark.parametrize(("kind", "spec", "reason"), [
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum"),
    ("json_schema", '{"type": "objekt"}', "objekt"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", '{"type": "object",', "json_schema"),
    ("json_schema", '[1, 2]', "JSON object"),
    ("regex", "((", "unclosed group"),
    ("choice", "[]", "non-empty list"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
])
def test_a_spec_that_cannot_compile_is_refused_with_its_reason(tiny_model, tiny_model_path,
                                                                kind, spec, reason):
    engine = make_engine(tiny_model, tiny_model_path)
    gate = InputProcessor.for_engine(engine)  # the one place requests are checked
    with pytest.raises(RequestRejected) as info:
        gate.check_sampling_params(SamplingParams(
            structured_output=StructuredOutputParams(kind, spec)))
    assert info.value.code == "invalid_request"
    assert reason in info.value.message
    assert not engine.has_unfinished_requests()


def test_a_constrained_row_leaves_the_rest_of_its_batch_token_identical(tiny_model,
                                                                        tiny_model_path):
    # Given unconstrained greedy and seeded requests run on their own
    engine = make_engine(tiny_model, tiny_model_path)
    others = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    alone = engine.generate(prompts, others)
    # When they share every step with constrained requests
    constrained = [schema_params(SCHEMAS[0], max_tokens=24, temperature=1.0, seed=1),
                   SamplingParams(max_tokens=24, structured_output=StructuredOutputParams(
                       "regex", "[a-z]+"))]
    mixed = engine.generate([prompts[0], PROMPT, prompts[1], PROMPT],
                            [others[0], constrained[0], others[1], constrained[1]])
    # Then their tokens did not change
    assert mixed[0].new_token_ids == alone[0].new_token_ids
    assert mixed[2].new_token_ids == alone[1].new_token_ids


def test_a_preempted_constrained_request_resumes_where_its_grammar_stood(tiny_model,
                                                                         tiny_model_path):
    # Given seeded constrained requests, run alone in a roomy engine
    params = [schema_params(SCHEMAS[i], max_tokens=60, temperature=1.0, seed=i)
              for i in range(12)]
    prompts = [[100 + i, 200 + i, 300] * 3 for i in range(12)]
    roomy = make_engine(tiny_model, tiny_model_path)
    alone = [roomy.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    # When they run together in a KV cache far too small, so some are preempted and recomputed
    tight = make_engine(tiny_model, tiny_model_path, num_kv_blocks=20, block_size=4,
                        enable_prefix_caching=False)
    together = tight.generate(prompts, params)
    # Then the outputs are the same, and still valid
    assert tight.stats().num_preemptions > 0
    assert [o.text for o in together] == [o.text for o in alone]
    assert all(o.finish_reason in ("stop", "length") for o in together)


def test_one_schema_is_compiled_once_for_many_requests(tiny_model, tiny_model_path):
    engine = make_engine(tiny_model, tiny_model_path)
    params = [schema_params(SCHEMAS[3], max_tokens=20, temperature=1.0, seed=i)
              for i in range(8)]
    engine.generate([PROMPT] * 8, params)
    assert engine.structured_output.num_compiled == 1


def test_min_tokens_never_blocks_a_finished_grammar(tiny_model, tiny_model_path):
    # Given a choice whose words are shorter than min_tokens
    engine = make_engine(tiny_model, tiny_model_path)
    params = SamplingParams(max_tokens=30, min_tokens=20, temperature=0.0,
                            structured_output=StructuredOutputParams("choice", '["a", "b"]'))
    (out,) = engine.generate([PROMPT], params)
    # Then the answer is one of them, not an error for a row with nothing left to sample
    assert out.text in ("a", "b") and out.finish_reason == "stop"


@pytest.mark.model
def test_real_model_answers_in_the_schema_it_was_given(default_model_f32, default_model_path):
    # Given SmolLM2 asked to extract a person into a schema, greedily and sampled
    engine = make_engine(default_model_f32, default_model_path)
    tok = engine.tokenizer
    schema = {"type": "object", "additionalProperties": False,
              "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string", "maxLength": 40},
                             "age": {"type": "integer", "minimum": 0, "maximum": 130},
                             "city": {"type": "string", "maxLength": 40},
                             "hobbies": {"type": "array", "maxItems": 4,
                                         "items": {"type": "string", "maxLength": 30}}}}
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Extract the person as JSON: Maria Lopez is 34, lives in Madrid and loves chess.")}]))
    params = [schema_params(schema, max_tokens=120, temperature=0.0)] + [
        schema_params(schema, max_tokens=120, temperature=0.8, seed=s) for s in range(3)]
    outs = engine.generate([prompt] * 4, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert "Maria" in json.loads(outs[0].text)["name"]


def test_each_of_n_completions_follows_the_schema_on_its_own(tiny_model, tiny_model_path):
    engine = make_engine(tiny_model, tiny_model_path, block_size=4)
    outs = engine.generate([PROMPT * 5], schema_params(SCHEMAS[1], max_tokens=200,
                                                       temperature=1.0, seed=3, n=3))
    assert [o.index for o in outs] == [0, 1, 2]
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])
