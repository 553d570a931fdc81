"""BatchStore: OpenAI-format batches as rq jobs, for `llmq batch` and the gateway's Batch API.

A batch is one rq job (`batch_job.run_batch`) on the rq queue `llmq-batch`, served by
`llmq batch-worker`; its progress lives in the job's meta under OpenAI's names. This module
enqueues, finds, summarises and cancels them, with synchronous redis-py (rq's own); the gateway
calls it from a thread. What llmq itself keeps of a batch (input, results, the cancel flag) is
`llmq.broker.batch_records`, sent through a sync `Client`. rq is imported only when a batch is
touched.

A batch outlives its batch worker: the job is enqueued with retries and backoff
(`RETRY_INTERVALS`; rq's scheduler, which `llmq batch-worker` runs, requeues the later ones),
and resumes from its checkpoint (gateway/batch_job.py). A worker killed with its work horse
leaves the job `started` until rq's heartbeat lapses (90 s and more); `BatchWorker` looks
sooner, at each of its maintenance rounds: a started batch whose lease has lapsed
(`rescue_abandoned`) is handed to rq's own cleanup, which retries it or, with no retries left,
fails it, and the batch then keeps what it had (`fail_with_checkpoint`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import RQ_URL_VAR, Client
from llmq.broker.connection import connect, is_cluster
from llmq.broker.exchange import send
from llmq.broker.redis_url import RedisURL
from llmq.protocol.errors import BrokerUnavailable, LLMQError

__all__ = ["BATCH_QUEUE", "FINAL_STATUSES", "RETRY_INTERVALS", "RQ_URL_VAR", "BatchStore",
           "batch_status", "batch_summary", "new_batch_worker", "rq_connection"]


BATCH_QUEUE = "llmq-batch"  # the rq queue `llmq batch-worker` serves
FINAL_STATUSES = ("completed", "cancelled", "failed", "expired")
# s before each rq retry of a batch job that died or raised. NOTE: the first is at once: a rerun
# resumes from the checkpoint, so it costs little, and a delayed retry needs rq's scheduler,
# whose lock a killed batch worker keeps for a minute.
RETRY_INTERVALS = [0, 30, 120]
_MAINTENANCE_S = 5  # s between a batch worker's looks for abandoned batches
_PUBSUB_READ_S = 1  # s a batch worker's command-channel read waits; bounds its stop
_MAINTENANCE_LOCK_S = 30  # s rq's registry-cleaning lock may outlive its holder
_DAY = 24 * 3600


def batch_status(job: Any) -> str:
    """OpenAI's batch status, from the job's meta and rq's own status."""
    rq_status = job.get_status(refresh=False)
    rq_status = getattr(rq_status, "value", rq_status)
    status = job.meta.get("status", "queued")
    if rq_status in ("failed", "stopped") and status not in FINAL_STATUSES:
        return "failed"
    if rq_status == "canceled":
        return "cancelled"
    return status


def batch_summary(job: Any) -> dict[str, Any]:
    meta = job.meta
    rq_status = job.get_status(refresh=False)
    summary = {
        "id": job.id, "object": "batch", "status": batch_status(job),
        "rq_status": getattr(rq_status, "value", rq_status),
        "input_file": meta.get("input_file"), "queue": meta.get("queue"),
        "request_counts": {"total": meta.get("total", 0), "completed": meta.get("completed", 0),
                           "failed": meta.get("failed", 0)},
        "created_at": meta.get("created_at"), "in_progress_at": meta.get("in_progress_at"),
        "completed_at": meta.get("completed_at"), "cancelled_at": meta.get("cancelled_at"),
    }
    if meta.get("errors"):  # validation refused the file: OpenAI's `errors.data` entries
        summary["errors"] = meta["errors"]
    elif summary["status"] == "failed" and job.exc_info:
        summary["error"] = job.exc_info.strip().splitlines()[-1]
    return summary


def rq_connection(llmq_redis: Any) -> redis.Redis:
    """The Redis rq keeps its queue and jobs in: `LLMQ_RQ_REDIS_URL` when set, else llmq's own.

    rq runs multi-key transactions over keys without hash tags, so it cannot use a Redis
    Cluster: there it needs a server (or Sentinel group) of its own. Only rq's keys go there;
    the batch's input, output and the requests themselves stay with llmq."""
    url = os.environ.get(RQ_URL_VAR, "").strip()
    if url:
        if RedisURL.parse(url).kind == "cluster":
            raise BrokerUnavailable(f"{RQ_URL_VAR} names a Redis Cluster, which rq cannot use: "
                                    "give it one server or a Sentinel group")
        return connect(url)
    if is_cluster(llmq_redis):
        raise BrokerUnavailable(
            f"batches run on rq, which cannot use a Redis Cluster: set {RQ_URL_VAR} to a plain "
            "Redis (or Sentinel) for rq's jobs; the jobs still submit through the cluster")
    return llmq_redis


