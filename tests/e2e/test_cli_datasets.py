"""`llmq run`: datasets through templates and two-stage pipelines on real workers (tiny model).

The module's worker is slowed (`slow_step`) and seats few sequences, so a SIGKILL lands while
rows are in flight; a second worker serves the classify stage's own queue.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import yaml

from llmq.broker.keys import Keys
from tests.e2e.cli_harness import llmq, llmq_process, ok, serve, subprocess_env
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = Keys()
QUEUE = "datasets"
CLASSIFY = "classify"
SERVE = {"worker_id": "ds-w1", "queue": QUEUE, "fault": "slow_step:30", "max_num_seqs": 4}
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["news", "sport"]}},
          "required": ["label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def classify_worker(url: str, tiny_model_path: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    worker = serve(url, tiny_model_path, tmp_path_factory.mktemp("logs2"), "ds-classify",
                   queue=CLASSIFY, max_num_seqs=8)
    yield
    worker.stop()


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def _pipeline(tmp_path: Path, source: str, output: str, name: str) -> Path:
    job = {"name": name, "source": source, "output": output, "max_in_flight": 16,
           "stages": [
               {"name": "summary", "prompt": "Summarise: {{ text }}", "max_tokens": 5,
                "temperature": 0, "ignore_eos": True},
               {"name": "label", "queue": CLASSIFY, "when": "keep == 1", "max_tokens": 48,
                "temperature": 0, "messages": [
                    {"role": "user", "content": "Classify {{ summary }} (row {{ title }})"}],
                "schema": SCHEMA}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_a_two_stage_pipeline_keeps_every_row_in_order(url: str, classify_worker: None,
                                                       tmp_path: Path) -> None:
    # Given a JSONL of 12 rows, one missing its text and one line that is not JSON
    lines = [json.dumps({"title": f"t{i}", "text": f"story {i} {{{{ 7*7 }}}}",
                         "keep": i % 3 != 0}) for i in range(10)]
    lines.insert(4, json.dumps({"title": "no-text", "keep": 1}))
    lines.insert(7, "{not json")
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    job = _pipeline(tmp_path, "in.jsonl", "out.parquet", "order")

    # When the pipeline runs, its output a Parquet file
    result = ok(llmq("run", str(job), "--queue", QUEUE, url=url))

    # Then the 10 good rows are there in input order, input columns kept
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["title"] for row in table] == [f"t{i}" for i in range(10)]
    assert [row["llmq_row"] for row in table] == [0, 1, 2, 3, 5, 6, 8, 9, 10, 11]
    # the column's template-looking text was sent as text, never evaluated
    assert all(row["text"].endswith("{{ 7*7 }}") for row in table)
    for row in table:
        assert row["summary_finish_reason"] == "length"
        assert row["summary_usage"]["completion_tokens"] == 5
        if row["keep"]:  # the label stage ran: its JSON parsed and valid against the schema
            assert row["label_parsed"]["label"] in ("news", "sport")
            assert json.loads(row["label"]) == row["label_parsed"]
        else:  # when: keep == 1 skipped it
            assert row["label"] is None and row["label_parsed"] is None
    # And the two bad rows are in the errors file with their row number and the reason
    errors = _jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["llmq_row"], e["stage"]) for e in errors] == [(4, "summary"), (7, "source")]
    assert "text" in errors[0]["error"]["message"] and "not JSON" in errors[1]["error"]["message"]
    assert "10 rows" in result.stderr and "2 errors" in result.stderr
    # And the summary counts each stage: the label stage skipped the 4 rows with keep false
    assert "summary: 10 rows, 1 failed, 0 skipped" in result.stderr
    assert "label: 6 rows, 0 failed, 4 skipped" in result.stderr
    assert not (tmp_path / "out.parquet.partial.jsonl").exists()

    # And running it again does nothing
    again = ok(llmq("run", str(job), "--queue", QUEUE, url=url))
    assert "already complete" in again.stderr


def test_map_a_parquet_column_into_prompts_with_dedup(url: str, tmp_path: Path) -> None:
    # Given a Parquet file whose rows 2 and 5 repeat row 0 almost word for word
    texts = [f"the quick brown fox number {i} jumps over the lazy dog and runs away"
             for i in range(6)]
    texts[2] = texts[0] + "!"
    texts[5] = texts[0].upper()
    pq.write_table(pa.table({"text": texts, "n": list(range(6))}), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"

    # When it is mapped with --map, dropping near-duplicates
    result = ok(llmq("run", "--dataset", str(tmp_path / "in.parquet"), "-o", str(out),
                     "--map", "prompt=Say {{ text }}", "--map", "max_tokens=3",
                     "--map", "seed={\"column\": \"n\"}", "--dedup", "text",
                     "--queue", QUEUE, url=url))

    # Then the 4 distinct rows have results, and the summary counts the 2 dropped
    rows = _jsonl(out)
    assert [row["n"] for row in rows] == [0, 1, 3, 4]
    assert all(row["result_usage"]["completion_tokens"] <= 3 for row in rows)
    assert "2 near-duplicates" in result.stderr


def test_killed_twice_and_rerun_equals_an_uninterrupted_run(url: str, classify_worker: None,
                                                            r: redis.Redis,
                                                            tmp_path: Path) -> None:
    # Given 40 rows through the two-stage pipeline
    pq.write_table(pa.table({"title": [f"t{i}" for i in range(40)],
                             "text": [f"article {i} about things" for i in range(40)],
                             "keep": [i % 2 for i in range(40)]}), tmp_path / "in.parquet")
    killed = _pipeline(tmp_path, "in.parquet", "killed.jsonl", "killed")
    args = ["run", str(killed), "--queue", QUEUE]
    out = tmp_path / "killed.jsonl"

    # When the CLI is SIGKILLed twice mid-job, and the same command is run again
    for at_least in (5, 20):
        proc = llmq_process(*args, env=subprocess_env(url), stderr=subprocess.PIPE)
        try:
            wait_for(lambda n=at_least: len(_jsonl(out)) >= n, 90, f"{at_least} rows written")
        finally:
            proc.kill()
            proc.wait(10)
        assert len(_jsonl(out)) < 40
    ok(llmq(*args, url=url))
    # And the same job runs uninterrupted under another name
    whole = _pipeline(tmp_path, "in.parquet", "whole.jsonl", "whole")
    ok(llmq("run", str(whole), "--queue", QUEUE, url=url))

    # Then the killed job's output has every row once, equal to the uninterrupted run's rows
    # (its ids the same but for the job's name)
    resumed, uninterrupted = _jsonl(out), _jsonl(tmp_path / "whole.jsonl")
    assert [row["llmq_row"] for row in resumed] == list(range(40))

    def comparable(row: dict, name: str) -> dict:
        """Ids without the job's name; usage without the prefix cache's hits (the second run
        finds the first one's prompts cached)."""
        return {k: (v.removeprefix(name) if k.endswith("_id") and v else
                    {**v, "cached_prompt_tokens": None} if k.endswith("_usage") and v else v)
                for k, v in row.items()}

    assert ([comparable(row, "killed.") for row in resumed]
            == [comparable(row, "whole.") for row in uninterrupted])
    # And no request of the killed job was queued twice
    queued = Counter(json.loads(fields[b"json"])["id"]
                     for stream in (QUEUE, CLASSIFY)
                     for _, fields in r.xrange(KEYS.lane_stream(stream, "batch"))
                     if json.loads(fields[b"json"]).get("id", "").startswith("killed."))
    assert max(queued.values()) == 1
    assert len(queued) == 40 + 20  # every summary, and the labels of the kept half


def test_a_worker_killed_mid_job_loses_no_row(url: str, tiny_model_path: Path,
                                             tmp_path: Path) -> None:
    # Given a one-stage job on a queue of its own, served by one slow worker
    queue = "ds-worker-kill"
    first = serve(url, tiny_model_path, tmp_path, "ds-kill-1", queue=queue,
                  fault="slow_step:30", max_num_seqs=4)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"n": i}) + "\n" for i in range(30)))
    out = tmp_path / "out.jsonl"
    proc = llmq_process("run", "--dataset", str(tmp_path / "in.jsonl"), "-o", str(out),
                        "--map", "prompt=Count to {{ n }}", "--map", "max_tokens=8",
                        "--map", "ignore_eos=true", "--queue", queue,
                        env=subprocess_env(url), stderr=subprocess.PIPE)
    second = None
    try:
        # When the worker is SIGKILLed with rows in flight, and another takes its place
        wait_for(lambda: len(_jsonl(out)) >= 5, 60, "5 rows written")
        first.kill()
        assert len(_jsonl(out)) < 30
        second = serve(url, tiny_model_path, tmp_path, "ds-kill-2", queue=queue)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        first.stop()
        if second is not None:
            second.stop()

    # Then the job finishes with every row once, each a whole answer
    assert proc.returncode == 0, stderr
    rows = _jsonl(out)
    assert [row["llmq_row"] for row in rows] == list(range(30))
    assert all(row["result_usage"]["completion_tokens"] == 8 for row in rows)
    assert not _jsonl(tmp_path / "out.errors.jsonl")
