"""A dataset job as an rq job: `llmq run JOB.yaml --rq`, run by `llmq batch-worker`.

The dataset job runs on the rq queue `llmq-batch`, beside the OpenAI-format batches
(gateway/batch_job.py), so the batch workers that run those run these, with the same survival:

- the job is enqueued with rq's retries (gateway/batch_store.py `RETRY_INTERVALS`), and holds
  the batches' lease (`BatchRecords.hold_lease`, renewed by a thread every few seconds, also
  while a long source loads or the output converts): a batch worker that finds the job
  `started` with no lease (its work horse was SIGKILLed) hands it back to rq, which retries it;
- a retry is a rerun of the same job, and a rerun resumes (jobs/pipeline.py): it keeps the rows
  the output and the errors file hold, and follows, not requeues, what the dead run had queued.

So the files are the checkpoint, and they live where the job file says, on the batch worker's
file system: a batch worker runs a dataset job only with the dataset and the output folder at
the same paths as where it was submitted (the same machine, or a shared volume); a Hugging Face
id is read through the worker's own cache. The tokens never pass through rq.

Progress goes to the rq job's meta in the batches' names (`status`, `total`, `completed`,
`failed`: `llmq batch list` shows a dataset job too) and to the broker's job store
(broker/job_progress.py: `llmq run status`, `llmq run list`, the dashboard).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import redis

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client, client_for_rq_job
from llmq.broker.exchange import send
from llmq.jobs.pipeline import DatasetJob, JobStopped
from llmq.jobs.progress import DatasetProgress
from llmq.jobs.published import ProgressPublisher
from llmq.jobs.spec import job_from_mapping
from llmq.jobs.templates import SpecError
from llmq.protocol.errors import LLMQError

__all__ = ["LeaseKeeper", "run_dataset_job"]

logger = logging.getLogger(__name__)

LEASE_MS = 15_000  # the lease lapses this long after its last renewal (a batch's is the same)
_RENEW_S = 3.0
_META_INTERVAL = 1.0  # s between saves of the rq job's meta
# NOTE: gateway/batch_store.py's RQ_URL_VAR; llmq.jobs does not import the gateway.


class LeaseKeeper:
    """Holds the job's lease from a thread until `release()`: the job is alive while it runs,
    whatever the main thread is busy with."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.records = BatchRecords(client.keys)
        self.job_id = job_id
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renew()  # held before the job does anything
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        send(self.client, self.records.hold_lease(self.job_id, self.token, LEASE_MS))

    def _run(self) -> None:
        while not self._stop.wait(_RENEW_S):
            try:
                self._renew()
            except (LLMQError, redis.RedisError) as exc:  # the job itself will say so
                logger.warning("dataset job %s: lease not renewed: %s", self.job_id, exc)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        send(self.client, self.records.release_lease(self.job_id))


class _RqMeta:
    """The rq job's meta, in a batch's names, saved once a second at most."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self._saved_at = 0.0

    def __call__(self, progress: DatasetProgress, status: str = "in_progress",
                 **fields: Any) -> None:
        now = time.monotonic()
        if status == "in_progress" and now - self._saved_at < _META_INTERVAL:
            return
        self._saved_at = now
        self.job.meta.update(status=status, total=progress.total_rows or 0,
                             completed=progress.num_done - progress.num_failed_rows,
                             failed=progress.num_failed_rows, stage=progress.stage(), **fields)
        self.job.save_meta()


def run_dataset_job(job_id: str, job: dict[str, Any], base_dir: str, prefix: str,
                    queue: str) -> dict[str, Any]:
    """rq entry point (JSON arguments): the job file's mapping, its paths relative to
    `base_dir`, with the submitting command's flags applied."""
    from rq import get_current_job

    rq_job = get_current_job()
    assert rq_job is not None, "run_dataset_job runs inside an rq job"
    client = client_for_rq_job(rq_job.connection, prefix=prefix, queue=queue)
    try:
        lease = LeaseKeeper(client, job_id)
        try:
            return _run(client, rq_job, job, base_dir)
        finally:
            lease.release()
    finally:
        client.close()


def _run(client: Client, rq_job: Any, data: dict[str, Any], base_dir: str) -> dict[str, Any]:
    meta = _RqMeta(rq_job)
    try:
        spec = job_from_mapping(data, base_dir)
    except SpecError as exc:  # the submitting CLI checked it: a different llmq here, say
        rq_job.meta.update(status="failed", error=str(exc), failed_at=int(time.time()))
        rq_job.save_meta()
        return {"status": "failed", "error": str(exc)}
    publisher = ProgressPublisher(client, spec, runner="rq", also=meta)
    dataset_job = DatasetJob(client, spec, on_tick=publisher,
                             should_stop=publisher.should_stop)
    if rq_job.meta.get("in_progress_at") is None:
        rq_job.meta["in_progress_at"] = int(time.time())
    try:
        dataset_job.run()
    except JobStopped:
        message = (f"cancelled with {dataset_job.progress.num_done} rows written; queue it "
                   "again to resume")
        publisher.final(dataset_job.progress, "cancelled", message)
        meta(dataset_job.progress, "cancelled", cancelled_at=int(time.time()))
        return {"status": "cancelled"}
    except SpecError as exc:  # the source cannot be read here, a stage clashes with a column
        publisher.final(dataset_job.progress, "failed", str(exc))
        meta(dataset_job.progress, "failed", error=str(exc), failed_at=int(time.time()))
        return {"status": "failed", "error": str(exc)}
    except Exception as exc:
        # NOTE: rq retries the job (a rerun resumes), unless it is out of retries.
        state = "retrying" if rq_job.retries_left else "failed"
        publisher.final(dataset_job.progress, state, f"{type(exc).__name__}: {exc}")
        raise
    progress = dataset_job.progress
    if dataset_job.finished_before:
        message = f"{spec.output} was already complete (remove it to run the job again)"
        progress.num_resumed = dataset_job.writer.num_rows + dataset_job.writer.num_errors
    else:
        message = progress.summary(spec.output, spec.errors_path, dataset_job.writer.num_rows,
                                   dataset_job.writer.num_errors)
    publisher.final(progress, "completed", message)
    meta(progress, "completed", completed_at=int(time.time()))
    logger.info("dataset job %s completed: %s", publisher.job_id, message.splitlines()[0])
    return {"status": "completed", "rows": dataset_job.writer.num_rows,
            "errors": dataset_job.writer.num_errors}
