"""The Files API the Batch API needs: upload, look up, download, list, delete.

    POST   /v1/files                 multipart: `file`, `purpose` ("batch")
    GET    /v1/files                 GET /v1/files/{file_id}       GET /v1/files/{file_id}/content
    DELETE /v1/files/{file_id}

An upload is kept in Redis under its tenant (`llmq.broker.file_store`) for `--file-ttl`; another
key's tenant never finds it. A batch's output and error files are records that point at the
lists its job wrote, readable once the batch has finished.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.exchange import send_async
from llmq.broker.file_store import FileMeta, FileStore
from llmq.gateway.errors import APIError, bad_request, not_found
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol.names import is_valid_name

__all__ = ["TenantFiles", "delete_file", "file_content", "get_file", "list_files", "upload_file"]

_PURPOSES = ("batch",)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class TenantFiles:
    """A tenant's files, through the gateway's AsyncClient (`llmq.broker.file_store`)."""

    def __init__(self, state: GatewayState, tenant: str) -> None:
        self.state = state
        self.client = state.client
        self.store = FileStore(state.keys, tenant)

    async def create(self, data: bytes, filename: str, purpose: str) -> dict[str, str | int]:
        file_id, now, ttl = new_file_id(), int(time.time()), self.state.settings.file_ttl
        meta: dict[str, str | int] = {
                "id": file_id, "filename": filename, "purpose": purpose, "bytes": len(data),
                "created_at": now, "expires_at": now + ttl,
                "lines": sum(1 for line in data.splitlines() if line.strip())}
        await send_async(self.client, self.store.create(file_id, data, meta, ttl, now))
        return meta

    async def record_batch_file(self, file_id: str, batch_id: str, kind: str) -> None:
        """The record of a batch's output (`kind` output) or error file (`errors`)."""
        now, ttl = int(time.time()), self.state.settings.file_ttl
        meta: dict[str, str | int] = {
                "id": file_id, "filename": f"{batch_id}_{kind}.jsonl",
                "purpose": "batch_output", "created_at": now, "expires_at": now + ttl,
                "batch": batch_id, "kind": kind}
        await send_async(self.client, self.store.record(file_id, meta, ttl, now))

    async def meta(self, file_id: str) -> FileMeta:
        """The file's record; APIError 404 when this tenant has no such file."""
        if not is_valid_name(file_id):
            raise not_found(f"no file {file_id!r:.60}")
        meta = await send_async(self.client, self.store.meta(file_id))
        if meta is None:
            raise not_found(f"no file {file_id!r} (unknown, another key's, or expired)")
        return meta

    async def content(self, meta: FileMeta) -> bytes:
        data = await send_async(self.client, self.store.content(meta))
        if data is None:
            raise not_found(f"the content of file {meta['id']!r} has expired")
        return data

    async def delete(self, file_id: str) -> None:
        await self.meta(file_id)
        await send_async(self.client, self.store.delete(file_id))

    async def list(self) -> list[dict[str, Any]]:
        ids = [i for i in await send_async(self.client, self.store.ids()) if is_valid_name(i)]
        metas = await send_async(self.client, self.store.metas(ids))
        return [file_object(meta) for meta in metas if meta is not None]  # None: expired


def file_object(meta: dict[str, str]) -> dict[str, Any]:
    return {"id": meta["id"], "object": "file", "bytes": int(meta.get("bytes", 0)),
            "created_at": int(meta["created_at"]), "expires_at": int(meta["expires_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed",
            "status_details": None}


async def upload_file(request: Request) -> Response:
    state = GatewayState.of(request)
    store = TenantFiles(state, state.tenant(request))
    limit = state.settings.max_file_bytes
    if int(request.headers.get("content-length") or 0) > limit + 65536:
        raise _too_large(limit)
    async with request.form(max_files=1, max_fields=8) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose not in _PURPOSES:
            raise bad_request(f"`purpose` must be one of {', '.join(_PURPOSES)}, got "
                              f"{purpose!r:.40}", "purpose")
        if upload is None or isinstance(upload, str):
            raise bad_request("the form needs a `file` part", "file")
        data = await upload.read(limit + 1)
        filename = upload.filename or "upload.jsonl"
    if len(data) > limit:
        raise _too_large(limit)
    meta = await store.create(data, filename, str(purpose))
    return json_response(file_object({k: str(v) for k, v in meta.items()}))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the file is larger than the gateway's --max-file-bytes ({limit})",
                    "invalid_request_error", param="file", code="file_too_large")


async def get_file(request: Request) -> Response:
    state = GatewayState.of(request)
    store = TenantFiles(state, state.tenant(request))
    meta = await store.meta(request.path_params["file_id"])
    if "batch" in meta:
        meta["bytes"] = str(len(await store.content(meta)))
    return json_response(file_object(meta))


async def file_content(request: Request) -> Response:
    state = GatewayState.of(request)
    store = TenantFiles(state, state.tenant(request))
    meta = await store.meta(request.path_params["file_id"])
    return Response(await store.content(meta), media_type="application/jsonl")


async def list_files(request: Request) -> Response:
    state = GatewayState.of(request)
    files = await TenantFiles(state, state.tenant(request)).list()
    return json_response({"object": "list", "data": files,
                          "first_id": files[0]["id"] if files else None,
                          "last_id": files[-1]["id"] if files else None, "has_more": False})


async def delete_file(request: Request) -> Response:
    state = GatewayState.of(request)
    file_id = request.path_params["file_id"]
    await TenantFiles(state, state.tenant(request)).delete(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})
