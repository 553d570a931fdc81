"""DashboardSessions: the gateway's dashboard sign-ins in Redis, as exchanges.

    <prefix>:session:<session_id>   string  SHA-256 of the API key signed in with, TTL

The cookie holds only the random session id; the digest it maps to names the key (and so the
tenant) without being the key, so revoking a key ends its sessions too. Any replica reads it;
logout deletes it, and the TTL ends it regardless.
"""

from __future__ import annotations

from llmq.broker.exchange import Exchange
from llmq.broker.keys import Keys

__all__ = ["DashboardSessions"]


class DashboardSessions:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def create(self, session_id: str, key_digest: bytes, ttl: int) -> Exchange[None]:
        return Exchange(lambda pipe: pipe.set(self.keys.dashboard_session(session_id),
                                              key_digest, ex=ttl), lambda replies: None)

    def key_digest(self, session_id: str) -> Exchange[bytes | None]:
        """The digest of the key the session was made with; None for no (or an ended) session."""
        return Exchange(lambda pipe: pipe.get(self.keys.dashboard_session(session_id)),
                        lambda replies: None if replies[0] is None else bytes(replies[0]))

    def delete(self, session_id: str) -> Exchange[None]:
        return Exchange(lambda pipe: pipe.delete(self.keys.dashboard_session(session_id)),
                        lambda replies: None)
