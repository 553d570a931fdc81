"""ResultGatherer: follow many requests' result streams at once, for file and batch jobs.

`Client.events()` follows one request; a file of thousands would need thousands of readers. The
gatherer reads every pending result stream with one XREAD per few hundred keys (pipelined), folds
each stream's events by the attempt rule (`Transcript`), and hands back the requests that have
ended. When nothing new has arrived it blocks on the oldest pending streams for a moment, so an
idle wait costs one round trip per poll, not a busy loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmq.broker.client import Client
from llmq.broker.commands import decode_result_entry
from llmq.broker.connection import translate_errors
from llmq.broker.transcript import Transcript

__all__ = ["ResultGatherer"]

_KEYS_PER_READ = 256  # streams per XREAD: bounds one command's size
_ENTRIES_PER_STREAM = 512


class ResultGatherer:
    def __init__(self, client: Client) -> None:
        self.client = client
        # request_id -> (transcript, result stream key, last entry id read); insertion-ordered, so
        # the oldest pending requests are the ones a blocking read waits on.
        self._pending: dict[str, tuple[Transcript, str, bytes | str]] = {}
        self._by_key: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            if request_id not in self._pending:
                key = self.client.keys.result(request_id)
                self._pending[request_id] = (Transcript(request_id), key, "0-0")
                self._by_key[key] = request_id

    def discard(self, request_id: str) -> None:
        transcript_key = self._pending.pop(request_id, None)
        if transcript_key is not None:
            self._by_key.pop(transcript_key[1], None)

    def pending_ids(self) -> list[str]:
        return list(self._pending)

    def poll(self, block_ms: int = 250) -> list[Transcript]:
        """The requests that ended since the last poll (each once), waiting up to `block_ms`."""
        if not self._pending:
            return []
        arrived = self._read_all()
        if not arrived and block_ms > 0:
            arrived = self._read_blocking(block_ms)
        return self._finish()

    # -- reading ----------------------------------------------------------------------------------

    def _read_all(self) -> bool:
        items = list(self._pending.items())
        with translate_errors(self.client.url):
            pipe = self.client.redis.pipeline(transaction=False)
            for start in range(0, len(items), _KEYS_PER_READ):
                chunk = items[start:start + _KEYS_PER_READ]
                pipe.xread({key: last for _, (_, key, last) in chunk},
                           count=_ENTRIES_PER_STREAM)
            replies = pipe.execute()
        return any([self._apply(reply) for reply in replies])

    def _read_blocking(self, block_ms: int) -> bool:
        chunk = list(self._pending.values())[:_KEYS_PER_READ]
        with translate_errors(self.client.url):
            reply = self.client.redis.xread({key: last for _, key, last in chunk},
                                            count=_ENTRIES_PER_STREAM, block=block_ms)
        return self._apply(reply)

    def _apply(self, reply: Any) -> bool:
        """Fold an XREAD reply (RESP2 list or RESP3 dict) into the transcripts."""
        if not reply:
            return False
        streams = reply.items() if isinstance(reply, dict) else reply
        for key, entries in streams:
            key = key.decode() if isinstance(key, bytes) else key
            if entries and isinstance(entries[0], list):  # RESP3 wraps each stream's entries
                entries = entries[0]
            request_id = self._by_key.get(key)
            if request_id is None:
                continue
            transcript, _, last = self._pending[request_id]
            for entry_id, fields in entries:
                last = entry_id
                event = decode_result_entry(request_id, entry_id, fields)
                if event is not None:
                    transcript.apply(event)
            self._pending[request_id] = (transcript, key, last)
        return True

    def _finish(self) -> list[Transcript]:
        done = [t for t, _, _ in self._pending.values() if t.finished]
        for transcript in done:
            self.discard(transcript.request_id)
        return done
