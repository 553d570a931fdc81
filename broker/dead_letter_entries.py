"""DeadLetterEntries: a queue's dead letters read and deleted entry by entry, as exchanges.

For views narrower than a whole queue (the dashboard shows a tenant only its own): the newest
ones, one by its id, pages in id order, and deleting chosen ones (XDEL). An entry that is no dead
letter (written by hand) is skipped: there is nothing to show or retry. Whole-queue operations
(list the oldest, retry, purge) are the clients' own (`Client.dead_letters` and the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmq.broker.commands import DeadLetterEntry, parse_dead_letters
from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys
from llmq.protocol import as_str
from llmq.protocol.errors import LLMQError

__all__ = ["DeadLetterEntries", "DeadLetterPage"]


@dataclass(frozen=True)
class DeadLetterPage:
    entries: list[DeadLetterEntry]  # the dead letters among the page's entries
    next_start: str | None  # where the next page starts (XRANGE's exclusive `(id`); None: end


class DeadLetterEntries:
    def __init__(self, keys: Keys, queue: str) -> None:
        self.key = keys.dlq(queue)

    def newest(self, count: int) -> Exchange[list[DeadLetterEntry]]:
        """Among the newest `count` entries, the dead letters, newest first."""
        return Exchange(lambda pipe: pipe.xrevrange(self.key, count=count),
                        lambda replies: _dead_letters(replies[0]))

    def entry(self, dlq_entry_id: str) -> Exchange[DeadLetterEntry | None]:
        """The dead letter of that entry id; None when there is none."""
        def parse(replies: list[Any]) -> DeadLetterEntry | None:
            found = _dead_letters(replies[0])
            return found[0] if found else None

        return Exchange(lambda pipe: pipe.xrange(self.key, dlq_entry_id, dlq_entry_id), parse)

    def page(self, start: str, count: int) -> Exchange[DeadLetterPage]:
        """Up to `count` entries from `start` ("-": the oldest) on."""
        def parse(replies: list[Any]) -> DeadLetterPage:
            entries = replies[0]
            more = len(entries) >= count
            return DeadLetterPage(_dead_letters(entries),
                                  "(" + as_str(entries[-1][0]) if more else None)

        return Exchange(lambda pipe: pipe.xrange(self.key, start, "+", count=count), parse)

    def delete(self, dlq_entry_ids: list[str]) -> Exchange[int]:
        """Delete those entries; how many there were."""
        return Exchange(lambda pipe: pipe.xdel(self.key, *dlq_entry_ids),
                        lambda replies: int(replies[0]))


def _dead_letters(entries: list[Any]) -> list[DeadLetterEntry]:
    parsed = []
    for entry in entries:
        try:
            parsed += parse_dead_letters([entry])
        except LLMQError:
            continue  # not a dead letter: nothing to show or retry
    return parsed
