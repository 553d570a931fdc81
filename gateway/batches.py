"""The Batch API on the rq batch jobs `llmq batch` runs (a `llmq batch-worker` executes them).

    POST /v1/batches                     {"input_file_id", "endpoint", "completion_window"}
    GET  /v1/batches                     GET /v1/batches/{batch_id}
    POST /v1/batches/{batch_id}/cancel

A batch belongs to the tenant whose key created it (its job's meta says so, and the tenant's
index lists it); its requests run as `<tenant>:<batch_id>.<line>`; its output and error files
appear once it has finished. rq is synchronous, so its calls run in a worker thread.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.batch_records import BatchRecords
from llmq.broker.exchange import send_async
from llmq.gateway.batch_store import FINAL_STATUSES, BatchStore, batch_status
from llmq.gateway.errors import bad_request, not_found
from llmq.gateway.files import TenantFiles, new_file_id
from llmq.gateway.openai_request import CHAT, COMPLETIONS
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol.errors import LLMQError

__all__ = ["cancel_batch", "create_batch", "get_batch", "list_batches"]

_WINDOW = 24 * 3600
# rq/meta status -> OpenAI's
_STATUS = {"queued": "validating", "in_progress": "in_progress", "finalizing": "finalizing",
           "expired": "expired",
           "completed": "completed", "cancelling": "cancelling", "cancelled": "cancelled",
           "failed": "failed"}


def _store(state: GatewayState) -> BatchStore:
    return BatchStore(state.rq_redis, state.sync_client)


def batch_object(job: Any) -> dict[str, Any]:
    meta = job.meta
    status = _STATUS.get(batch_status(job), "in_progress")
    final = status in FINAL_STATUSES
    created = int(meta.get("created_at") or 0)
    errors = None
    if meta.get("errors"):  # the job's validation refused the file (gateway/batch_job.py)
        errors = {"object": "list", "data": meta["errors"]}
    elif status == "failed":
        message = (job.exc_info or "the batch job failed").strip().splitlines()[-1]
        errors = {"object": "list", "data": [{"code": "batch_failed", "message": message,
                                              "param": None, "line": None}]}
    return {
        "id": job.id, "object": "batch", "endpoint": meta.get("endpoint"), "errors": errors,
        "input_file_id": meta.get("input_file_id"), "completion_window": "24h",
        "status": status,
        "output_file_id": meta.get("output_file_id") if final and meta.get("completed") else None,
        "error_file_id": meta.get("error_file_id") if final and meta.get("failed") else None,
        "created_at": created, "in_progress_at": meta.get("in_progress_at"),
        "expires_at": created + _WINDOW, "finalizing_at": meta.get("finalizing_at"),
        "completed_at": meta.get("completed_at"),
        "failed_at": meta.get("failed_at") or (int(time.time()) if status == "failed" else None),
        "expired_at": meta.get("expired_at"), "cancelling_at": meta.get("cancelling_at"),
        "cancelled_at": meta.get("cancelled_at"),
        "request_counts": {"total": meta.get("total", 0), "completed": meta.get("completed", 0),
                           "failed": meta.get("failed", 0)},
        "metadata": meta.get("metadata"),
    }


async def _job(state: GatewayState, tenant: str, batch_id: str) -> Any:
    """The tenant's batch job; 404 for an unknown batch or another tenant's."""
    try:
        job = await anyio.to_thread.run_sync(_store(state).fetch, batch_id)
    except LLMQError:
        job = None
    if job is None or job.meta.get("tenant") != tenant:
        raise not_found(f"no batch {batch_id!r:.60} (unknown, another key's, or expired)")
    return job


async def create_batch(request: Request) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    endpoint = body.get("endpoint")
    if endpoint not in (CHAT, COMPLETIONS):
        raise bad_request(f"`endpoint` must be {CHAT} or {COMPLETIONS}, got {endpoint!r:.60}",
                          "endpoint")
    if body.get("completion_window", "24h") != "24h":
        raise bad_request("`completion_window` must be 24h", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("`metadata` must be an object", "metadata")
    files = TenantFiles(state, tenant)
    input_file_id = str(body.get("input_file_id"))
    meta = await files.meta(input_file_id)
    if meta.get("purpose") != "batch":
        raise bad_request(f"file {input_file_id!r} was not uploaded with purpose batch",
                          "input_file_id")
    batch_id = f"batch_{uuid.uuid4().hex}"
    output_file_id, error_file_id = new_file_id(), new_file_id()
    await files.record_batch_file(output_file_id, batch_id, "output")
    await files.record_batch_file(error_file_id, batch_id, "errors")
    settings = state.settings
    job_meta = {"tenant": tenant, "endpoint": endpoint, "input_file_id": input_file_id,
                "input_file": meta.get("filename"), "total": int(meta.get("lines", 0)),
                "output_file_id": output_file_id, "error_file_id": error_file_id,
                "metadata": metadata}

    def enqueue() -> Any:
        return _store(state).enqueue(
            batch_id, queue=settings.broker.queue, max_in_flight=settings.batch_max_in_flight,
            ttl=settings.file_ttl, timeout=_WINDOW, description=f"gateway batch for {tenant}",
            meta=job_meta, tenant=tenant, input_key=state.keys.file(tenant, input_file_id))

    job = await anyio.to_thread.run_sync(enqueue)
    await send_async(state.client, BatchRecords(state.keys).index(
        tenant, batch_id, int(time.time()), settings.file_ttl))
    return json_response(batch_object(job))


async def get_batch(request: Request) -> Response:
    state = GatewayState.of(request)
    job = await _job(state, state.tenant(request), request.path_params["batch_id"])
    return json_response(batch_object(job))


async def cancel_batch(request: Request) -> Response:
    state = GatewayState.of(request)
    job = await _job(state, state.tenant(request), request.path_params["batch_id"])

    def cancel() -> Any:
        store = _store(state)
        status = store.cancel(job)
        if status == "cancelling" and job.meta.get("status") != "cancelling":
            job.meta["status"] = "cancelling"  # what the job will say within a poll
        return job

    return json_response(batch_object(await anyio.to_thread.run_sync(cancel)))


async def list_batches(request: Request) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    try:
        limit = min(max(int(request.query_params.get("limit", 20)), 1), 100)
    except ValueError:
        raise bad_request("`limit` must be an integer", "limit") from None
    after = request.query_params.get("after")
    ids = await send_async(state.client, BatchRecords(state.keys).tenant_batch_ids(tenant))
    if after in ids:
        ids = ids[ids.index(after) + 1:]
    page, more = ids[:limit], len(ids) > limit
    jobs = await anyio.to_thread.run_sync(_store(state).fetch_many, page)
    data = [batch_object(job) for job in jobs if job.meta.get("tenant") == tenant]
    return json_response({"object": "list", "data": data,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": more})
