"""llguidance vs xgrammar on this CPU, with the default model's tokenizer: the figures behind
the choice of grammar engine (docs/performance.md, "Structured output").

    flock /tmp/bench.lock .venv/bin/python bench/grammar_engines.py [--batch 64]

Needs both packages (`pip install llguidance xgrammar`); llmq itself depends on one only.
Prints, per engine:
- tokenizer setup: building the engine's view of the 49k-token vocabulary (once per worker);
- compile: a typical extraction schema, cold (a new schema text each time, so no cache helps),
  until the first mask is ready;
- mask: time to fill one row's token bitmask, per token per row, with `--batch` rows each
  following its own valid JSON document token by token (one thread, as a worker runs);
- advance: time to feed one sampled token to one row's matcher;
- tricky schemas: random walks through each engine's masks (a token drawn among the allowed
  ones, biased to close strings and arrays so documents end) until the grammar accepts EOS;
  every finished document is checked with `jsonschema`. `bad` counts documents the engine let
  through that the schema rejects; `stuck` walks that hit the step cap.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import time

import jsonschema
import numpy as np
import torch
from gguf import GGUFReader

from llmq.worker.engine.model.default_model import ensure_default_model
from llmq.worker.engine.model.tokenizer import Tokenizer

TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churned", "trial"]},
                 "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "address", "tags", "active"],
    "additionalProperties": False,
}

TRICKY_SCHEMAS: dict[str, dict] = {
    "nested+required": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "object", "required": ["x"], "additionalProperties": False,
                             "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}},
                       "b": {"type": "array", "items": {"type": "boolean"}}}},
    "number bounds": {
        "type": "object", "required": ["i", "f", "n"], "additionalProperties": False,
        "properties": {"i": {"type": "integer", "minimum": -5, "maximum": 17},
                       "f": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
                       "n": {"type": "integer", "minimum": 100}}},
    "string lengths": {
        "type": "array", "minItems": 2, "maxItems": 3,
        "items": {"type": "string", "minLength": 3, "maxLength": 5}},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "enum+unicode": {"enum": ["caf\u00e9", "say \"hi\"", "line\nbreak", 42, None, True]},
    "anyOf": {"anyOf": [{"type": "object", "required": ["kind"], "additionalProperties": False,
                         "properties": {"kind": {"const": "dog"}, "barks": {"type": "boolean"}}},
                        {"type": "integer", "minimum": 0}]},
    "recursive $ref": {
        "$defs": {"node": {"type": "object", "required": ["v"], "additionalProperties": False,
                           "properties": {"v": {"type": "integer"},
                                          "kids": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "nullable+const": {
        "type": "object", "required": ["v", "c"], "additionalProperties": False,
        "properties": {"v": {"type": ["string", "null"]}, "c": {"const": "fixed"}}},
    "map": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "allOf": {"allOf": [{"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}}}, {"required": ["b"], "properties": {"b": {"type": "string"}}}]},
}

CLOSING = (b'"', b"]", b"}", b",")


class LlgTokenizerSource:
    """What llguidance's TokenizerWrapper reads: bytes per token, special ones marked by 0xFF."""

    def __init__(self, tok: Tokenizer) -> None:
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.special_token_ids = sorted(tok.special_token_ids)
        self.tokens = [b"\xff" + b if i in tok.special_token_ids else b
                       for i, b in enumerate(tok.token_bytes)]
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_special_tokens=False)


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        # NOTE: not llguidance.torch: importing it runs a torch.compile decorator (~4 s here),
        # which would be counted as tokenizer setup; the raw-pointer API is all llmq uses.
        import llguidance
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(LlgTokenizerSource(tok)),
            eos_token=sorted(tok.eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=1)
        self.version = llguidance.__version__

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), bitmask.shape[1] * 4,
                                              bitmask.shape[0])

    def fill_one(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar
        self.xgr = xgrammar
        # NOTE: special tokens as empty strings: xgrammar then never matches their text.
        vocab = [b"" if i in tok.special_token_ids else b for i, b in enumerate(tok.token_bytes)]
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW,
                                           vocab_size=tok.vocab_size,
                                           stop_token_ids=sorted(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                 separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def typical_instance(rng: random.Random) -> dict:
    name = rng.choice(["Ada", "Bob", "Chen Wei", "Dana O'Neil", "Émile"])
    return {
        "name": f"{name} {rng.randrange(1000)}", "age": rng.randrange(151),
        "email": f"user{rng.randrange(10**6)}@mail.com",
        "address": {"street": f"{rng.randrange(1, 999)} Main St", "city": "Springfield",
                    "zip": f"{rng.randrange(10**5):05d}"},
        "tags": rng.sample(["new", "vip", "churned", "trial"], rng.randrange(5)),
        "score": round(rng.random(), 3), "active": rng.random() < 0.5,
    }


def bench_compile(engine, tok_vocab: int, repeats: int) -> list[float]:
    times = []
    bitmask = torch.full((1, (tok_vocab + 31) // 32), -1, dtype=torch.int32)
    for i in range(repeats):
        # A new property name each time: nothing cached from the previous round can help.
        schema = json.loads(json.dumps(TYPICAL_SCHEMA))
        schema["properties"][f"note{i}"] = {"type": "string"}
        start = time.perf_counter()
        matcher = engine.matcher(engine.compile(schema))
        engine.fill_one(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
    return times


def bench_masks(engine, tok: Tokenizer, batch: int) -> tuple[float, float, float, int]:
    """Seconds per token per row: batched fill, one-row fill, advance; and tokens timed."""
    rng = random.Random(0)
    compiled = engine.compile(TYPICAL_SCHEMA)
    docs = [tok.encode(json.dumps(typical_instance(rng), separators=(",", ":"),
                                  ensure_ascii=False), add_special_tokens=False)
            for _ in range(batch)]
    bitmask = torch.full((batch, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
    results = []
    for batched in (True, False):
        matchers = [engine.matcher(compiled) for _ in range(batch)]
        fill_time = advance_time = 0.0
        rows_masked = 0
        for step in range(max(len(d) for d in docs) + 1):
            live = [i for i, d in enumerate(docs) if step <= len(d)]
            start = time.perf_counter()
            if batched:
                engine.fill([matchers[i] for i in live], bitmask)
            else:
                for row, i in enumerate(live):
                    engine.fill_one(matchers[i], bitmask, row)
            fill_time += time.perf_counter() - start
            rows_masked += len(live)
            for row, i in enumerate(live):
                if step < len(docs[i]):
                    token = docs[i][step]
                    if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                        raise AssertionError(f"{engine.name} masked a valid token at {step}")
                    start = time.perf_counter()
                    if not engine.accept(matchers[i], token):
                        raise AssertionError(f"{engine.name} refused a valid document at {step}")
                    advance_time += time.perf_counter() - start
        results.append(fill_time / rows_masked)
        if batched:
            advance = advance_time / sum(len(d) for d in docs)
    return results[0], results[1], advance, rows_masked


def random_walk(engine, matcher, tok: Tokenizer, closing: np.ndarray, rng: np.random.Generator,
                max_steps: int) -> tuple[str | None, bool]:
    """(the document, finished) of one biased random walk through the engine's masks."""
    bitmask = torch.full((1, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
    eos = sorted(tok.eos_token_ids)
    out: list[int] = []
    for _ in range(max_steps):
        engine.fill_one(matcher, bitmask, 0)
        allowed = allowed_ids(bitmask[0], tok.vocab_size)
        if allowed.size == 0:
            return tok.decode(out), False
        ends = np.intersect1d(allowed, eos)
        others = np.setdiff1d(allowed, eos)
        if ends.size and (others.size == 0 or rng.random() < 0.5):
            return tok.decode(out), True
        closers = others[closing[others]]
        pool = closers if closers.size and rng.random() < 0.4 else others
        token = int(rng.choice(pool))
        if not engine.accept(matcher, token):
            return tok.decode(out), False
        out.append(token)
    return tok.decode(out), False


def check_tricky(engine, tok: Tokenizer, walks: int, max_steps: int) -> None:
    closing = np.array([any(c in b for c in CLOSING) for b in tok.token_bytes])
    for name, schema in TRICKY_SCHEMAS.items():
        validator = jsonschema.Draft202012Validator(schema)
        try:
            compiled = engine.compile(schema)
        except Exception as e:  # noqa: BLE001 - an engine refusing a valid schema is a finding
            print(f"    {name:18s} compile error: {str(e).strip()[:100]}")
            continue
        rng = np.random.default_rng(0)
        ok = bad = stuck = 0
        example = ""
        for _ in range(walks):
            matcher = engine.matcher(compiled)
            text, finished = random_walk(engine, matcher, tok, closing, rng, max_steps)
            if not finished:
                stuck += 1
                continue
            try:
                validator.validate(json.loads(text))
                ok += 1
            except (ValueError, jsonschema.ValidationError) as e:
                bad += 1
                example = f"  e.g. {text[:60]!r}: {str(e).splitlines()[0][:60]}"
        print(f"    {name:18s} ok {ok:3d}  bad {bad:3d}  stuck {stuck:3d}{example}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--compile-repeats", type=int, default=10)
    ap.add_argument("--walks", type=int, default=30)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tok = Tokenizer.from_gguf(GGUFReader(str(ensure_default_model())))
    print(f"tokenizer: default model, vocab {tok.vocab_size}; batch {args.batch}, 1 thread")
    for name in args.engines.split(","):
        start = time.perf_counter()
        engine = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](tok)
        setup = time.perf_counter() - start
        print(f"\n{engine.name} {engine.version}: tokenizer setup {setup * 1000:.0f} ms")
        times = bench_compile(engine, tok.vocab_size, args.compile_repeats)
        print(f"  compile typical schema (cold, to first mask): median "
              f"{statistics.median(times) * 1000:.2f} ms, max {max(times) * 1000:.2f} ms")
        batched, one, advance, n = bench_masks(engine, tok, args.batch)
        print(f"  mask per token per row at batch {args.batch}: batched {batched * 1e6:.1f} us, "
              f"row by row {one * 1e6:.1f} us ({n} row-steps); advance {advance * 1e6:.1f} us")
        print(f"  tricky schemas, {args.walks} random walks each (cap {args.max_steps} tokens):")
        check_tricky(engine, tok, args.walks, args.max_steps)


if __name__ == "__main__":
    main()
