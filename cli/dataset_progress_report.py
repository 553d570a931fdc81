"""DatasetProgressReport: `llmq run` saves its job's progress where the dashboard reads it.

Called on the job's ticks (between rounds, a few times a second) it saves at most once a second
(broker/dataset_progress.py), and once more at the end with the outcome. Saving is a courtesy
to whoever watches: a Redis that refuses it (a tenant's ACL user has no rights to the key) turns
it off with one warning, never the job.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from llmq.broker.client import Client
from llmq.broker.dataset_progress import DatasetJobRecord, DatasetJobStatus, DatasetProgress
from llmq.broker.exchange import send
from llmq.protocol.errors import LLMQError

if TYPE_CHECKING:
    from llmq.jobs.pipeline import DatasetJob

__all__ = ["DatasetProgressReport"]

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 1.0


class DatasetProgressReport:
    def __init__(self, client: Client, job: DatasetJob) -> None:
        self.client = client
        self.job = job
        self.store = DatasetProgress(client.keys)
        self.started_ms = int(time.time() * 1000)
        self.saved_at = 0.0
        self.enabled = True

    def __call__(self, _progress: Any) -> None:
        if time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            self.save("running")

    def save(self, status: DatasetJobStatus) -> None:
        if not self.enabled:
            return
        self.saved_at = time.monotonic()
        job, progress = self.job, self.job.progress
        record = DatasetJobRecord(
            name=job.name, status=status, total_rows=progress.total_rows,
            num_done=job.writer.num_rows + job.writer.num_errors,
            num_failed=job.writer.num_errors,
            num_tokens=sum(s.num_tokens for s in progress.stages.values()),
            started_ms=self.started_ms, updated_ms=int(time.time() * 1000),
            stages=list(progress.stages), output=job.spec.output)
        try:
            send(self.client, self.store.save(record))
        except LLMQError as exc:
            self.enabled = False
            logger.warning("the job's progress is not shown on the dashboard: %s", exc)
