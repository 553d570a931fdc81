"""The Files API the Batch API needs: upload, look up, download, list, delete.

    POST   /v1/files                 multipart: `file`, `purpose` ("batch")
    GET    /v1/files                 GET /v1/files/{file_id}       GET /v1/files/{file_id}/content
    DELETE /v1/files/{file_id}

An upload is kept in Redis under its tenant (`<prefix>:file:<tenant>:<file_id>`, with a `:meta`
hash) for `--file-ttl`; another key's tenant never finds it. A batch's output and error files are
records that point at the lists its job wrote, readable once the batch has finished.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.commands import as_str
from llmq.gateway.errors import APIError, bad_request, not_found
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol.names import is_valid_name

__all__ = ["FileStore", "delete_file", "file_content", "get_file", "list_files", "upload_file"]

_PURPOSES = ("batch",)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    """A tenant's files in Redis, through the gateway's AsyncClient."""

    def __init__(self, state: GatewayState, tenant: str) -> None:
        self.state = state
        self.client = state.client
        self.keys = state.keys
        self.tenant = tenant

    async def create(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id, now, ttl = new_file_id(), int(time.time()), self.state.settings.file_ttl
        meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": len(data),
                "created_at": now, "expires_at": now + ttl,
                "lines": sum(1 for line in data.splitlines() if line.strip())}

        async def write() -> None:
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.set(self.keys.file(self.tenant, file_id), data, ex=ttl)
            pipe.hset(self.keys.file_meta(self.tenant, file_id), mapping=meta)
            pipe.expire(self.keys.file_meta(self.tenant, file_id), ttl)
            pipe.zadd(self.keys.tenant_files(self.tenant), {file_id: now})
            pipe.expire(self.keys.tenant_files(self.tenant), ttl)
            await pipe.execute()

        await self.client.call(write)
        return meta

    async def record_batch_file(self, file_id: str, batch_id: str, kind: str) -> None:
        """The record of a batch's output (`kind` output) or error file (`errors`)."""
        now, ttl = int(time.time()), self.state.settings.file_ttl
        meta = {"id": file_id, "filename": f"{batch_id}_{kind}.jsonl",
                "purpose": "batch_output", "created_at": now, "expires_at": now + ttl,
                "batch": batch_id, "kind": kind}

        async def write() -> None:
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.hset(self.keys.file_meta(self.tenant, file_id), mapping=meta)
            pipe.expire(self.keys.file_meta(self.tenant, file_id), ttl)
            pipe.zadd(self.keys.tenant_files(self.tenant), {file_id: now})
            await pipe.execute()

        await self.client.call(write)

    async def meta(self, file_id: str) -> dict[str, str]:
        """The file's record; APIError 404 when this tenant has no such file."""
        if not is_valid_name(file_id):
            raise not_found(f"no file {file_id!r:.60}")
        raw = await self.client.call(lambda: self.client.redis.hgetall(
            self.keys.file_meta(self.tenant, file_id)))
        if not raw:
            raise not_found(f"no file {file_id!r} (unknown, another key's, or expired)")
        return {as_str(k): as_str(v) for k, v in raw.items()}

    async def content(self, meta: dict[str, str]) -> bytes:
        if "batch" in meta:
            key = (self.keys.batch_output if meta["kind"] == "output"
                   else self.keys.batch_errors)(meta["batch"])
            lines = await self.client.call(lambda: self.client.redis.lrange(key, 0, -1))
            return b"".join(line + b"\n" for line in lines)
        data = await self.client.call(lambda: self.client.redis.get(
            self.keys.file(self.tenant, meta["id"])))
        if data is None:
            raise not_found(f"the content of file {meta['id']!r} has expired")
        return data

    async def delete(self, file_id: str) -> None:
        await self.meta(file_id)

        async def remove() -> None:
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.delete(self.keys.file(self.tenant, file_id),
                        self.keys.file_meta(self.tenant, file_id))
            pipe.zrem(self.keys.tenant_files(self.tenant), file_id)
            await pipe.execute()

        await self.client.call(remove)

    async def list(self) -> list[dict[str, Any]]:
        ids = await self.client.call(lambda: self.client.redis.zrevrange(
            self.keys.tenant_files(self.tenant), 0, 9999))
        files = []
        for file_id in ids:
            try:
                files.append(file_object(await self.meta(as_str(file_id))))
            except APIError:
                continue  # expired
        return files


def file_object(meta: dict[str, str]) -> dict[str, Any]:
    return {"id": meta["id"], "object": "file", "bytes": int(meta.get("bytes", 0)),
            "created_at": int(meta["created_at"]), "expires_at": int(meta["expires_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed",
            "status_details": None}


async def upload_file(request: Request) -> Response:
    state = GatewayState.of(request)
    store = FileStore(state, state.tenant(request))
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
    store = FileStore(state, state.tenant(request))
    meta = await store.meta(request.path_params["file_id"])
    if "batch" in meta:
        meta["bytes"] = str(len(await store.content(meta)))
    return json_response(file_object(meta))


async def file_content(request: Request) -> Response:
    state = GatewayState.of(request)
    store = FileStore(state, state.tenant(request))
    meta = await store.meta(request.path_params["file_id"])
    return Response(await store.content(meta), media_type="application/jsonl")


async def list_files(request: Request) -> Response:
    state = GatewayState.of(request)
    files = await FileStore(state, state.tenant(request)).list()
    return json_response({"object": "list", "data": files,
                          "first_id": files[0]["id"] if files else None,
                          "last_id": files[-1]["id"] if files else None, "has_more": False})


async def delete_file(request: Request) -> Response:
    state = GatewayState.of(request)
    file_id = request.path_params["file_id"]
    await FileStore(state, state.tenant(request)).delete(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})
