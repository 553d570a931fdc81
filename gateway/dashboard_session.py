"""DashboardSession: who is looking at the dashboard, from an API key given once at its login.

The login form posts a key; the gateway makes a session, a random id kept in Redis for 12 hours
with the SHA-256 of the key (broker/dashboard_sessions.py), and answers with a cookie holding
only the id (never the key: a cookie that leaks cannot call the API, and cannot be made without
signing in), `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends it),
`Path=/dashboard`, and `Secure` over HTTPS. Any replica accepts it; logout deletes the session,
and revoking the key ends it too. Scripts may send `Authorization: Bearer <key>` to the
dashboard's API instead.

Cross-site request forgery: besides SameSite, every POST made with the cookie must carry
`X-CSRF-Token`, a value derived from the session that only the dashboard page itself is given
(a page on another origin can neither read it nor send a custom header without a CORS preflight
this server never grants), and a POST whose `Origin` names another host is refused outright.

What a viewer may see: every key sees the pool (queues, workers, charts: the same figures that
decide its own 429s); dead letters and the request inspector show a plain tenant only its own
requests (`<tenant>:<id>`, shown as `<id>`); an admin tenant (`--admin-tenant`) sees and acts on
everything, and only an admin may purge a whole dead-letter queue (a tenant's purge removes its
own entries).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.dashboard_sessions import DashboardSessions
from llmq.broker.exchange import send_async
from llmq.gateway.api_keys import ApiKeys
from llmq.gateway.errors import APIError
from llmq.gateway.state import GatewayState
from llmq.protocol.names import is_valid_name

__all__ = ["COOKIE", "CSRF_HEADER", "Viewer", "check_post", "clear_cookie", "end_session",
           "same_origin", "set_cookie", "start_session", "viewer_of"]

COOKIE = "llmq_dashboard"
CSRF_HEADER = "X-CSRF-Token"
PATH = "/dashboard"
MAX_AGE_S = 12 * 3600
_SESSION_ID = re.compile(r"[0-9a-f]{64}")  # secrets.token_hex(32)


@dataclass(frozen=True)
class Viewer:
    tenant: str
    admin: bool
    csrf_token: str
    by_cookie: bool  # authenticated by the cookie (so POSTs need the CSRF token)

    def request_id(self, typed: str) -> str:
        """The llmq request id a viewer means: a tenant's own `<tenant>:<id>`, an admin's as
        typed. APIError 404 for anything that cannot be a request id."""
        request_id = typed if self.admin else f"{self.tenant}:{typed}"
        if not is_valid_name(typed) or not is_valid_name(request_id):
            raise APIError(404, f"no request {typed!r:.60}", "invalid_request_error",
                           code="not_found")
        return request_id

    def owns(self, request_id: str | None) -> bool:
        return self.admin or (request_id or "").startswith(f"{self.tenant}:")

    def shown_id(self, request_id: str | None) -> str | None:
        """A request id as this viewer knows it (a tenant's without its prefix)."""
        if request_id is None or self.admin:
            return request_id
        return request_id.removeprefix(f"{self.tenant}:")


def _csrf_token(secret: bytes) -> str:
    return hashlib.sha256(b"llmq-dashboard-csrf:" + secret).hexdigest()[:32]


def _session_id(request: Request) -> str | None:
    cookie = request.cookies.get(COOKIE, "")
    return cookie if _SESSION_ID.fullmatch(cookie) else None


async def viewer_of(request: Request, state: GatewayState) -> Viewer | None:
    """The viewer of a request (Bearer key first, then the session cookie); None when neither
    is valid."""
    keys = state.settings.api_keys
    header = request.headers.get("authorization")
    if header is not None or keys.anonymous:
        tenant = keys.tenant(header)
        if tenant is None:
            return None
        key = header.partition(" ")[2] if header else ""
        return Viewer(tenant, keys.is_admin(tenant), _csrf_token(keys.digest(key)),
                      by_cookie=False)
    session_id = _session_id(request)
    if session_id is None:
        return None
    digest = await send_async(state.client, DashboardSessions(state.keys).key_digest(session_id))
    tenant = keys.tenant_of_digest(digest) if digest is not None else None
    if tenant is None:
        return None
    return Viewer(tenant, keys.is_admin(tenant), _csrf_token(session_id.encode()),
                  by_cookie=True)


async def start_session(state: GatewayState, key: str) -> str:
    """A new session for a valid key: its id, for the cookie."""
    session_id = secrets.token_hex(32)
    await send_async(state.client, DashboardSessions(state.keys).create(
        session_id, ApiKeys.digest(key), MAX_AGE_S))
    return session_id


async def end_session(request: Request, state: GatewayState) -> None:
    """The request's session, if it has one, deleted: its cookie no longer signs anyone in."""
    session_id = _session_id(request)
    if session_id is not None:
        await send_async(state.client, DashboardSessions(state.keys).delete(session_id))


def check_post(request: Request, viewer: Viewer) -> None:
    """APIError 403 for a POST that may have been forged by another site's page."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise APIError(403, "cross-origin request refused", "invalid_request_error",
                       code="forbidden")
    if viewer.by_cookie and request.headers.get(CSRF_HEADER) != viewer.csrf_token:
        raise APIError(403, f"missing or wrong {CSRF_HEADER}: reload the dashboard",
                       "invalid_request_error", code="csrf")


def same_origin(request: Request) -> bool:
    """False for a form posted from another origin (the login)."""
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host")


def set_cookie(response: Response, request: Request, session_id: str) -> None:
    response.set_cookie(COOKIE, session_id, max_age=MAX_AGE_S, path=PATH,
                        secure=request.url.scheme == "https", httponly=True, samesite="strict")


def clear_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path=PATH, secure=request.url.scheme == "https",
                           httponly=True, samesite="strict")
