"""ProgressPublisher: a dataset job's progress saved to the broker's job store as it runs.

    publisher = ProgressPublisher(client, spec, runner="cli")
    DatasetJob(client, spec, on_tick=publisher).run()       # a save every second at most
    publisher.final(job.progress, "completed", summary)

The store (broker/job_progress.py) is what `llmq run status` and `llmq run list` read, for a job
in this CLI or on an rq batch worker, and what the gateway's dashboard can show. The record's id
is the job's (`job_id_for`): a rerun of the same job, here or under rq, updates the same record.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.broker.job_progress import JobProgress, JobRecord
from llmq.jobs.pipeline import default_job_name
from llmq.jobs.progress import DatasetProgress
from llmq.jobs.spec import JobSpec

__all__ = ["ProgressPublisher", "job_id_for", "job_name_for"]

_INTERVAL = 1.0  # s between saves while the job runs
_STOP_INTERVAL = 2.0  # s between looks for a stop (`llmq run cancel`)


def job_name_for(spec: JobSpec) -> str:
    """The job's name: its own, else derived from the output's absolute path."""
    return spec.name or default_job_name(spec.output)


def job_id_for(spec: JobSpec) -> str:
    """The job's id in the job store and on rq: one per job name."""
    return f"run-{job_name_for(spec)}"


class ProgressPublisher:
    def __init__(self, client: Client, spec: JobSpec, *, runner: str,
                 also: Callable[[DatasetProgress], None] | None = None) -> None:
        self.client = client
        self.store = JobProgress(client.keys)
        self.job_id = job_id_for(spec)
        self.name = job_name_for(spec)
        self.runner = runner
        self.source = spec.source.path
        self.output = spec.output
        self.also = also  # another watcher called on every tick (the CLI's status line)
        self._saved_at = 0.0
        self._stop_checked_at = 0.0

    def __call__(self, progress: DatasetProgress) -> None:
        if self.also is not None:
            self.also(progress)
        now = time.monotonic()
        if now - self._saved_at >= _INTERVAL or progress.phase != "running":
            self._saved_at = now
            self.save(progress.record(self.job_id, self.name, state="running",
                                      runner=self.runner, source=self.source,
                                      output=self.output))

    def final(self, progress: DatasetProgress, state: str, message: str = "") -> None:
        self.save(progress.record(self.job_id, self.name, state=state, runner=self.runner,
                                  source=self.source, output=self.output, message=message))

    def should_stop(self) -> bool:
        """Whether `llmq run cancel` asked the job to stop (looked up every 2 s at most)."""
        now = time.monotonic()
        if now - self._stop_checked_at < _STOP_INTERVAL:
            return False
        self._stop_checked_at = now
        return send(self.client, self.store.stop_requested(self.job_id))

    def clear_stop(self) -> None:
        send(self.client, self.store.clear_stop(self.job_id))

    def save(self, record: JobRecord) -> None:
        send(self.client, self.store.save(record))
