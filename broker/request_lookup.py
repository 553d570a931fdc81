"""RequestLookup: what Redis knows of a request id, for `llmq result` / `llmq cancel` and the
dashboard's request inspector, as exchanges.

A request id is known while its result stream exists (until `result_ttl` after its last event),
or while it waits in its queue: an id given at submit has an idempotency marker, and an id that
is the stream entry id is found in the queue stream itself.
"""

from __future__ import annotations

import re
from typing import Any

from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys
from llmq.broker.transcript import Fold, Transcript
from llmq.protocol import Event, decode_event
from llmq.protocol.errors import LLMQError

__all__ = ["RequestLookup"]

_ENTRY_ID = re.compile(r"\d+-\d+")


class RequestLookup:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def events(self, request_id: str) -> Exchange[tuple[Transcript, list[Event]]]:
        """The request's events so far, folded by the attempt rule (superseded attempts and
        event types this reader predates dropped), with the transcript they make."""
        def parse(replies: list[Any]) -> tuple[Transcript, list[Event]]:
            transcript, shown = Transcript(request_id), []
            for _, fields in replies[0]:
                try:
                    event = decode_event(fields)
                except LLMQError:
                    continue  # an event type this reader predates
                if transcript.apply(event) is not Fold.IGNORED:
                    shown.append(event)
            return transcript, shown

        return Exchange(lambda pipe: pipe.xrange(self.keys.result(request_id)), parse)

    def marked(self, queue: str, request_id: str) -> Exchange[bool]:
        """Whether the id was given at a submit to `queue` (its idempotency marker lives)."""
        return Exchange(lambda pipe: pipe.exists(self.keys.idempotency(queue, request_id)),
                        lambda replies: bool(replies[0]))

    def in_queue(self, queue: str, request_id: str) -> Exchange[bool] | None:
        """Whether an id that is an entry id waits in `queue`'s stream; None for any other id
        (only an entry id can be found there)."""
        if not _ENTRY_ID.fullmatch(request_id):
            return None
        return Exchange(lambda pipe: pipe.xrange(self.keys.queue(queue), request_id, request_id),
                        lambda replies: bool(replies[0]))

    def known(self, request_id: str, queues: list[str]) -> Exchange[bool]:
        """Whether the request has events, or was submitted with this id to any of `queues`
        (an id alone does not say which queue it went to)."""
        def queue(pipe: Any) -> None:
            pipe.xlen(self.keys.result(request_id))
            for name in queues:
                pipe.get(self.keys.idempotency(name, request_id))

        def parse(replies: list[Any]) -> bool:
            length, *markers = replies
            return bool(length) or any(marker is not None for marker in markers)

        return Exchange(queue, parse)
