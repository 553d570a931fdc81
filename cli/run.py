"""`llmq run`: a dataset through a job file's pipeline, or through one `--map`ped stage.

    llmq run job.yaml                                   # stages, dedup, output: docs/datasets.md
    llmq run --dataset docs.parquet -o out.parquet \\
        --map prompt='Summarise: {{ text }}' --map max_tokens=64 --map temperature=0
    llmq run --dataset HuggingFaceFW/fineweb-edu --subset sample-10BT --split train \\
        --max-rows 1000 -o translated.jsonl --map 'messages=[{"role": "user", "content":
        "Translate to German: {{ text }}"}]'
    llmq run job.yaml --rq          # queued as an rq job: `llmq batch-worker` runs it
    llmq run status run-NAME        # progress of a job, here or on rq
    llmq run list                   # the jobs the broker's job store remembers
    llmq run cancel run-NAME        # stop it: rows written stay, rerunning resumes

Rerunning the same command resumes: rows already in the output (or the errors file) are skipped,
requests already queued are followed, not queued again. Under rq a retry of the job (its batch
worker was killed) is such a rerun (jobs/queued.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

import click

from llmq.cli.helpers import note, open_client, warn_if_unserved
from llmq.cli.options import connection_kwargs, connection_options
from llmq.cli.run_queue import (
    cancel_job,
    enqueue,
    job_status,
    list_jobs,
    refuse_if_running_elsewhere,
)

if TYPE_CHECKING:
    from llmq.jobs.pipeline import DatasetJob
    from llmq.jobs.published import ProgressPublisher
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


class _RunGroup(click.Group):
    """`llmq run [JOB_FILE] [OPTIONS]` runs a job (the hidden `start`); `status`, `list` and
    `cancel` are its subcommands. A job file named like one is given as `./status`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands or args[0] == "start":
            args = ["start", *args]
        return super().parse_args(ctx, args)


class _StartCommand(click.Command):
    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        parent = ctx.parent.command_path if ctx.parent is not None else "llmq run"
        formatter.write_usage(parent, "[JOB_FILE] [OPTIONS]  |  status ID  |  list  |  "
                                      "cancel ID")


@click.group(cls=_RunGroup)
def run() -> None:
    """Run a dataset job: JOB_FILE (YAML) or --dataset with --map; `status`, `list`, `cancel`."""


run.add_command(job_status)
run.add_command(list_jobs)
run.add_command(cancel_job)


@run.command("start", cls=_StartCommand, hidden=True)
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
@click.option("--rq", "on_rq", is_flag=True,
              help="Queue the job on rq for `llmq batch-worker` to run (it must see the same "
                   "paths); prints the job id.")
@click.option("--timeout", type=click.IntRange(min=1), default=7 * 24 * 3600,
              show_default=True, help="With --rq: seconds the job may run.")
@connection_options
def start(job_file: str | None, dataset: str | None, map_items: tuple[str, ...],
          output: str | None, errors: str | None, split: str | None, subset: str | None,
          max_rows: int | None, dedup_column: str | None, dedup_threshold: float,
          name: str | None, max_in_flight: int | None, progress: bool | None, on_rq: bool,
          timeout: int, **kwargs: Any) -> None:
    """Run a dataset job: JOB_FILE (YAML: source, output, stages) or --dataset with --map.

    Rows come out in input order with their columns and each stage's result columns; rows that
    cannot run go to the errors file with their row number. Rerun the same command to resume.
    With --rq the job runs on a batch worker; follow it with `llmq run status ID`, list the
    jobs with `llmq run list`, stop one (here or on rq) with `llmq run cancel ID`.
    """
    from llmq.jobs.spec import job_from_mapping
    from llmq.jobs.templates import SpecError

    if job_file is None and dataset is None:
        raise click.UsageError("give a JOB_FILE, or --dataset with --map (or `llmq run status "
                               "ID`, `llmq run list`, `llmq run cancel ID`)")
    if job_file is not None and dataset is not None:
        raise click.UsageError("give a JOB_FILE or --dataset (with --map), not both")
    if job_file is not None and map_items:
        raise click.UsageError("--map goes with --dataset; a job file has its own stages")
    try:
        data, base_dir = _job_mapping(job_file, dataset, map_items, output)
        _override(data, errors, split, subset, max_rows, name, max_in_flight,
                  dedup_column, dedup_threshold, output if job_file is not None else None)
        spec = job_from_mapping(data, base_dir)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    client = open_client(**connection_kwargs(kwargs))
    if on_rq:
        enqueue(client, spec, data, base_dir, timeout)
        return
    _run_here(client, spec, progress)