class BatchStore:
    """`connection`: rq's Redis (`rq_connection`); `client`: llmq's, for the batch's own keys
    (the same server unless llmq runs on a cluster)."""

    def __init__(self, connection: redis.Redis, client: Client) -> None:
        from rq import Queue
        from rq.serializers import JSONSerializer

        self.rq = connection
        self.client = client
        self.keys = client.keys
        self.records = BatchRecords(client.keys)
        self.serializer = JSONSerializer
        self.queue = Queue(BATCH_QUEUE, connection=connection, serializer=JSONSerializer)
        self._rq_llmq_client: Client | None = None

    def enqueue(self, batch_id: str, *, queue: str, max_in_flight: int, ttl: int, timeout: int,
                description: str, meta: dict[str, Any], tenant: str | None = None,
                input_key: str | None = None) -> Any:
        """Queue the job of a batch whose input is stored (at `input_key`, else its own key)."""
        from rq import Retry

        from llmq.gateway.batch_job import run_batch

        # NOTE: the deadline is the batch's: from its creation, whatever retries cost.
        kwargs: dict[str, Any] = {"batch_id": batch_id, "prefix": self.keys.prefix,
                                  "queue": queue, "max_in_flight": max_in_flight, "ttl": ttl,
                                  "deadline": int(time.time()) + timeout}
        if tenant is not None:
            kwargs.update(tenant=tenant, input_key=input_key)
        return self.queue.enqueue_call(
            run_batch, job_id=batch_id, timeout=timeout, result_ttl=ttl, failure_ttl=ttl,
            description=description, kwargs=kwargs,
            retry=Retry(max=len(RETRY_INTERVALS), interval=RETRY_INTERVALS),
            meta={"status": "queued", "total": 0, "completed": 0, "failed": 0, "queue": queue,
                  "created_at": int(time.time()), **meta})

    def fetch(self, batch_id: str) -> Any:
        """The batch's rq job; LLMQError when rq no longer knows it."""
        from rq.exceptions import NoSuchJobError
        from rq.job import Job

        try:
            return Job.fetch(batch_id, connection=self.rq, serializer=self.serializer)
        except (NoSuchJobError, ValueError):
            raise LLMQError(f"unknown batch {batch_id}: no such rq job (batches expire after "
                            "their ttl)") from None

    def fetch_many(self, batch_ids: list[str]) -> list[Any]:
        from rq.job import Job

        return [job for job in Job.fetch_many(batch_ids, connection=self.rq,
                                              serializer=self.serializer) if job is not None]

    def all_ids(self) -> list[str]:
        """Every batch rq still keeps: queued, running and finished ones."""
        ids = list(self.queue.get_job_ids())
        for registry in (self.queue.started_job_registry, self.queue.finished_job_registry,
                         self.queue.failed_job_registry, self.queue.canceled_job_registry):
            ids += registry.get_job_ids()
        return list(dict.fromkeys(ids))

    def cancel(self, job: Any) -> str:
        """Stop a batch: 'cancelled' if it never started, else 'cancelling' (the job winds down:
        no more submissions, unfinished requests cancelled); its status if already final."""
        status = batch_status(job)
        if status in FINAL_STATUSES:
            return status
        send(self.client, self.records.request_cancel(job.id, int(job.result_ttl or 7 * _DAY)))
        if job.get_status() in ("queued", "deferred", "scheduled"):
            job.cancel()  # never started: rq drops it, nothing was submitted
            job.meta.update(status="cancelled", cancelled_at=int(time.time()))
            job.save_meta()
            return "cancelled"
        return "cancelling"  # the job sees the flag within a poll and says so in its meta

    def has_workers(self) -> bool:
        from rq import Worker

        return bool(Worker.all(queue=self.queue))

    def cap_maintenance_lock(self) -> None:
        """rq's lock on cleaning the queue's registries lasts 15 minutes when its holder dies
        holding it (a SIGKILL, Redis going away mid-clean): meanwhile nothing requeues a job
        stranded between dequeue and start. Capped, it outlives a dead holder briefly."""
        send(self._rq_client(), self.records.cap_ttl(self.queue.registry_cleaning_key,
                                                       _MAINTENANCE_LOCK_S))

    def rescue_abandoned(self, lease_s: float) -> list[str]:
        """Hand the started batches whose run is gone (no lease for `lease_s`) to rq's cleanup:
        each is retried, or failed with what it has when out of retries or past its deadline.
        The ids of those it found."""
        from rq.job import JobStatus
        from rq.registry import StartedJobRegistry

        registry: StartedJobRegistry = self.queue.started_job_registry
        abandoned = []
        for member in send(self._rq_client(), self.records.registry_members(registry.key)):
            batch_id = member.split(":", 1)[0]
            try:
                job = self.fetch(batch_id)
            except LLMQError:
                continue
            started = job.started_at.timestamp() if job.started_at else time.time()
            if (job.get_status() != JobStatus.STARTED or time.time() - started < lease_s
                    or send(self.client, self.records.lease_holder(batch_id)) is not None):
                continue
            abandoned.append(job)
            if time.time() > float(job.kwargs.get("deadline") or float("inf")):
                job.retries_left = 0  # past its deadline: no retry can help
                job.save()
            # NOTE: rq's own cleanup acts on executions whose heartbeat has lapsed; this one's
            # run is known dead (no lease), so its heartbeat is made to have lapsed.
            send(self._rq_client(), self.records.lapse(registry.key, member))
        if abandoned:
            registry.cleanup()
        # NOTE: also the batches rq failed itself (a work horse that died or raised with no
        # retries left): they too end with what their checkpoint has.
        for batch_id in self.queue.failed_job_registry.get_job_ids():
            try:
                job = self.fetch(batch_id)
            except LLMQError:
                continue
            if job.meta.get("status") not in FINAL_STATUSES:
                self.fail_with_checkpoint(job)
        return [job.id for job in abandoned]

    def fail_with_checkpoint(self, job: Any) -> None:
        """A batch that cannot run again ends `failed` with the lines its checkpoint has."""
        from llmq.gateway.batch_job import checkpointed_results

        outputs, errors = checkpointed_results(self.client, job.id)
        send(self.client, self.records.write_results(job.id, outputs, errors,
                                                     int(job.result_ttl or 7 * _DAY)))
        job.meta.update(status="failed", failed_at=int(time.time()), completed=len(outputs),
                        failed=len(errors))
        job.save_meta()

    def _rq_client(self) -> Client:
        """A `Client` on rq's Redis, to send exchanges about rq's own keys."""
        if self.rq is self.client.redis:
            return self.client
        if self._rq_llmq_client is None:
            self._rq_llmq_client = Client(connection=self.rq, prefix=self.keys.prefix)
        return self._rq_llmq_client

    def results(self, batch_id: str) -> tuple[list[bytes], list[bytes]]:
        """(output lines, error lines) a finished batch wrote."""
        return send(self.client, self.records.results(batch_id))


