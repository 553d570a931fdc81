"""Every Redis key llmq uses, built in one place (after arq's `constants.py`).

Key schema, shown with the default prefix `llmq` (`LLMQ_PREFIX` changes it):

    llmq:q:<queue>          stream    requests; consumer group `workers` (created at id 0, so
                                      entries added before the first worker are still delivered)
    llmq:r:<request_id>     stream    one request's events (start, delta, done, error), capped with
                                      MAXLEN and expired `result_ttl` seconds after the last write
    llmq:dlq:<queue>        stream    dead letters: the original payload plus a `dead_letter` field
    llmq:cancel:<queue>     stream    cancellations every worker of the queue follows (XREAD `$`)
    llmq:x:<request_id>     string    cancel flag with TTL, checked when a worker admits a request
    llmq:ctl:<queue>        stream    utility calls (reset_prefix_cache, sleep, wake_up, profile,
                                      stats) every worker of the queue follows (XREAD `$`);
                                      admin-only (deploy/acl.conf)
    llmq:ctlr:<call_id>     stream    the workers' answers to one utility call, with TTL
    llmq:id:<request_id>    string    idempotency marker set by the producer's submit script: the
                                      entry id of the first submission, with TTL
    llmq:hb:<queue>         hash      entry id -> times a draining worker handed it back; those
                                      deliveries do not count towards `max_deliveries`
    llmq:w:<worker_id>      hash      worker heartbeat with TTL (model, running, waiting, KV use...)
    llmq:workers            zset      worker registry: worker_id -> last heartbeat (unix ms); a
                                      member whose `llmq:w:` hash has expired is dead and is
                                      removed by whoever notices
    llmq:queues             set       queue names that have a consumer group (for `llmq status`)
    llmq:batch:<batch_id>:input    string  an `llmq batch` input file (OpenAI batch JSONL), TTL
    llmq:batch:<batch_id>:output   list    its output lines in input order, written by the rq job
    llmq:batch:<batch_id>:errors   list    its error lines (failed validation or generation)
    llmq:batch:<batch_id>:cancel   string  cancel flag the batch job checks, TTL
    llmq:file:<tenant>:<file_id>   string  a file uploaded to the gateway (`POST /v1/files`), TTL
    llmq:file:<tenant>:<file_id>:meta  hash  its name, purpose, size and times (for a batch's
                                      output or error file: the batch it comes from), TTL
    llmq:files:<tenant>     zset      a tenant's file ids by creation time (unix s)
    llmq:batches:<tenant>   zset      a tenant's gateway batch ids by creation time (unix s)
    llmq:sse:<request_id>   hash      how the gateway streams a request (endpoint, usage chunk,
                                      keep on disconnect), so any replica can resume it; TTL
    llmq:dash:series        stream    the dashboard's chart samples (one per interval, entry id =
                                      the interval's start in ms), capped to the last hour

Gateway request ids are `<tenant>:<id>`: a tenant's keys all start `<prefix>:r:<tenant>:` and so
on, which is what its API key, and an ACL rule per tenant, can reach.

Queue names, request ids and worker ids must match `[A-Za-z0-9_.:-]{1,128}`: no spaces, braces,
globs or newlines, so nothing taken from a payload can add a Cluster hash tag (`{}`), widen a
SCAN pattern (`*`) or break a log line. The prefix may be a hash tag itself (`{llmq}`) to put every
key in one Redis Cluster slot, which the producer's submit script needs there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmq.broker.errors import LLMQError

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_QUEUE",
    "GROUP",
    "NAME_PATTERN",
    "TENANT_PATTERN",
    "InvalidName",
    "Keys",
    "is_valid_name",
    "is_valid_tenant",
    "validate_name",
]

DEFAULT_PREFIX = "llmq"
DEFAULT_QUEUE = "default"
GROUP = "workers"  # the one consumer group on every request stream

NAME_PATTERN = r"[A-Za-z0-9_.:-]{1,128}"
_NAME_RE = re.compile(NAME_PATTERN)
# NOTE: no `:` in a tenant name, so `<tenant>:<id>` splits one way only.
TENANT_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
_TENANT_RE = re.compile(TENANT_PATTERN)
# NOTE: a prefix is configuration, not payload, so it alone may carry a whole Cluster hash tag.
_PREFIX_RE = re.compile(r"\{[A-Za-z0-9_.:-]{1,62}\}|[A-Za-z0-9_.:-]{1,64}")


class InvalidName(LLMQError, ValueError):
    """A queue name, request id, worker id or prefix that may not become part of a key."""


def is_valid_name(value: object) -> bool:
    # fullmatch, not match: `$` would let a trailing newline through.
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None


def is_valid_tenant(value: object) -> bool:
    return isinstance(value, str) and _TENANT_RE.fullmatch(value) is not None


def validate_name(kind: str, value: object) -> str:
    """`value` if it is a valid `kind` (queue, request_id, worker_id); InvalidName if not."""
    if is_valid_name(value):
        return value  # type: ignore[return-value]
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise InvalidName(f"invalid {kind} {shown}: must match {NAME_PATTERN}")


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix; every method validates the name it puts into the key."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not _PREFIX_RE.fullmatch(self.prefix):
            raise InvalidName(
                f"invalid prefix {self.prefix!r}: must match [A-Za-z0-9_.:-]{{1,64}} "
                "or be one hash tag such as {llmq}")

    def queue(self, queue: str) -> str:
        """Request stream of `queue` (consumer group `GROUP`)."""
        return f"{self.prefix}:q:{validate_name('queue', queue)}"

    def dlq(self, queue: str) -> str:
        """Dead-letter stream of `queue`."""
        return f"{self.prefix}:dlq:{validate_name('queue', queue)}"

    def handbacks(self, queue: str) -> str:
        """Voluntary hand-backs per pending entry of `queue` (not held against it as poison)."""
        return f"{self.prefix}:hb:{validate_name('queue', queue)}"

    def cancel(self, queue: str) -> str:
        """Cancellation stream every worker of `queue` follows."""
        return f"{self.prefix}:cancel:{validate_name('queue', queue)}"

    def control(self, queue: str) -> str:
        """Utility-call stream every worker of `queue` follows (admin-only)."""
        return f"{self.prefix}:ctl:{validate_name('queue', queue)}"

    def control_reply(self, call_id: str) -> str:
        """Answers to one utility call, one entry per worker."""
        return f"{self.prefix}:ctlr:{validate_name('call_id', call_id)}"

    def result(self, request_id: str) -> str:
        """Event stream of one request."""
        return f"{self.prefix}:r:{validate_name('request_id', request_id)}"

    def cancel_flag(self, request_id: str) -> str:
        """Cancel flag of one request (a string with TTL)."""
        return f"{self.prefix}:x:{validate_name('request_id', request_id)}"

    def idempotency(self, request_id: str) -> str:
        """Marker of a submitted request id: the entry id of its first submission."""
        return f"{self.prefix}:id:{validate_name('request_id', request_id)}"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker."""
        return f"{self.prefix}:w:{validate_name('worker_id', worker_id)}"

    def workers(self) -> str:
        """Registry of workers: sorted set worker_id -> last heartbeat in unix ms."""
        return f"{self.prefix}:workers"

    def queues(self) -> str:
        """Set of queue names that have a consumer group."""
        return f"{self.prefix}:queues"

    def batch_input(self, batch_id: str) -> str:
        """Input file of an `llmq batch` job (the OpenAI batch JSONL as submitted)."""
        return f"{self.prefix}:batch:{validate_name('batch_id', batch_id)}:input"

    def batch_output(self, batch_id: str) -> str:
        """Output lines of a batch job (a list, in input order)."""
        return f"{self.prefix}:batch:{validate_name('batch_id', batch_id)}:output"

    def batch_errors(self, batch_id: str) -> str:
        """Error lines of a batch job (a list, in input order)."""
        return f"{self.prefix}:batch:{validate_name('batch_id', batch_id)}:errors"

    def batch_cancel(self, batch_id: str) -> str:
        """Cancel flag of a batch job."""
        return f"{self.prefix}:batch:{validate_name('batch_id', batch_id)}:cancel"

    def file(self, tenant: str, file_id: str) -> str:
        """Content of a file uploaded to the gateway."""
        return f"{self.prefix}:file:{_tenant(tenant)}:{validate_name('file_id', file_id)}"

    def file_meta(self, tenant: str, file_id: str) -> str:
        """What the gateway knows of a file (name, purpose, size, times; or its batch)."""
        return self.file(tenant, file_id) + ":meta"

    def tenant_files(self, tenant: str) -> str:
        """A tenant's file ids, scored by creation time."""
        return f"{self.prefix}:files:{_tenant(tenant)}"

    def tenant_batches(self, tenant: str) -> str:
        """A tenant's gateway batch ids, scored by creation time."""
        return f"{self.prefix}:batches:{_tenant(tenant)}"

    def stream_options(self, request_id: str) -> str:
        """How the gateway streams one request, for a resume on any replica."""
        return f"{self.prefix}:sse:{validate_name('request_id', request_id)}"

    def dashboard_series(self) -> str:
        """The dashboard's rolling samples of the pool (every gateway replica reads the same)."""
        return f"{self.prefix}:dash:series"


def _tenant(tenant: str) -> str:
    if is_valid_tenant(tenant):
        return tenant
    raise InvalidName(f"invalid tenant {tenant!r:.60}: must match {TENANT_PATTERN}")
