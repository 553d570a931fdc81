"""llmq.jobs without a server: sources, sinks, templates, job specs and dedup, as a user meets
them (files in, files out, errors that name what is wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmq.jobs.dedup import NearDuplicates
from llmq.jobs.sinks import RowWriter
from llmq.jobs.sources import BadRow, open_source
from llmq.jobs.spec import SourceSpec, job_from_mapping
from llmq.jobs.templates import ColumnRef, Condition, RequestTemplate, RowError, SpecError

ROWS = [{"id": i, "text": f"row {i}"} for i in range(5)]


def _write_all_formats(folder: Path) -> dict[str, Path]:
    table = pa.Table.from_pylist(ROWS)
    paths = {"jsonl": folder / "d.jsonl", "csv": folder / "d.csv", "parquet": folder / "d.parquet",
             "arrow": folder / "d.arrow"}
    paths["jsonl"].write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    paths["csv"].write_text("id,text\n" + "".join(f"{r['id']},{r['text']}\n" for r in ROWS))
    pq.write_table(table, paths["parquet"], row_group_size=2)
    with pa.ipc.new_file(paths["arrow"], table.schema) as writer:
        writer.write_table(table)
    return paths


def test_every_file_format_gives_the_rows_in_order(tmp_path: Path) -> None:
    for fmt, path in _write_all_formats(tmp_path).items():
        source = open_source(SourceSpec(str(path)))
        rows = list(source.rows())
        expected = ([{"id": str(r["id"]), "text": r["text"]} for r in ROWS] if fmt == "csv"
                    else ROWS)
        assert rows == expected, fmt
        assert source.num_rows == 5, fmt


def test_a_folder_of_files_and_max_rows(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"x": 2}) + "\n" + json.dumps({"x": 3}) + "\n")
    source = open_source(SourceSpec(str(tmp_path), max_rows=2))
    assert list(source.rows()) == [{"x": 1}, {"x": 2}] and source.num_rows == 2


def test_a_saved_dataset_folder_and_its_splits(tmp_path: Path) -> None:
    import datasets

    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                  "test": datasets.Dataset.from_list(ROWS[:2])})
    saved.save_to_disk(str(tmp_path / "saved"))
    assert list(open_source(SourceSpec(str(tmp_path / "saved"), split="test")).rows()) == ROWS[:2]
    with pytest.raises(SpecError, match="pick one with --split"):
        open_source(SourceSpec(str(tmp_path / "saved")))


def test_a_bad_jsonl_line_is_a_bad_row_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"a": 1}\n[1, 2]\n{oops\n')
    rows = list(open_source(SourceSpec(str(tmp_path / "d.jsonl"))).rows())
    assert rows[0] == {"a": 1}
    assert isinstance(rows[1], BadRow) and "line 2: not a JSON object" in rows[1].reason
    assert isinstance(rows[2], BadRow) and "line 3: not JSON" in rows[2].reason


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="nope.parquet: no such file"):
        open_source(SourceSpec(str(tmp_path / "nope.parquet")))


def test_an_unknown_dataset_id_offline_says_so(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    # NOTE: both libraries read HF_*_OFFLINE when imported, so the flags are set where they live
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(SpecError, match="no-such-owner/no-such-dataset: no such file"):
        open_source(SourceSpec("no-such-owner/no-such-dataset"))


def test_templates_substitute_text_as_data_never_as_template() -> None:
    template = RequestTemplate({"prompt": "Say: {{ text }}", "max_tokens": 8,
                                "seed": ColumnRef("n"),
                                "messages": [{"role": "user", "content": "{{ row['my col'] }}"}]})
    body = template.render({"text": "{{ 7*7 }} {% for x in y %}", "n": 3, "my col": "spaced"})
    assert body == {"prompt": "Say: {{ 7*7 }} {% for x in y %}", "max_tokens": 8, "seed": 3,
                    "messages": [{"role": "user", "content": "spaced"}]}


def test_a_missing_column_or_a_sandbox_escape_is_a_row_error() -> None:
    with pytest.raises(RowError, match="'text' is undefined"):
        RequestTemplate({"prompt": "{{ text }}"}).render({"other": 1})
    with pytest.raises(RowError, match="sandbox"):
        RequestTemplate({"prompt": "{{ text.__class__.__mro__ }}"}).render({"text": "x"})
    with pytest.raises(RowError, match="missing column 'n'"):
        RequestTemplate({"seed": ColumnRef("n")}).render({})
    with pytest.raises(SpecError, match="template syntax error"):
        RequestTemplate({"prompt": "{{ unclosed"})


def test_when_reads_parsed_json_fields() -> None:
    condition = Condition("label_parsed.label == 'spam'")
    assert condition.holds({"label_parsed": {"label": "spam"}})
    assert not condition.holds({"label_parsed": {"label": "ham"}})
    with pytest.raises(RowError, match="when"):
        condition.holds({})


def _job(**stage: object) -> dict:
    return {"source": "in.jsonl", "output": "out.jsonl", "stages": [stage]}


def test_job_specs_name_what_is_wrong() -> None:
    spec = job_from_mapping(_job(prompt="{{ text }}", schema={"type": "object"}))
    assert spec.stages[0].name == "result" and spec.stages[0].parse_json
    assert spec.errors_path == "./out.errors.jsonl"
    cases = [(_job(prompt="x", temprature=0), "unknown field.*temprature"),
             (_job(prompt="x", messages=[]), "exactly one of prompt or messages"),
             (_job(prompt="x", id="mine"), "id cannot be set"),
             (_job(prompt="x", name="bad name"), "a name of 1-40"),
             ({"source": "x", "output": "y", "stages": []}, "at least one stage"),
             ({"source": "x", "stages": [{}]}, "no output"),
             ({**_job(prompt="x"), "dedup": {"column": "t", "action": "keep"}}, "drop or flag")]
    for data, message in cases:
        with pytest.raises(SpecError, match=message):
            job_from_mapping(data)


def test_the_writer_resumes_after_the_last_whole_line(tmp_path: Path) -> None:
    out, errors = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    writer = RowWriter(str(out), str(errors))
    assert writer.resume() == -1
    writer.write_row({"a": 1, "llmq_row": 0})
    writer.write_error({"llmq_row": 1, "error": {}})
    writer.write_row({"a": 3, "llmq_row": 2})
    writer.close()
    with open(out, "a") as f:
        f.write('{"a": 4, "llmq_ro')  # a kill mid-line
    again = RowWriter(str(out), str(errors))
    assert again.resume() == 2 and (again.num_rows, again.num_errors) == (2, 1)
    again.write_row({"a": 4, "llmq_row": 3})
    again.finish()
    assert [json.loads(line)["llmq_row"] for line in out.read_text().splitlines()] == [0, 2, 3]


@pytest.mark.parametrize("ext", ["parquet", "arrow", "csv"])
def test_converted_outputs_hold_every_row_with_nested_columns(tmp_path: Path, ext: str) -> None:
    out = tmp_path / f"o.{ext}"
    writer = RowWriter(str(out), str(tmp_path / "e.jsonl"))
    writer.resume()
    writer.write_row({"t": None, "usage": {"n": 1}, "llmq_row": 0})  # null first, text later
    writer.write_row({"t": "x", "usage": {"n": 2}, "llmq_row": 1})
    writer.finish()
    assert not (tmp_path / f"o.{ext}.partial.jsonl").exists() and writer.finished_before
    if ext == "csv":
        assert out.read_text().splitlines() == ["t,usage,llmq_row", ',"{""n"": 1}",0',
                                                'x,"{""n"": 2}",1']
        return
    table = (pq.read_table(out) if ext == "parquet"
             else pa.ipc.open_file(pa.memory_map(str(out))).read_all())
    assert table.to_pylist() == [{"t": None, "usage": {"n": 1}, "llmq_row": 0},
                                 {"t": "x", "usage": {"n": 2}, "llmq_row": 1}]


def test_minhash_finds_near_duplicates_and_keeps_distinct_rows() -> None:
    base = "the council said a new plan for the river park would open next spring"
    dedup = NearDuplicates(threshold=0.7)
    assert dedup.first_seen(base, 0) is None
    assert dedup.first_seen(base.upper() + "!", 1) == 0  # case and punctuation ignored
    assert dedup.first_seen(base.replace("spring", "summer"), 2) == 0  # 1 word of 14 changed
    assert dedup.first_seen("scientists found a small star near the old galaxy", 3) is None
    assert dedup.num_duplicates == 2
    # the same texts in the same order give the same answers (a rerun drops the same rows)
    again = NearDuplicates(threshold=0.7)
    assert [again.first_seen(t, i) for i, t in enumerate(
        [base, base.upper() + "!"])] == [None, 0]
