"""Dashboard sessions of a real `llmq serve`: random, server-side, ended by logout.

No worker and no browser: the login form, the cookie and the dashboard's API, with httpx.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest
import redis

from llmq.broker.keys import Keys
from tests.e2e.gateway_harness import KEYS, GatewayProcess

pytestmark = [pytest.mark.redis]

POOL = "/dashboard/api/pool"


@pytest.fixture(scope="module")
def gateway(valkey_server, tmp_path_factory) -> Iterator[tuple[GatewayProcess, redis.Redis]]:
    gateway = GatewayProcess(valkey_server.url, tmp_path_factory.mktemp("sessions")).start()
    r = redis.Redis.from_url(valkey_server.url)
    try:
        yield gateway, r
    finally:
        r.close()
        gateway.stop()


def sign_in(client: httpx.Client, key: str) -> str:
    answer = client.post("/dashboard/login", data={"key": key})
    assert answer.status_code == 303 and answer.headers["location"] == "/dashboard"
    return client.cookies["llmq_dashboard"]


def csrf_token(client: httpx.Client) -> str:
    return client.get("/dashboard").text.split('name="llmq-csrf" content="')[1].split('"')[0]


def test_a_session_is_random_and_kept_server_side_with_a_ttl(gateway) -> None:
    server, r = gateway
    with httpx.Client(base_url=server.base_url) as one, \
            httpx.Client(base_url=server.base_url) as two:
        # Given alice signed in twice
        first, second = sign_in(one, KEYS["alice"]), sign_in(two, KEYS["alice"])
        # Then each sign-in is its own session, neither derived from the key
        assert first != second
        assert hashlib.sha256(KEYS["alice"].encode()).hexdigest() not in (first, second)
        # And each is in Redis, ending on its own
        ttl = r.ttl(Keys().dashboard_session(first))
        assert 11 * 3600 < ttl <= 12 * 3600
        assert one.get(POOL).status_code == 200 and two.get(POOL).status_code == 200


def test_a_cookie_made_without_signing_in_is_refused(gateway) -> None:
    server, _ = gateway
    # Given the cookie the gateway used to issue: the SHA-256 of a valid key
    forged = hashlib.sha256(KEYS["alice"].encode()).hexdigest()
    # Then it signs no one in, nor does any well-formed id that was never issued
    for cookie in (forged, "0" * 64, "not-hex"):
        assert httpx.get(f"{server.base_url}{POOL}",
                         cookies={"llmq_dashboard": cookie}).status_code == 401


def test_logout_ends_the_session_everywhere(gateway) -> None:
    server, r = gateway
    with httpx.Client(base_url=server.base_url) as browser:
        session = sign_in(browser, KEYS["bob"])
        token = csrf_token(browser)
        # When bob signs out (a POST from the page, with its token)
        answer = browser.post("/dashboard/logout", headers={"X-CSRF-Token": token})
        assert answer.status_code == 200
    # Then the session is gone from Redis
    assert not r.exists(Keys().dashboard_session(session))
    # And its cookie, kept by anyone who copied it, no longer signs anyone in
    assert httpx.get(f"{server.base_url}{POOL}",
                     cookies={"llmq_dashboard": session}).status_code == 401
    assert "login" in httpx.get(f"{server.base_url}/dashboard",
                                cookies={"llmq_dashboard": session}).text.lower()
