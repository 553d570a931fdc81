"""JobSpec: a dataset job or pipeline, from a YAML file (`llmq run JOB.yaml`) or from flags.

    name: summarise-classify          # request ids start with it (default: from the output path)
    source: {path: docs.parquet, split: train, subset: null, max_rows: 20000}   # or just a path
    output: labelled.parquet          # .jsonl, .csv, .parquet or .arrow
    errors: labelled.errors.jsonl     # default: OUTPUT's name + .errors.jsonl
    dedup: {column: text, threshold: 0.8, action: drop}     # optional, before generation
    max_in_flight: 1024               # requests queued or running at a time
    stages:
      - name: summary                 # its columns: summary, summary_finish_reason, ...
        prompt: "Summarise in one sentence: {{ text }}"
        max_tokens: 64
        temperature: 0
      - name: label
        queue: classify               # its own queue (and so its own workers and model)
        when: "summary_finish_reason == 'stop'"
        messages:
          - {role: user, content: "Classify: {{ summary }}"}
        schema: {type: object, properties: {label: {enum: [news, sport]}}, required: [label]}

A stage is a `prompt` or `messages` template plus any request field of the wire format
(docs/protocol.md) as a constant, a template string, or `{column: NAME}` (the column's value as
it is). `schema` is a shortcut for a JSON-schema `response_format`; the parsed JSON becomes the
column `<name>_parsed`. Paths in a job file are relative to the file's folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmq.jobs.templates import ColumnRef, Condition, RequestTemplate, SpecError
from llmq.protocol.requests import Request

__all__ = ["DedupSpec", "JobSpec", "SourceSpec", "StageSpec", "job_from_mapping", "load_job",
           "read_job_file"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,40}")
# request fields a stage may not set: the job owns ids, reads only final events, sends text
_RESERVED = {"id", "stream", "prompt_token_ids"}
REQUEST_FIELDS = set(Request.__struct_fields__) - _RESERVED
_STAGE_KEYS = {"name", "queue", "when", "schema"}
_JOB_KEYS = {"name", "source", "output", "errors", "dedup", "max_in_flight", "chunk_rows",
             "stages"}
DEFAULT_MAX_IN_FLIGHT = 1024
DEFAULT_CHUNK_ROWS = 10_000


@dataclass(frozen=True)
class SourceSpec:
    path: str  # a file, a folder, or a Hugging Face dataset id
    split: str | None = None
    subset: str | None = None
    max_rows: int | None = None


@dataclass(frozen=True)
class DedupSpec:
    column: str
    threshold: float = 0.8  # estimated Jaccard similarity of word 3-grams at which rows match
    action: str = "drop"  # drop: not in the output; flag: in it, with duplicate_of, not run
    num_perm: int = 128


@dataclass
class StageSpec:
    name: str
    template: RequestTemplate
    queue: str | None = None  # None: the command's --queue
    when: Condition | None = None
    parse_json: bool = False  # a JSON response_format was asked for: parse the text


@dataclass
class JobSpec:
    source: SourceSpec
    output: str
    stages: list[StageSpec]
    name: str | None = None  # None: derived from the output's absolute path
    errors: str | None = None
    dedup: DedupSpec | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    chunk_rows: int = DEFAULT_CHUNK_ROWS

    @property
    def errors_path(self) -> str:
        if self.errors is not None:
            return self.errors
        stem, ext = os.path.splitext(self.output)
        return f"{stem if ext else self.output}.errors.jsonl"


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise SpecError(f"{where}: a name of 1-40 letters, digits, '_' or '-', got {value!r}")
    return value


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{where}: a positive integer, got {value!r}")
    return value


def _column_refs(value: Any) -> Any:
    """YAML's `{column: NAME}` (a mapping with only that key) -> ColumnRef, anywhere inside."""
    if isinstance(value, Mapping):
        if set(value) == {"column"}:
            if not isinstance(value["column"], str):
                raise SpecError(f"{{column: ...}} takes a column name, got {value['column']!r}")
            return ColumnRef(value["column"])
        return {k: _column_refs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_column_refs(item) for item in value]
    return value


