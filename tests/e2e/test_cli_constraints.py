"""`llmq submit` with output constraints, several completions and log-probabilities."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.cli_harness import llmq, ok, printed

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SERVE = {"worker_id": "cli-constraints-w1"}  # the module's worker (tests/e2e/conftest.py)


def done_event(url: str, request_id: str) -> dict:
    lines = ok(llmq("result", request_id, "--json", url=url)).stdout.splitlines()
    return json.loads(lines[-1])


@pytest.mark.parametrize(("flags", "matches"), [
    (["--regex", "[a-z]{3}-[0-9]{2}"], lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
], ids=["regex", "choice"])
def test_a_constraint_flag_holds_the_answer_to_it(url: str, flags: list[str], matches) -> None:
    for seed in ("1", "2"):
        request_id = f"c-{flags[0][2:]}-{seed}"
        ok(llmq("submit", "Answer:", "--id", request_id, "--seed", seed, "--max-tokens", "20",
                *flags, url=url))
        assert matches(done_event(url, request_id)["text"])


def test_a_json_schema_file_holds_the_answer_to_it(url: str, tmp_path: Path) -> None:
    # A boolean, not an integer: a random model's unseeded integer can run past max_tokens.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    ok(llmq("submit", "Yes or no:", "--id", "c-schema", "--json-schema", str(path),
            "--max-tokens", "40", url=url))
    assert isinstance(json.loads(done_event(url, "c-schema")["text"])["ok"], bool)


@pytest.mark.parametrize("stream", [[], ["--no-stream"]], ids=["streamed", "whole"])
def test_n_completions_are_each_printed_and_logprobs_reach_the_request(url: str,
                                                                       stream: list[str]
                                                                       ) -> None:
    request_id = f"c-n{len(stream)}"
    shown = printed(ok(llmq("submit", "Hi", "--id", request_id, "-n", "3", "--logprobs",
                                "2", "--max-tokens", "4", "--ignore-eos", *stream, url=url)))
    done = done_event(url, request_id)
    texts = [c["text"] for c in done["choices"]]
    assert [c["index"] for c in done["choices"]] == [0, 1, 2]
    expected = f"{texts[0]}\n--- choice 1 ---\n{texts[1]}\n--- choice 2 ---\n{texts[2]}\n"
    assert shown == expected
    assert printed(ok(llmq("result", request_id, url=url))) == expected


def test_two_constraint_flags_are_refused_before_anything_is_sent(url: str) -> None:
    result = llmq("submit", "Hi", "--regex", "a+", "--choice", "b", url=url)
    assert result.exit_code == 2 and "both constrain" in result.stderr


def test_a_file_line_with_n_completions_writes_every_choice(url: str, tmp_path: Path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"prompt": "Hi", "n": 2, "max_tokens": 3}) + "\n"
                      + json.dumps({"prompt": "Yo", "max_tokens": 3}) + "\n")
    ok(llmq("submit", "-f", str(source), "-o", str(out), "--no-progress", url=url))
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert first["choices"][0]["text"] == first["text"] and "choices" not in second
