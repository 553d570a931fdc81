"""FairShare: deficit round robin over the tenant streams of one lane, in tokens.

After Shreedhar and Varghese, "Efficient fair queuing using deficit round robin" (1995), with
the cost of an entry known only once it is read: each stream holds a deficit of tokens; a round
tops up every backlogged stream by `quantum * weight`, streams with credit left are read, and
what an entry read costs (its prompt estimate plus `max_tokens`) is charged after the fact, so a
stream may go into debt and sits out rounds until the top-ups repay it. A stream found empty
keeps its debt but loses its credit (an idle tenant banks nothing). So over any stretch in which
both have work queued, tenants get tokens in proportion to their weights, whatever the order
and size of their submissions.

Pure arithmetic over a dict; no Redis (worker/stream_reader.py reads the streams it names).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from llmq import protocol
from llmq.broker.replies import Fields
from llmq.protocol.requests import DEFAULT_MAX_TOKENS

__all__ = ["DEFAULT_QUANTUM", "FairShare", "entry_cost", "parse_weights"]

# Tokens a weight-1 stream is credited per round: a few requests' worth, so a round reads a few
# entries of each tenant rather than one.
DEFAULT_QUANTUM = 2048
# A prompt's tokens, estimated from its payload's bytes before it is tokenized (about four
# bytes a token for English text in JSON).
BYTES_PER_TOKEN = 4


def entry_cost(entry_id: str, fields: Fields) -> int:
    """Tokens an entry will cost, estimated before it is tokenized: payload bytes / 4 for the
    prompt plus its `max_tokens` (the default when unset); 1 for an entry that is no request."""
    payload = sum(len(v) for v in fields.values())
    decoded = protocol.decode_request_entry(entry_id, fields)
    if not isinstance(decoded, protocol.DecodedRequest):
        return 1
    request = decoded.request
    return payload // BYTES_PER_TOKEN + (request.max_tokens or DEFAULT_MAX_TOKENS) * request.n


def parse_weights(text: str) -> dict[str, float]:
    """`acme=2,bob=0.5` -> {"acme": 2.0, "bob": 0.5}; ValueError naming the bad item."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, eq, value = item.partition("=")
        try:
            weight = float(value) if eq else math.nan
        except ValueError:
            weight = math.nan
        if not tenant or not weight > 0 or math.isinf(weight):
            raise ValueError(f"tenant weight {item!r}: give <tenant>=<positive number>")
        weights[tenant.strip()] = weight
    return weights


class FairShare:
    """Deficits of the streams of one lane, keyed by tenant ("" for the shared producer)."""

    def __init__(self, weights: Mapping[str, float] | None = None,
                 quantum: int = DEFAULT_QUANTUM) -> None:
        self.weights = dict(weights or {})
        self.quantum = quantum
        self.deficits: dict[str, float] = {}
        self._turn = 0  # rotates who is read first in a round

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def eligible(self, tenants: list[str]) -> list[str]:
        """The tenants to read this round, in turn order: those with credit, after topping up
        every one of `tenants` (all backlogged) by as many rounds as it takes to give one some."""
        if not tenants:
            return []
        deficits = [self.deficits.get(t, 0.0) for t in tenants]
        if max(deficits) <= 0:
            rounds = min(math.floor(-d / (self.quantum * self.weight(t))) + 1
                         for t, d in zip(tenants, deficits, strict=True))
            for t in tenants:
                credit = rounds * self.quantum * self.weight(t)
                self.deficits[t] = self.deficits.get(t, 0.0) + credit
        self._turn = (self._turn + 1) % len(tenants)
        turned = tenants[self._turn:] + tenants[:self._turn]
        return [t for t in turned if self.deficits.get(t, 0.0) > 0]

    def charge(self, tenant: str, tokens: int) -> None:
        self.deficits[tenant] = self.deficits.get(tenant, 0.0) - tokens

    def emptied(self, tenant: str) -> None:
        """The tenant's stream had nothing to read: it keeps a debt, not a credit."""
        self.deficits[tenant] = min(0.0, self.deficits.get(tenant, 0.0))