def parse_stage(data: Any, index: int, names: set[str]) -> StageSpec:
    where = f"stages[{index}]"
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: a mapping of a stage's fields, got {data!r}")
    name = _name(data.get("name", "result" if index == 0 else f"stage{index + 1}"),
                 f"{where}.name")
    if name in names:
        raise SpecError(f"{where}: a second stage named {name!r}")
    unknown = sorted(set(data) - _STAGE_KEYS - REQUEST_FIELDS - _RESERVED)
    if unknown:
        raise SpecError(f"{where} ({name}): unknown field(s) {', '.join(unknown)} (a stage takes "
                        f"{', '.join(sorted(_STAGE_KEYS))} and request fields: "
                        f"{', '.join(sorted(REQUEST_FIELDS))})")
    reserved = sorted(_RESERVED & set(data))
    if reserved:
        raise SpecError(f"{where} ({name}): {', '.join(reserved)} cannot be set: the job "
                        "makes request ids and reads final results")
    if ("prompt" in data) == ("messages" in data):
        raise SpecError(f"{where} ({name}): give exactly one of prompt or messages")
    fields = {k: _column_refs(v) for k, v in data.items() if k in REQUEST_FIELDS}
    parse_json = False
    if "schema" in data:
        if "response_format" in data:
            raise SpecError(f"{where} ({name}): give schema or response_format, not both")
        if not isinstance(data["schema"], Mapping):
            raise SpecError(f"{where} ({name}).schema: a JSON schema object")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": name, "schema": data["schema"], "strict": True}}
        parse_json = True
    response_format = data.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") in (
            "json_object", "json_schema"):
        parse_json = True
    queue = data.get("queue")
    if queue is not None and not isinstance(queue, str):
        raise SpecError(f"{where} ({name}).queue: a queue name, got {queue!r}")
    when = data.get("when")
    if when is not None and not isinstance(when, str):
        raise SpecError(f"{where} ({name}).when: an expression in a string, got {when!r}")
    return StageSpec(name=name, template=RequestTemplate(fields, f"{where} ({name})"),
                     queue=queue, parse_json=parse_json,
                     when=None if when is None else Condition(when, f"{where} ({name}).when"))


def parse_source(data: Any, base_dir: str) -> SourceSpec:
    if isinstance(data, str):
        data = {"path": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("path"), str):
        raise SpecError(f"source: a path or {{path: ..., split: ..., subset: ..., max_rows: ...}}, "
                        f"got {data!r}")
    unknown = sorted(set(data) - {"path", "split", "subset", "max_rows"})
    if unknown:
        raise SpecError(f"source: unknown field(s) {', '.join(unknown)}")
    path = data["path"]
    local = os.path.join(base_dir, os.path.expanduser(path))
    max_rows = data.get("max_rows")
    return SourceSpec(path=local if os.path.exists(local) else path,
                      split=data.get("split"), subset=data.get("subset"),
                      max_rows=None if max_rows is None else _positive_int(max_rows,
                                                                           "source.max_rows"))


def parse_dedup(data: Any) -> DedupSpec:
    if isinstance(data, str):
        data = {"column": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("column"), str):
        raise SpecError(f"dedup: {{column: NAME, threshold: 0.8, action: drop|flag}}, got {data!r}")
    unknown = sorted(set(data) - {"column", "threshold", "action", "num_perm"})
    if unknown:
        raise SpecError(f"dedup: unknown field(s) {', '.join(unknown)}")
    threshold = data.get("threshold", 0.8)
    if not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise SpecError(f"dedup.threshold: a number in (0, 1], got {threshold!r}")
    action = data.get("action", "drop")
    if action not in ("drop", "flag"):
        raise SpecError(f"dedup.action: drop or flag, got {action!r}")
    num_perm = _positive_int(data.get("num_perm", 128), "dedup.num_perm")
    return DedupSpec(column=data["column"], threshold=float(threshold), action=action,
                     num_perm=num_perm)


def job_from_mapping(data: Any, base_dir: str = ".") -> JobSpec:
    """A JobSpec from a job file's parsed YAML; SpecError naming the first thing wrong."""
    if not isinstance(data, Mapping):
        raise SpecError("a job file is a mapping with source, output and stages")
    unknown = sorted(set(data) - _JOB_KEYS)
    if unknown:
        raise SpecError(f"unknown field(s) {', '.join(unknown)} (a job takes "
                        f"{', '.join(sorted(_JOB_KEYS))})")
    for key in ("source", "output", "stages"):
        if key not in data:
            raise SpecError(f"the job has no {key}")
    if not isinstance(data["output"], str):
        raise SpecError(f"output: a file path, got {data['output']!r}")
    stages_data = data["stages"]
    if not isinstance(stages_data, list) or not stages_data:
        raise SpecError("stages: a list of at least one stage")
    stages: list[StageSpec] = []
    for index, stage_data in enumerate(stages_data):
        stages.append(parse_stage(stage_data, index, {s.name for s in stages}))
    errors = data.get("errors")
    return JobSpec(
        source=parse_source(data["source"], base_dir),
        output=os.path.join(base_dir, data["output"]), stages=stages,
        name=None if data.get("name") is None else _name(data["name"], "name"),
        errors=None if errors is None else os.path.join(base_dir, str(errors)),
        dedup=None if data.get("dedup") is None else parse_dedup(data["dedup"]),
        max_in_flight=_positive_int(data.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT),
                                    "max_in_flight"),
        chunk_rows=_positive_int(data.get("chunk_rows", DEFAULT_CHUNK_ROWS), "chunk_rows"))


def read_job_file(path: str) -> tuple[Any, str]:
    """(the job file's parsed YAML, the folder its paths are relative to); needs PyYAML
    (`pip install 'llmq[datasets]'`)."""
    try:
        import yaml
    except ImportError:
        raise SpecError("job files need PyYAML: pip install 'llmq[datasets]'") from None
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not YAML: {exc}") from None
    return data, os.path.dirname(os.path.abspath(path))


def load_job(path: str) -> JobSpec:
    """Read a YAML job file."""
    return job_from_mapping(*read_job_file(path))
