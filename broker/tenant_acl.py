"""TenantAcl: the Redis ACL rule of one tenant's producer user (`llmq acl tenant NAME`).

A tenant's request ids are `<tenant>:<id>` (the gateway names its API keys' requests so), and
`Keys` puts every key of such an id under a space of its own (`llmq:t:r:{acme:1}`,
`llmq:t:id:acme:1:{<queue>}`...), so a tenant's keys share a prefix an ACL key pattern can
name, and none of them matches the shared `producer` user's patterns (`llmq:r:*`...). The rule
lets the tenant's producer:

- XADD to any queue and to the cancel streams (the one-command producer contract: an ACL cannot
  restrict XADD's arguments, so what a plain XADD can do is in docs/operations.md), create the
  consumer group on first use;
- run the submit function, which marks the id (`llmq:t:id:<tenant>:<id>:{<queue>}`) as the
  entry's and records the submission, and read and write its own markers;
- set its own cancel flags, read its own results, and check that a marked entry is running or
  queued (XPENDING, XINFO GROUPS, HEXISTS on the submission records: no payload, no id);

and nothing else: no other tenant's (nor the shared producer's) results, markers or cancel
flags, no request payloads, no queue registry, no consumer-group commands, no admin commands,
and no code of its own (no EVAL, SCRIPT or FUNCTION: it calls the llmq library's functions,
which the admin loads, broker/functions.py).
What it can still write that others read is checked by whoever reads it:

- a cancel entry naming someone else's id: a worker aborts a request only while its owner's
  cancel flag is set (worker/cancel_listener.py), which only the owner can set;
- a plain XADD naming someone else's tenant id: a worker runs an entry with a tenant's id only
  when its marker names that entry, so it can neither hijack nor block the id;
- a forged submission record (`llmq:sub:{<queue>}`, written by the submit function with the
  caller's rights, so the rule must grant HSET there): a worker believes a record's request id
  only when the id's marker names the record's entry back (worker/reclaimer.py).

Every pattern is built from `Keys` with a stand-in name, then globbed: a change of the key
schema changes the rule with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from llmq.broker.keys import Keys, is_valid_tenant, validate_name

__all__ = ["TenantAcl"]

# A valid name no real key holds, replaced by `*` in the patterns.
_STAND_IN = "ACLGLOBSTANDIN"


@dataclass(frozen=True)
class TenantAcl:
    keys: Keys
    tenant: str

    def __post_init__(self) -> None:
        if not is_valid_tenant(self.tenant):
            raise ValueError(f"invalid tenant {self.tenant!r}: letters, digits, `_.-`, no `:`")

    def _glob(self, key: str) -> str:
        return key.replace(_STAND_IN, "*")

    @property
    def request_id_glob(self) -> str:
        return f"{self.tenant}:*"

    def patterns(self) -> dict[str, str]:
        """The key patterns of the rule, by what they hold."""
        own = f"{self.tenant}:{_STAND_IN}"
        own_lane = f"{_STAND_IN}:{self.tenant}"
        return {
            "queues": self._glob(self.keys.queue(_STAND_IN)),
            "lane streams": self._glob(self.keys.lane_stream(_STAND_IN, own_lane)),
            "lane records": self._glob(self.keys.lane_submissions(_STAND_IN, own_lane)),
            "lanes": self._glob(self.keys.lanes(_STAND_IN)),
            "submission records": self._glob(self.keys.submissions(_STAND_IN)),
            "cancel streams": self._glob(self.keys.cancel(_STAND_IN)),
            "results": self._glob(self.keys.result(own)),
            "cancel flags": self._glob(self.keys.cancel_flag(own)),
            "markers": self._glob(self.keys.idempotency(_STAND_IN, own)),
        }

    def rule(self, password_hash: str, user: str | None = None) -> str:
        """An ACL file line (`user ...`); everything after `user` is also what ACL SETUSER
        takes. `password_hash` is the SHA-256 of the password, in hex."""
        name = validate_name("user", user or self.tenant)
        p = self.patterns()
        q, markers, subs = p["queues"], p["markers"], p["submission records"]
        # NOTE: its own lane streams only (broker/work_lanes.py): another tenant's, and the
        # shared producer's batch lane, are the streams whose fair shares it would take.
        lq, lsubs, lanes = p["lane streams"], p["lane records"], p["lanes"]
        selectors = [
            f"(~{q} ~{lq} ~{p['cancel streams']} +xadd)",
            # NOTE: not XINFO STREAM, whose first and last entries are other tenants' requests:
            # the client's checks for a version-1 or exhausted stream skip what is refused.
            f"(~{q} ~{lq} +xgroup|create)",
            # NOTE: the submit functions declare the stream, its records, the lanes and the
            # marker as their keys; what they run is checked against this user too, so they can
            # mark only this tenant's ids and write only its lanes.
            f"(~{q} ~{lq} ~{subs} ~{lsubs} ~{lanes} ~{markers} +fcall)",
            f"(~{subs} ~{lsubs} +hset)",
            # NOTE: the lane submit function's id clock and lane list (ids and entry ids only).
            f"(~{lanes} +hget +hset +hincrby)",
            # NOTE: HEXISTS, not HGET: whether an entry is recorded (a marker check), not whose.
            f"(%R~{subs} %R~{lsubs} +hexists)",
            f"(~{markers} +get +set)",
            f"(~{p['cancel flags']} +set)",
            f"(%R~{p['results']} +xread +xrange +xrevrange +xlen +xinfo|stream)",
            f"(%R~{q} %R~{lq} +xpending +xinfo|groups)",
        ]
        return (f"user {name} on #{password_hash} resetkeys resetchannels -@all +ping +time "
                + " ".join(selectors))

    @staticmethod
    def password_hash(password: str) -> str:
        return hashlib.sha256(password.encode()).hexdigest()
