"""DeadLetterView: the dashboard's dead letters, listed, retried and purged within a viewer's reach.

A plain tenant sees, retries and purges only dead letters of its own requests (`<tenant>:<id>`);
an admin tenant reaches every one (requests from `llmq submit` or any other producer have no
tenant, so only an admin sees those). A purge by an admin deletes the queue's whole dead-letter
stream, as `llmq dlq purge` does; a tenant's purge deletes its own entries one by one (XDEL),
leaving everyone else's in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from llmq.broker.aio import AsyncClient
from llmq.broker.commands import DeadLetterEntry
from llmq.broker.dead_letter_entries import DeadLetterEntries
from llmq.broker.exchange import send_async
from llmq.gateway.dashboard_session import Viewer
from llmq.gateway.errors import APIError, not_found
from llmq.protocol.errors import BrokerError, BrokerUnavailable, LLMQError
from llmq.protocol.names import is_valid_name

__all__ = ["DeadLetterView"]

PREVIEW_CHARS = 240
_SCAN_CHUNK = 500  # entries read per round trip when a tenant's purge looks for its own


@dataclass
class DeadLetterView:
    client: AsyncClient

    async def list(self, viewer: Viewer, queues: list[str], *, count: int = 50
                   ) -> list[dict[str, Any]]:
        """The newest `count` dead letters per queue the viewer may see, newest first (a
        tenant's among the newest 4 x `count`: its letters may sit among others')."""
        rows: list[dict[str, Any]] = []
        for queue in queues:
            entries = await send_async(self.client, DeadLetterEntries(
                self.client.keys, queue).newest(count if viewer.admin else count * 4))
            letters = [e for e in entries if viewer.owns(e.dead_letter.request_id)]
            rows += [_row(queue, e, viewer) for e in letters[:count]]
        return sorted(rows, key=lambda row: row["at_ms"], reverse=True)

    async def retry(self, viewer: Viewer, queue: str, dlq_entry_id: str) -> str:
        """Queue the dead letter's request again (the new entry id); 404 when out of reach,
        409 when it kept no payload to queue."""
        entry = await self._reachable(viewer, queue, dlq_entry_id)
        if not entry.payload:
            raise APIError(409, f"dead letter {dlq_entry_id} kept no payload to retry",
                           "invalid_request_error", code="no_payload")
        try:
            return await self.client.retry_dead_letter(dlq_entry_id, queue=queue)
        except (BrokerUnavailable, BrokerError):
            raise
        except LLMQError as exc:  # retried or purged by someone else meanwhile
            raise not_found(str(exc)) from None

    async def purge(self, viewer: Viewer, queue: str) -> int:
        """Delete the queue's dead letters the viewer reaches; how many went."""
        if not is_valid_name(queue):
            raise not_found(f"no queue {queue!r:.60}")
        if viewer.admin:
            return await self.client.purge_dead_letters(queue)
        entries = DeadLetterEntries(self.client.keys, queue)
        removed, start = 0, "-"
        while True:
            page = await send_async(self.client, entries.page(start, _SCAN_CHUNK))
            mine = [e.dlq_entry_id for e in page.entries
                    if viewer.owns(e.dead_letter.request_id)]
            if mine:
                removed += await send_async(self.client, entries.delete(mine))
            if page.next_start is None:
                return removed
            start = page.next_start

    async def _reachable(self, viewer: Viewer, queue: str, dlq_entry_id: str
                         ) -> DeadLetterEntry:
        if is_valid_name(queue) and _is_entry_id(dlq_entry_id):
            entry = await send_async(self.client, DeadLetterEntries(
                self.client.keys, queue).entry(dlq_entry_id))
            if entry is not None and viewer.owns(entry.dead_letter.request_id):
                return entry
        raise not_found(f"no dead letter {dlq_entry_id!r:.40} in queue {queue!r:.60}")


def _row(queue: str, entry: DeadLetterEntry, viewer: Viewer) -> dict[str, Any]:
    letter = entry.dead_letter
    return {"queue": queue, "dlq_entry_id": entry.dlq_entry_id,
            "request_id": viewer.shown_id(letter.request_id), "code": letter.code,
            "message": letter.message, "deliveries": letter.deliveries, "at_ms": letter.at_ms,
            "worker": letter.worker, "payload": _preview(entry.payload)}


def _preview(payload: dict[str, bytes]) -> str:
    """The request as JSON text, cut short; '' when the payload was not kept."""
    if "json" in payload:
        text = payload["json"].decode("utf-8", errors="replace")
    elif "msgpack" in payload:
        try:
            text = msgspec.json.encode(msgspec.msgpack.decode(payload["msgpack"])).decode()
        except (msgspec.DecodeError, TypeError, UnicodeDecodeError):
            text = "(undecodable msgpack)"
    else:
        return ""
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS - 1] + "…"


def _is_entry_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isdigit() and seq.isdigit() and len(value) <= 41