def new_batch_worker(store: BatchStore, name: str | None) -> Any:
    """The rq worker `llmq batch-worker` runs: rq's, plus a look for abandoned batches at each
    maintenance round (every few seconds rather than rq's ten minutes), and a command-channel
    thread that stops within a second of being asked."""
    from rq import Worker

    from llmq.gateway.batch_job import LEASE_MS

    class BatchWorker(Worker):
        def run_maintenance_tasks(self) -> None:
            store.cap_maintenance_lock()
            super().run_maintenance_tasks()
            for batch_id in store.rescue_abandoned(LEASE_MS / 1000):
                self.log.warning("batch %s was abandoned by its worker: handed back to rq",
                                 batch_id)

        def subscribe(self) -> None:
            # rq reads its command channel with a 60 s timeout, and redis-py's `stop()` waits
            # for that read. When the UNSUBSCRIBE reply lands before `stop()` clears the thread's
            # flag, the thread goes back to wait up to 60 s for a subscription, and a SIGTERMed
            # worker takes that long to exit. A short read bounds the stop.
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # rq types it None
                sleep_time=_PUBSUB_READ_S, daemon=True,
                exception_handler=self._pubsub_exception_handler)

    # NOTE: worker_ttl bounds how long an idle worker blocks between maintenance rounds.
    return BatchWorker([store.queue], connection=store.rq, serializer=store.serializer,
                       name=name, maintenance_interval=_MAINTENANCE_S,
                       worker_ttl=_MAINTENANCE_S + 15)
