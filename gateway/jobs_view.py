"""JobsView: the dashboard's jobs: Batch API / `llmq batch` batches and `llmq run` dataset jobs.

Each row says how far its job is (completed and failed of total), when it was created and how
long it has run (to now, or to when it ended). Who sees what: an admin tenant every batch rq
still keeps (the gateway's and `llmq batch`'s) and every dataset job; any other tenant only the
batches it created through the Batch API, and no dataset jobs (they run under the operator's
Redis user, outside any tenant): the answer's `scope` says which, and the page says so.

Batches are rq jobs (gateway/batch_store.py), read with rq's synchronous client in a thread;
dataset jobs are the records `llmq run` saves, on rq or in a CLI (broker/job_progress.py).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import redis

from llmq.broker.batch_records import BatchRecords
from llmq.broker.exchange import send_async
from llmq.broker.job_progress import JobProgress, JobRecord
from llmq.gateway.batch_store import BatchStore
from llmq.gateway.batches import batch_object
from llmq.gateway.dashboard_session import Viewer
from llmq.gateway.state import GatewayState
from llmq.protocol.errors import LLMQError

__all__ = ["MAX_JOBS", "JobsView"]

MAX_JOBS = 50  # of each kind, newest first
_ENDED = ("completed_at", "failed_at", "cancelled_at", "expired_at")


class JobsView:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def read(self, viewer: Viewer) -> dict[str, Any]:
        now = time.time()
        note = None
        try:
            batches = await self._batches(viewer)
        except (LLMQError, redis.RedisError) as exc:
            batches, note = [], f"batches cannot be read: {exc}"
        rows = sorted((_batch_row(b, viewer, now) for b in batches),
                      key=lambda row: row["created_at"], reverse=True)[:MAX_JOBS]
        datasets: list[dict[str, Any]] = []
        if viewer.admin:
            store = JobProgress(self.state.keys)
            ids = await send_async(self.state.client, store.recent_ids(MAX_JOBS))
            records = await send_async(self.state.client, store.many(ids))
            datasets = [_dataset_row(r, now) for r in records if r.kind == "dataset"]
        return {"scope": "pool" if viewer.admin else "tenant", "batches": rows,
                "datasets": datasets, "note": note}

    async def _batches(self, viewer: Viewer) -> list[dict[str, Any]]:
        """The batches in the viewer's reach, as the Batch API shows them."""
        state = self.state
        ids: list[str] | None = None
        if not viewer.admin:
            ids = (await send_async(state.client, BatchRecords(state.keys).tenant_batch_ids(
                viewer.tenant)))[:MAX_JOBS]

        def read() -> list[dict[str, Any]]:
            store = BatchStore(state.rq_redis, state.sync_client)
            wanted = store.all_ids() if ids is None else ids
            objects = []
            for job in store.fetch_many(wanted):
                tenant = job.meta.get("tenant")
                if viewer.admin or tenant == viewer.tenant:
                    objects.append({**batch_object(job), "tenant": tenant})
            return objects

        return await anyio.to_thread.run_sync(read)


def _batch_row(batch: dict[str, Any], viewer: Viewer, now: float) -> dict[str, Any]:
    counts = batch["request_counts"]
    created = batch["created_at"] or 0
    ended = next((batch[k] for k in _ENDED if batch.get(k)), None)
    return {"kind": "batch", "id": batch["id"], "status": batch["status"],
            "tenant": batch["tenant"] if viewer.admin else None,
            "endpoint": batch.get("endpoint"), "completed": counts["completed"],
            "failed": counts["failed"], "total": counts["total"], "created_at": created,
            "elapsed_s": round(max(0.0, (ended or now) - created), 1) if created else None}


def _dataset_row(record: JobRecord, now: float) -> dict[str, Any]:
    running = record.state in ("queued", "running", "retrying")
    ended_s = now if running else record.updated
    return {"kind": "dataset", "id": record.name, "status": record.state,
            "completed": record.rows_done - record.rows_failed, "failed": record.rows_failed,
            "total": record.rows_total, "created_at": int(record.started),
            "elapsed_s": round(max(0.0, ended_s - record.started), 1) if record.started else None,
            "updated_s_ago": round(max(0.0, now - record.updated), 1),
            "stages": [stage.name for stage in record.stages],
            "tokens_per_s": record.tokens_per_s}
