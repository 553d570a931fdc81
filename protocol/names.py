"""The name rules of the wire: what a queue name, request id, worker id or tenant may be.

Every such name becomes part of a Redis key, so it is checked once here, by the request decoder
(`llmq.protocol.requests`), the key builder (`llmq.broker.keys`) and the gateway alike.
"""

from __future__ import annotations

import re
from typing import TypeGuard

from llmq.protocol.errors import LLMQError

__all__ = [
    "NAME_PATTERN",
    "TENANT_PATTERN",
    "InvalidName",
    "is_valid_name",
    "is_valid_tenant",
    "tenant_of",
    "validate_name",
]

NAME_PATTERN = r"[A-Za-z0-9_.:-]{1,128}"
_NAME_RE = re.compile(NAME_PATTERN)
# NOTE: no `:` in a tenant name, so `<tenant>:<id>` splits one way only.
TENANT_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
_TENANT_RE = re.compile(TENANT_PATTERN)


class InvalidName(LLMQError, ValueError):
    """A queue name, request id, worker id or prefix that may not become part of a key."""


def is_valid_name(value: object) -> TypeGuard[str]:
    # fullmatch, not match: `$` would let a trailing newline through.
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None


def is_valid_tenant(value: object) -> bool:
    return isinstance(value, str) and _TENANT_RE.fullmatch(value) is not None


def tenant_of(request_id: str) -> str | None:
    """The tenant a request id belongs to: what comes before its first `:`, if it has one.

    Such an id is a tenant's (`<tenant>:<id>`): only that tenant's producer user can write its
    keys, and a worker runs an entry with it only when the id's marker names that entry (it was
    queued by the submit function, which the tenant alone can run for its ids)."""
    tenant, colon, _ = request_id.partition(":")
    return tenant if colon else None


def validate_name(kind: str, value: object) -> str:
    """`value` if it is a valid `kind` (queue, request_id, worker_id); InvalidName if not."""
    if is_valid_name(value):
        return value
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise InvalidName(f"invalid {kind} {shown}: must match {NAME_PATTERN}")
