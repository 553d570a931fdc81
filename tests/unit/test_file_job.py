"""How `llmq submit -f` names, validates and resumes the lines of a file (no Redis)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from llmq.broker.file_job import OutputFile, derive_request_id, read_lines, write_record


def test_request_ids_are_stable_and_tell_lines_apart() -> None:
    a = derive_request_id("/data/in.jsonl", 3, '{"prompt": "x"}')
    assert a == derive_request_id("/data/in.jsonl", 3, '{"prompt": "x"}')
    assert a.startswith("L3-")
    assert len({a, derive_request_id("/data/in.jsonl", 4, '{"prompt": "x"}'),
                derive_request_id("/data/other.jsonl", 3, '{"prompt": "x"}'),
                derive_request_id("/data/in.jsonl", 3, '{"prompt": "y"}')}) == 4


def test_lines_are_validated_one_by_one() -> None:
    lines = ['{"prompt": "ok"}\n', "\n", "{nope\n", '{"prompt": "x", "top_p": 0}\n',
             '{"id": "mine", "prompt": "a"}\n', '{"id": "mine", "prompt": "b"}\n', '"text"\n']
    parsed = read_lines(lines, "/in.jsonl", {"max_tokens": 8})
    assert [p.number for p in parsed] == [1, 3, 4, 5, 6, 7]  # the blank line is no request
    ok, bad_json, bad_field, mine, duplicate, not_object = parsed
    assert ok.body == {"stream": False, "max_tokens": 8, "prompt": "ok", "id": ok.request_id}
    assert bad_json.body is None and "line 3: not JSON" in bad_json.error
    assert "line 4:" in bad_field.error and "top_p" in bad_field.error
    assert mine.request_id == "mine" and mine.error is None
    assert "duplicate id 'mine' (first on line 5)" in duplicate.error
    assert "not a JSON object" in not_object.error


def test_the_line_overrides_the_command_defaults() -> None:
    (line,) = read_lines(['{"prompt": "x", "max_tokens": 2, "stream": true}'], "/f", {
        "max_tokens": 8, "temperature": 0})
    assert line.body["max_tokens"] == 2 and line.body["temperature"] == 0
    assert line.body["stream"] is True


def test_an_output_file_keeps_its_prefix_in_input_order(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    # Given results of lines a, b, then d (c missing), then a line cut short by a kill
    out.write_text("".join(json.dumps({"id": i}) + "\n" for i in "abd") + '{"id": "e"')
    output = OutputFile(str(out))
    assert set(output.existing) == {"a", "b", "d"}
    # When it is reopened for the input order a b c d e
    stream, kept = output.open_after_prefix(list("abcde"))
    stream.close()
    # Then only the in-order prefix stays in place; d is remembered to be rewritten after c
    assert kept == 2
    assert out.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_a_result_with_unicode_line_separators_stays_one_line() -> None:
    # Given an answer holding characters some readers take for line ends (the tiny model's
    # random text produces them)
    record = {"id": "a", "line": 1, "text": "x\u2028y\x85z\u2029"}
    out = io.StringIO()
    # When it is written as a result line
    write_record(out, record)
    # Then it is one line for str.splitlines() too, and reads back as the same answer
    (line,) = out.getvalue().splitlines()
    assert json.loads(line) == record