def _run_here(client: Any, spec: JobSpec, progress: bool | None) -> None:
    from llmq.jobs.pipeline import DatasetJob, JobStopped
    from llmq.jobs.published import ProgressPublisher, job_id_for
    from llmq.jobs.templates import SpecError

    refuse_if_running_elsewhere(client, job_id_for(spec), on_rq=False)
    warn_if_unserved(client)
    status = _StatusLine(progress)
    publisher = ProgressPublisher(client, spec, runner="cli", also=status)
    publisher.clear_stop()
    job = DatasetJob(client, spec, on_tick=publisher, should_stop=publisher.should_stop)
    try:
        job.run()
    except JobStopped:
        _stopped(status, publisher, job, "cancelled", "cancelled (`llmq run cancel`)", "", 1)
    except SpecError as exc:
        publisher.final(job.progress, "failed", str(exc))
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        publisher.final(job.progress, "failed", str(exc))
        raise click.FileError(exc.filename or spec.output, exc.strerror) from None
    except KeyboardInterrupt:
        _stopped(status, publisher, job, "interrupted", "interrupted",
                 " (queued requests are not queued again)", 130)
    status.done()
    if job.finished_before:
        message = f"{spec.output} is already complete (remove it to run the job again)"
    else:
        message = job.progress.summary(spec.output, spec.errors_path, job.writer.num_rows,
                                       job.writer.num_errors)
    publisher.final(job.progress, "completed", message)
    note(message)


def _stopped(status: _StatusLine, publisher: ProgressPublisher, job: DatasetJob, state: str,
             said: str, detail: str, exit_code: int) -> NoReturn:
    """A job stopped before its end: record it as resumable, say so, and exit."""
    status.done()
    publisher.final(job.progress, state, f"{state}; rerun to resume")
    note(f"{said}: {job.progress.num_done} rows written; rerun the same command to resume"
         f"{detail}")
    sys.exit(exit_code)


def _job_mapping(job_file: str | None, dataset: str | None, map_items: tuple[str, ...],
                 output: str | None) -> tuple[dict[str, Any], str]:
    """(the job's mapping, the folder its paths are relative to), from the file or the flags."""
    from llmq.jobs.spec import read_job_file
    from llmq.jobs.templates import SpecError

    if job_file is not None:
        data, base_dir = read_job_file(job_file)
        if not isinstance(data, dict):
            raise SpecError("a job file is a mapping with source, output and stages")
        return data, base_dir
    if output is None:
        raise click.UsageError("--dataset needs -o OUTPUT")
    return ({"source": {"path": dataset}, "output": os.path.abspath(output),
             "stages": [_map_items(map_items)]}, os.getcwd())


def _override(data: dict[str, Any], errors: str | None, split: str | None,
              subset: str | None, max_rows: int | None, name: str | None,
              max_in_flight: int | None, dedup_column: str | None, dedup_threshold: float,
              output: str | None) -> None:
    """Flags given with a job file win over its fields; their paths are the shell's (absolute
    here, so a batch worker elsewhere reads the same)."""
    from llmq.jobs.spec import NAME_PATTERN

    if name is not None and not NAME_PATTERN.fullmatch(name):
        raise click.BadParameter(f"1-40 letters, digits, '_' or '-', got {name!r}",
                                 param_hint="--name")
    if output is not None:
        data["output"] = os.path.abspath(output)
    if errors is not None:
        data["errors"] = os.path.abspath(errors)
    source = data.get("source")
    if any(v is not None for v in (split, subset, max_rows)):
        source = dict(source) if isinstance(source, dict) else {"path": source}
        for key, value in (("split", split), ("subset", subset), ("max_rows", max_rows)):
            if value is not None:
                source[key] = value
        data["source"] = source
    if name is not None:
        data["name"] = name
    if max_in_flight is not None:
        data["max_in_flight"] = max_in_flight
    if dedup_column is not None:
        data["dedup"] = {"column": dedup_column, "threshold": dedup_threshold}
