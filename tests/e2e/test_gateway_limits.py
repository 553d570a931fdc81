"""Request body limits of a real `llmq serve`: size (declared or streamed) and JSON depth.

No worker is needed: every body here is refused, or answered, before anything is queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway_harness import KEYS, GatewayProcess

pytestmark = [pytest.mark.redis]

AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def gateway(valkey_server, tmp_path_factory) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(valkey_server.url, tmp_path_factory.mktemp("gateway-limits"),
                             extra=["--max-body-bytes", str(LIMIT)]).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def assert_openai_error(response: httpx.Response, status: int, code: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    return error["message"]


def test_a_body_declared_too_large_is_refused_unread(gateway: GatewayProcess) -> None:
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers=AUTH,
                          content=b"x" * (LIMIT + 1))
    assert str(LIMIT) in assert_openai_error(response, 413, "request_too_large")


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) / 1024


def test_a_streamed_body_is_cut_at_the_limit(gateway: GatewayProcess) -> None:
    before = rss_mb(gateway.pid)

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for _ in range(3000):  # 192 MB
            yield b" " * (64 << 10)

    # Given a client that streams a body far past the limit
    try:
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers=AUTH,
                              content=chunks(), timeout=60)
    except httpx.HTTPError:
        pass  # the gateway may close the connection before the client has finished sending
    else:
        # Then the answer is a 413 in OpenAI's shape
        assert_openai_error(response, 413, "request_too_large")
    # And the gateway kept none of it (it grew by the body's size before the limit)
    assert rss_mb(gateway.pid) - before < 32
    # And it still serves
    assert httpx.get(f"{gateway.base_url}/health").status_code == 200


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"),
                                           ("/v1/batches", "metadata")])
def test_json_nested_too_deep_is_a_400_not_a_500(gateway: GatewayProcess, path: str,
                                                 field: str) -> None:
    body = b'{"%s": ' % field.encode() + b"[" * 1000 + b"]" * 1000 + b"}"
    response = httpx.post(f"{gateway.base_url}{path}", headers={
        **AUTH, "Content-Type": "application/json"}, content=body)
    assert "400 levels" in assert_openai_error(response, 400, None)


def test_a_body_within_the_limit_reaches_its_route(gateway: GatewayProcess) -> None:
    response = httpx.post(f"{gateway.base_url}/v1/batches", headers=AUTH,
                          json={"endpoint": "/v1/nowhere", "pad": "x" * (LIMIT // 2)})
    assert "endpoint" in assert_openai_error(response, 400, None)


def test_file_uploads_keep_their_own_larger_limit(gateway: GatewayProcess,
                                                  tmp_path: Path) -> None:
    data = b'{"custom_id": "a"}\n' * (2 * LIMIT // 19)  # twice the body limit
    response = httpx.post(f"{gateway.base_url}/v1/files", headers=AUTH,
                          files={"file": ("big.jsonl", data)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
