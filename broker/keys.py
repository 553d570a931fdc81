"""Every Redis key llmq uses, built in one place (after arq's `constants.py`).

Key schema v3 (protocol version 3), shown with the default prefix `llmq` (`LLMQ_PREFIX` changes
it). The `{...}` part of a name is its Redis Cluster hash tag: only it picks the slot, so what one
script or transaction touches shares a slot, while result streams, the hot write path, spread over
the cluster by request id. A single server reads the braces as plain characters: one schema for
both, no mode flag.

  queue slot, tag = the queue name (the submit function, acks, dead letters, hand-backs):
    llmq:q:{<queue>}        stream    requests; consumer group `workers` (created at id 0, so
                                      entries added before the first worker are still delivered)
    llmq:dlq:{<queue>}      stream    dead letters: the original payload plus a `dead_letter` field
    llmq:cancel:{<queue>}   stream    cancellations every worker of the queue follows (XREAD `$`)
    llmq:hb:{<queue>}       hash      entry id -> times a draining worker handed it back; those
                                      deliveries do not count towards `max_deliveries`
    llmq:ctl:{<queue>}      stream    utility calls (reset_prefix_cache, sleep, wake_up, profile,
                                      stats) every worker of the queue follows (XREAD `$`);
                                      admin-only (deploy/acl.conf)
    llmq:sub:{<queue>}      hash      entry id -> request id of each submission through the submit
                                      function until it is acked, so one that vanished unread is
                                      still answered (`lost_payload`)
    llmq:lost:{<queue>}     string    how many entries were trimmed unread so far (reported once
                                      each: a dead letter, a metric, `llmq status`)
    llmq:id:{<queue>}:<request_id>    string  idempotency marker set by the submit function: the
                                      entry id of the first submission, with TTL
    llmq:aff:{<queue>}:s:<worker_id>  string  cache affinity: the prefixes a worker's cache holds
                                      (packed 64-bit landmark hashes, worker/affinity_keeper.py),
                                      TTL heartbeat_timeout; gone while it drains or sleeps
    llmq:aff:{<queue>}:t:<worker_id>  stream  cache affinity: tickets (`entry` = a request entry id)
                                      of entries handed to that worker, pending under it, that it
                                      has not taken yet; peers take them after a delay
    llmq:aff:{<queue>}:members        zset    workers with a summary or tickets -> last publish ms
    llmq:q:{<queue>}:batch  stream    the batch lane of producers without a tenant
                                      (broker/work_lanes.py), consumer group `workers`;
                                      interactive work without a tenant is llmq:q:{<queue>}
    llmq:sub:{<queue>}:batch          hash  its submission records
    llmq:t:q:{<queue>}:<lane>:<tenant>, llmq:t:sub:{<queue>}:<lane>:<tenant>   a tenant's lane
                                      streams (`interactive`, `batch`) and their records, under
                                      `llmq:t:` like a tenant's ids, so that the shared producer's
                                      `~llmq:q:*` matches none and a tenant's `~llmq:t:q:{*}:*:acme`
                                      matches its own only (tenant names hold no `:`)
    llmq:lanes:{<queue>}    hash      lane -> the last entry id the submit function added to it,
                                      and `last` -> the last lane entry id of the queue (lane ids
                                      are unique across the queue's streams)

  request slot, tag = the request id:
    llmq:r:{<request_id>}   stream    one request's events (start, delta, done, error), capped with
                                      MAXLEN and expired `result_ttl` seconds after the last write
    llmq:x:{<request_id>}   string    cancel flag with TTL, checked when a worker admits a request
    llmq:sse:{<request_id>} hash      how the gateway streams a request (endpoint, usage chunk,
                                      keep on disconnect), so any replica can resume it; TTL

  a tenant's ids (`<tenant>:<id>`, any id with a `:`) have their per-request keys, and their
  markers, under a space of their own, `llmq:t:`, so that an ACL can hand a tenant exactly its
  ids (`~llmq:t:r:{acme:*`, `~llmq:t:id:acme:*`) and the shared `producer` user exactly the
  ids without a tenant (`~llmq:r:*` matches no `llmq:t:r:` key; a glob cannot say "no colon",
  a prefix can):
    llmq:t:id:<tenant>:<id>:{<queue>}   llmq:t:r:{<tenant>:<id>}   llmq:t:x:{<tenant>:<id>}
    llmq:t:sse:{<tenant>:<id>}
  (a key such as `llmq:r:{acme:1}` is never read by anyone).

  one key each (no multi-key command needs them together):
    llmq:w:<worker_id>      hash      worker heartbeat with TTL (model, running, waiting, KV use...)
    llmq:workers            zset      worker registry: worker_id -> last heartbeat (unix ms); a
                                      member whose `llmq:w:` hash has expired is dead and is
                                      removed by whoever notices
    llmq:queues             set       queue names that have a consumer group (for `llmq status`)
    llmq:ctlr:<call_id>     stream    the workers' answers to one utility call, with TTL
    llmq:dash:series        stream    the dashboard's chart samples (one per interval, entry id =
                                      the interval's start in ms), capped to the last hour
    llmq:session:<id>       string    a dashboard sign-in: the SHA-256 of the key it was made with;
                                      TTL (its lifetime), deleted at logout
    llmq:job:{<job_id>}     string    a dataset job's (`llmq run`) progress record (JSON), with
                                      `:stop` its cancel flag; `llmq:jobs` the ids by last update
                                      (zset): broker/job_progress.py

  batch slot, tag = the batch id (the batch job rewrites its output and errors together):
    llmq:batch:{<batch_id>}:input    list    an `llmq batch` input file (OpenAI batch JSONL), in
                                             4 MiB pieces (broker/pieced_bytes.py), TTL
    llmq:batch:{<batch_id>}:output   list    its output lines in input order, written by the rq job
    llmq:batch:{<batch_id>}:errors   list    its error lines (failed validation or generation)
    llmq:batch:{<batch_id>}:cancel   string  cancel flag the batch job checks, TTL
    llmq:batch:{<batch_id>}:lines    hash    checkpoint: run line index -> its finished record, TTL
    llmq:batch:{<batch_id>}:lease    string  the running job's token, PX (renewed while it runs)

  tenant slot, tag = the gateway tenant (a file, its record and the tenant's index are written in
  one transaction):
    llmq:file:{<tenant>}:<file_id>       list    a file uploaded to the gateway, in pieces, TTL
    llmq:file:{<tenant>}:<file_id>:meta  hash    its name, purpose, size and times (for a batch's
                                         output or error file: the batch it comes from), TTL
    llmq:files:{<tenant>}   zset      a tenant's file ids by creation time (unix s)
    llmq:batches:{<tenant>} zset      a tenant's gateway batch ids by creation time (unix s)

Queue names, request ids and worker ids must match `[A-Za-z0-9_.:-]{1,128}`: no spaces, braces,
globs or newlines, so nothing taken from a payload can add or close a hash tag, widen a SCAN
pattern (`*`) or break a log line. The prefix may not hold braces either: every key carries its
own tag.

Version 1 named the request stream `llmq:q:<queue>` (no tag); `legacy_queue()` builds that name
so workers and clients can find a v1 stream and refuse to run beside it (`schema_mismatch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmq.protocol.names import (
    NAME_PATTERN,
    TENANT_PATTERN,
    InvalidName,
    is_valid_name,
    is_valid_tenant,
    tenant_of,
    validate_name,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_QUEUE",
    "GROUP",
    "NAME_PATTERN",
    "PROTOCOL_VERSION",
    "TENANT_PATTERN",
    "InvalidName",
    "Keys",
    "is_valid_name",
    "is_valid_tenant",
    "tenant_of",
    "validate_name",
]

DEFAULT_PREFIX = "llmq"
DEFAULT_QUEUE = "default"
GROUP = "workers"  # the one consumer group on every request stream

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# NOTE: goes up when key names or the wire change incompatibly; workers report it in their
# heartbeat (`protocol`). 2: Cluster hash tags in the key names, submission by FCALL.
# 3: a tenant's ids' keys under `llmq:t:` (an ACL space of their own).
PROTOCOL_VERSION = 3


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix; every method validates the name it puts into the key."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not _PREFIX_RE.fullmatch(self.prefix):
            raise InvalidName(
                f"invalid prefix {self.prefix!r}: must match [A-Za-z0-9_.:-]{{1,64}} (no braces: "
                "every key carries its own Cluster hash tag)")

    # -- the queue's slot -------------------------------------------------------------------------

    def queue(self, queue: str) -> str:
        """Request stream of `queue` (consumer group `GROUP`)."""
        return f"{self.prefix}:q:{_tag('queue', queue)}"

    def dlq(self, queue: str) -> str:
        """Dead-letter stream of `queue`."""
        return f"{self.prefix}:dlq:{_tag('queue', queue)}"

    def handbacks(self, queue: str) -> str:
        """Voluntary hand-backs per pending entry of `queue` (not held against it as poison)."""
        return f"{self.prefix}:hb:{_tag('queue', queue)}"

    def cancel(self, queue: str) -> str:
        """Cancellation stream every worker of `queue` follows."""
        return f"{self.prefix}:cancel:{_tag('queue', queue)}"

    def submissions(self, queue: str) -> str:
        """Entry id -> request id of each submission not yet acked (the submit function's)."""
        return f"{self.prefix}:sub:{_tag('queue', queue)}"

    def lane_stream(self, queue: str, lane: str) -> str:
        """Request stream of one lane of `queue` (`batch`, `batch:<tenant>`,
        `interactive:<tenant>`; broker/work_lanes.py names them)."""
        return f"{self._lane_space(lane)}:q:{_tag('queue', queue)}:{lane}"

    def lane_submissions(self, queue: str, lane: str) -> str:
        """A lane stream's submission records (entry id -> request id until acked)."""
        return f"{self._lane_space(lane)}:sub:{_tag('queue', queue)}:{lane}"

    def _lane_space(self, lane: str) -> str:
        """`<prefix>:t` for a tenant's lane (`<class>:<tenant>`), else the prefix."""
        validate_name("lane", lane)
        return f"{self.prefix}:t" if tenant_of(lane) is not None else self.prefix

    def lanes(self, queue: str) -> str:
        """The lanes of `queue` that the submit function wrote to (lane -> its last entry id)."""
        return f"{self.prefix}:lanes:{_tag('queue', queue)}"

    def control(self, queue: str) -> str:
        """Utility-call stream every worker of `queue` follows (admin-only)."""
        return f"{self.prefix}:ctl:{_tag('queue', queue)}"

    def lost_unread(self, queue: str) -> str:
        """How many of `queue`'s entries were trimmed before any worker read them, as reported
        so far (worker/unread_loss.py)."""
        return f"{self.prefix}:lost:{_tag('queue', queue)}"

    def idempotency(self, queue: str, request_id: str) -> str:
        """Marker of a request id submitted to `queue`: the entry id of its first submission.

        In the queue's slot, so the submit function touches one slot. A tenant's id comes
        before the queue's tag (`llmq:t:id:acme:1:{<queue>}`): a glob's `*` matches braces too,
        so `llmq:t:id:{*}:acme:*` would also match bob's id `bob:acme:1`, while
        `llmq:t:id:acme:*` matches acme's ids alone."""
        request_id = validate_name("request_id", request_id)
        if tenant_of(request_id) is not None:
            return f"{self._space(request_id)}:id:{request_id}:{_tag('queue', queue)}"
        return f"{self.prefix}:id:{_tag('queue', queue)}:{request_id}"

    def affinity_summary(self, queue: str, worker_id: str) -> str:
        """What `worker_id`'s prefix cache holds, for peers routing `queue`'s entries."""
        return f"{self.prefix}:aff:{_tag('queue', queue)}:s:{validate_name('worker_id', worker_id)}"

    def affinity_tickets(self, queue: str, worker_id: str) -> str:
        """Tickets of `queue`'s entries handed to `worker_id` for its prefix cache."""
        return f"{self.prefix}:aff:{_tag('queue', queue)}:t:{validate_name('worker_id', worker_id)}"

    def affinity_members(self, queue: str) -> str:
        """Workers of `queue` with an affinity summary or tickets, scored by last publish (ms)."""
        return f"{self.prefix}:aff:{_tag('queue', queue)}:members"

    def legacy_queue(self, queue: str) -> str:
        """The version-1 name of `queue`'s request stream, only to detect one left behind."""
        return f"{self.prefix}:q:{validate_name('queue', queue)}"

    def _space(self, request_id: str) -> str:
        """Where a (valid) request id's keys live: `<prefix>:t` for a tenant's id, else the
        prefix."""
        return f"{self.prefix}:t" if tenant_of(request_id) is not None else self.prefix

    def _per_request(self, kind: str, request_id: str) -> str:
        tag = _tag("request_id", request_id)
        return f"{self._space(request_id)}:{kind}:{tag}"

    # -- the request's slot -----------------------------------------------------------------------

    def result(self, request_id: str) -> str:
        """Event stream of one request."""
        return self._per_request("r", request_id)

    def cancel_flag(self, request_id: str) -> str:
        """Cancel flag of one request (a string with TTL)."""
        return self._per_request("x", request_id)

    def stream_options(self, request_id: str) -> str:
        """How the gateway streams one request, for a resume on any replica."""
        return self._per_request("sse", request_id)

    # -- one key each -----------------------------------------------------------------------------

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker."""
        return f"{self.prefix}:w:{validate_name('worker_id', worker_id)}"

    def workers(self) -> str:
        """Registry of workers: sorted set worker_id -> last heartbeat in unix ms."""
        return f"{self.prefix}:workers"

    def dashboard_session(self, session_id: str) -> str:
        """One dashboard sign-in (the key digest it was made with), with its TTL."""
        return f"{self.prefix}:session:{validate_name('session_id', session_id)}"

    def queues(self) -> str:
        """Set of queue names that have a consumer group."""
        return f"{self.prefix}:queues"

    def control_reply(self, call_id: str) -> str:
        """Answers to one utility call, one entry per worker."""
        return f"{self.prefix}:ctlr:{validate_name('call_id', call_id)}"

    # -- a batch's slot ---------------------------------------------------------------------------

    def batch_input(self, batch_id: str) -> str:
        """Input file of an `llmq batch` job (the OpenAI batch JSONL as submitted)."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:input"

    def batch_output(self, batch_id: str) -> str:
        """Output lines of a batch job (a list, in input order)."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:output"

    def batch_errors(self, batch_id: str) -> str:
        """Error lines of a batch job (a list, in input order)."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:errors"

    def batch_cancel(self, batch_id: str) -> str:
        """Cancel flag of a batch job."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:cancel"

    def batch_lines(self, batch_id: str) -> str:
        """Checkpoint of a batch job: the records of the lines that have finished."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:lines"

    def batch_lease(self, batch_id: str) -> str:
        """Lease of the job running a batch: gone when that job died."""
        return f"{self.prefix}:batch:{_tag('batch_id', batch_id)}:lease"

    # -- a gateway tenant's slot ------------------------------------------------------------------

    def file(self, tenant: str, file_id: str) -> str:
        """Content of a file uploaded to the gateway."""
        return f"{self.prefix}:file:{{{_tenant(tenant)}}}:{validate_name('file_id', file_id)}"

    def file_meta(self, tenant: str, file_id: str) -> str:
        """What the gateway knows of a file (name, purpose, size, times; or its batch)."""
        return self.file(tenant, file_id) + ":meta"

    def tenant_files(self, tenant: str) -> str:
        """A tenant's file ids, scored by creation time."""
        return f"{self.prefix}:files:{{{_tenant(tenant)}}}"

    def tenant_batches(self, tenant: str) -> str:
        """A tenant's gateway batch ids, scored by creation time."""
        return f"{self.prefix}:batches:{{{_tenant(tenant)}}}"

    def dashboard_series(self) -> str:
        """The dashboard's rolling samples of the pool (every gateway replica reads the same)."""
        return f"{self.prefix}:dash:series"



def _tag(kind: str, value: object) -> str:
    """`{value}`: a validated name as the key's Cluster hash tag."""
    return "{" + validate_name(kind, value) + "}"


def _tenant(tenant: str) -> str:
    if is_valid_tenant(tenant):
        return tenant
    raise InvalidName(f"invalid tenant {tenant!r:.60}: must match {TENANT_PATTERN}")
