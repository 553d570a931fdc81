"""`llmq run`: a dataset through a job file's pipeline, or through one `--map`ped stage.

    llmq run job.yaml                                   # stages, dedup, output: docs/datasets.md
    llmq run --dataset docs.parquet -o out.parquet \\
        --map prompt='Summarise: {{ text }}' --map max_tokens=64 --map temperature=0
    llmq run --dataset HuggingFaceFW/fineweb-edu --subset sample-10BT --split train \\
        --max-rows 1000 -o translated.jsonl --map 'messages=[{"role": "user", "content":
        "Translate to German: {{ text }}"}]'

Rerunning the same command resumes: rows already in the output (or the errors file) are skipped,
requests already queued are followed, not queued again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from llmq.cli.dataset_progress_report import DatasetProgressReport
from llmq.cli.helpers import note, open_client, warn_if_unserved
from llmq.cli.options import connection_kwargs, connection_options

if TYPE_CHECKING:
    from llmq.jobs.spec import JobSpec

_PLAIN_INTERVAL = 10.0  # s between progress lines when stderr is not a terminal
_TTY_INTERVAL = 0.5


def _map_items(items: tuple[str, ...]) -> dict[str, Any]:
    """`--map FIELD=VALUE`: VALUE as JSON when it parses (64, [...], {"column": "c"}), else text."""
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"FIELD=VALUE, got {item!r}", param_hint="--map")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    return fields


class _StatusLine:
    """Per-stage progress on stderr: redrawn in place on a terminal, a line now and then else."""

    def __init__(self, enabled: bool | None) -> None:
        self.tty = sys.stderr.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self._drawn_at = 0.0

    def __call__(self, progress: Any) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._drawn_at < (
                _TTY_INTERVAL if self.tty else _PLAIN_INTERVAL):
            return
        self._drawn_at = now
        if self.tty:
            sys.stderr.write("\r\x1b[K" + progress.line())
        else:
            sys.stderr.write(progress.line() + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._drawn_at:
            sys.stderr.write("\n")


@click.command()
@click.argument("job_file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--dataset", metavar="PATH|ID",
              help="Without JOB_FILE: the dataset (a file, a folder, or a Hugging Face id).")
@click.option("--map", "map_items", multiple=True, metavar="FIELD=VALUE",
              help="Without JOB_FILE: a field of the one stage: prompt or messages (Jinja "
                   "templates over the columns), any request field, schema, when, name.")
@click.option("-o", "--output", metavar="PATH",
              help="Output (.jsonl, .csv, .parquet, .arrow); overrides the job file's.")
@click.option("--errors", metavar="PATH", help="Errors file (default: OUTPUT.errors.jsonl).")
@click.option("--split", help="The split of a Hugging Face or saved dataset.")
@click.option("--subset", help="The subset (configuration) of a Hugging Face dataset.")
@click.option("--max-rows", type=click.IntRange(min=1), help="Only the first N rows.")
@click.option("--dedup", "dedup_column", metavar="COLUMN",
              help="Drop rows whose COLUMN nearly repeats an earlier row's (MinHash).")
@click.option("--dedup-threshold", type=click.FloatRange(0, 1, min_open=True), default=0.8,
              show_default=True, help="Estimated Jaccard similarity of word 3-grams.")
@click.option("--name", help="Request ids start with it (default: from the output path).")
@click.option("--max-in-flight", type=click.IntRange(min=1),
              help="Requests queued or running at a time (default 1024).")
@click.option("--progress/--no-progress", default=None,
              help="Per-stage progress on stderr (default: when stderr is a terminal).")
@connection_options
def run(job_file: str | None, dataset: str | None, map_items: tuple[str, ...],
        output: str | None, errors: str | None, split: str | None, subset: str | None,
        max_rows: int | None, dedup_column: str | None, dedup_threshold: float,
        name: str | None, max_in_flight: int | None, progress: bool | None,
        **kwargs: Any) -> None:
    """Run a dataset job: JOB_FILE (YAML: source, output, stages) or --dataset with --map.

    Rows come out in input order with their columns and each stage's result columns; rows that
    cannot run go to the errors file with their row number. Rerun the same command to resume.
    """
    from llmq.jobs.pipeline import DatasetJob  # the dataset layer only for this command
    from llmq.jobs.spec import job_from_mapping, load_job
    from llmq.jobs.templates import SpecError

    if (job_file is None) == (dataset is None):
        raise click.UsageError("give a JOB_FILE or --dataset (with --map), not both")
    if job_file is not None and map_items:
        raise click.UsageError("--map goes with --dataset; a job file has its own stages")
    try:
        if job_file is not None:
            spec = load_job(job_file)
        else:
            if output is None:
                raise click.UsageError("--dataset needs -o OUTPUT")
            data: dict[str, Any] = {"source": {"path": dataset}, "output": output,
                                    "stages": [_map_items(map_items)]}
            spec = job_from_mapping(data, os.getcwd())
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    _override(spec, output, errors, split, subset, max_rows, name, max_in_flight)
    if dedup_column is not None:
        from llmq.jobs.spec import DedupSpec
        spec.dedup = DedupSpec(column=dedup_column, threshold=dedup_threshold)
    client = open_client(**connection_kwargs(kwargs))
    warn_if_unserved(client)
    status = _StatusLine(progress)
    job = DatasetJob(client, spec)
    report = DatasetProgressReport(client, job)  # what the gateway's dashboard shows

    def on_tick(job_progress: Any) -> None:
        status(job_progress)
        report(job_progress)

    job.on_tick = on_tick
    try:
        job.run()
    except SpecError as exc:
        report.save("failed")
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        report.save("failed")
        raise click.FileError(exc.filename or spec.output, exc.strerror) from None
    except KeyboardInterrupt:
        report.save("interrupted")
        status.done()
        note(f"interrupted: {job.progress.num_resumed + job.progress.num_written} rows written; "
             "rerun the same command to resume (queued requests are not queued again)")
        sys.exit(130)
    status.done()
    report.save("completed")
    if job.finished_before:
        note(f"{spec.output} is already complete (remove it to run the job again)")
        return
    note(job.progress.summary(spec.output, spec.errors_path, job.writer.num_rows,
                              job.writer.num_errors))


def _override(spec: JobSpec, output: str | None, errors: str | None, split: str | None,
              subset: str | None, max_rows: int | None, name: str | None,
              max_in_flight: int | None) -> None:
    """Flags given with a job file win over its fields."""
    from dataclasses import replace

    from llmq.jobs.spec import NAME_PATTERN

    if name is not None and not NAME_PATTERN.fullmatch(name):
        raise click.BadParameter(f"1-40 letters, digits, '_' or '-', got {name!r}",
                                 param_hint="--name")
    if output is not None:
        spec.output = output
    if errors is not None:
        spec.errors = errors
    source = spec.source
    spec.source = replace(source, split=source.split if split is None else split,
                          subset=source.subset if subset is None else subset,
                          max_rows=source.max_rows if max_rows is None else max_rows)
    if name is not None:
        spec.name = name
    if max_in_flight is not None:
        spec.max_in_flight = max_in_flight
