"""The dashboard of `llmq serve` in a real headless Chromium, over a pool of two tiny-model workers.

One pool (two in-process workers whose steps are slowed to 40 ms, so a file job drains over a
few dashboard refreshes), one gateway (`ops` is its admin tenant, charts sampled every second)
and one browser serve the whole module; each test signs in with the key it needs. The page is
driven as a person would: typing a key, reading the tables, pressing the buttons.

The loaded dashboard is photographed into docs/dashboard.png (the README and operations.md
show it) while the file job drains.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from llmq.broker import Client
from llmq.broker.control import call_workers
from llmq.broker.keys import Keys
from llmq.protocol import DeadLetter, encode_dead_letter
from tests.e2e.cli_harness import llmq_process, subprocess_env
from tests.e2e.gateway_harness import GatewayProcess
from tests.fixtures.browser import (
    console_errors,
    headless_chromium,
    require_chromium,
    sign_in_to_dashboard,
)
from tests.integration.worker_harness import InProcessWorker, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "ops": "sk-ops"}
STEP_MS = 40
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def url(valkey_server, tiny_model) -> Iterator[str]:
    """Two workers on the default queue, two sequences each, 40 ms per engine step."""
    require_chromium()
    workers = [InProcessWorker(valkey_server.url, tiny_model, worker_id=f"dash-{n}",
                               fault=f"slow_step:{STEP_MS}", max_num_seqs=2) for n in (1, 2)]
    for worker in workers:
        worker.__enter__()
    r = redis.Redis.from_url(valkey_server.url)
    wait_for(lambda: all(r.exists(Keys().worker(f"dash-{n}")) for n in (1, 2)), 30,
             "both workers' heartbeats")
    r.close()
    yield valkey_server.url
    for worker in workers:
        worker.stop()


@pytest.fixture(scope="module")
def gateway(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gateway = GatewayProcess(url, tmp_path_factory.mktemp("gateway"), keys=KEYS,
                             extra=["--admin-tenant", "ops", "--dashboard-interval", "1"])
    yield gateway.start()
    gateway.stop()


@pytest.fixture(scope="module")
def browser(gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = headless_chromium(tmp_path_factory.mktemp("chromium") / "profile")
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[Client]:
    with Client(url) as client:
        yield client


def sign_in(browser: Any, gateway: GatewayProcess, key: str) -> None:
    sign_in_to_dashboard(browser, gateway.base_url, key)


def text_of(browser: Any, selector: str) -> str | None:
    """The text of the first element matching `selector` now (the tables are redrawn every 2 s);
    None when there is none."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        return browser.find_element("css selector", selector).text
    except (NoSuchElementException, StaleElementReferenceException):
        return None


def click(browser: Any, selector: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked() -> bool:
        try:
            browser.find_element("css selector", selector).click()
            return True
        except StaleElementReferenceException:
            return False
    wait_for(clicked, 5, f"a click on {selector}")


def test_a_wrong_key_sees_nothing_but_the_login(browser, gateway) -> None:
    # Given someone with a key the gateway does not know
    sign_in(browser, gateway, "sk-wrong")
    # Then the page they get is the login form again, saying so, and nothing of the pool
    assert wait_for(lambda: text_of(browser, "#login-error"), 10, "the login error") == \
        "Unknown API key."
    assert browser.find_elements("id", "queues") == []
    assert "dash-1" not in browser.page_source and "Workers" not in browser.page_source
    # And the dashboard's API answers them nothing either, by cookie or by header
    assert httpx.get(f"{gateway.base_url}/dashboard/api/pool",
                     headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert httpx.get(f"{gateway.base_url}/dashboard/api/pool",
                     cookies={"llmq_dashboard": "00" * 32}).status_code == 401
    assert console_errors(browser) == []


def test_the_page_loads_without_console_errors_in_under_100_kb(browser, gateway) -> None:
    # When the admin signs in
    sign_in(browser, gateway, KEYS["ops"])
    wait_for(lambda: text_of(browser, '#workers tr[data-worker="dash-2"] .model'), 15,
             "the workers table")
    # Then the page (document, CSS, JavaScript) weighs under 100 KB and logged no error
    weight = browser.execute_script(
        "return [performance.getEntriesByType('navigation')[0], "
        "...performance.getEntriesByType('resource')].filter(e => !e.name.includes('/api/'))"
        ".reduce((sum, e) => sum + e.decodedBodySize, 0)")
    assert 5_000 < weight < 100_000, weight
    assert text_of(browser, "#viewer") == "admin (ops)"
    assert console_errors(browser) == []


def test_both_workers_show_and_the_queue_falls_while_a_file_job_runs(
        browser, gateway, url, tmp_path) -> None:
    # Given the admin's dashboard showing both workers serving the tiny model
    sign_in(browser, gateway, KEYS["ops"])
    for n in (1, 2):
        row = f'#workers tr[data-worker="dash-{n}"]'
        wait_for(lambda row=row: text_of(browser, f"{row} .model") == "tiny", 15, f"{row}")
        assert text_of(browser, f"{row} .state") == "serving"
    # When a file job of 60 requests runs through the queue
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"Count to {i}", "max_tokens": 16,
                                            "ignore_eos": True}) + "\n" for i in range(60)))
    job = llmq_process("submit", "-f", str(requests), "-o", str(tmp_path / "out.jsonl"),
                       "--no-progress", env=subprocess_env(url))
    # Then the waiting count of the queue's batch lane (where file jobs run: broker/work_lanes.py)
    # seen on the page rises, then falls to zero
    seen: list[int] = []
    busy: set[str] = set()
    tokens_per_s: list[float] = []

    def drained() -> bool:
        waiting = text_of(browser, '#lanes tr[data-queue="default"][data-lane="batch"] .lag')
        if waiting is not None and waiting.isdigit() and (seen or int(waiting)):
            if not seen or int(waiting) != seen[-1]:
                seen.append(int(waiting))
                if len(seen) == 3:  # busy and draining: the picture for the docs
                    browser.save_screenshot(str(SCREENSHOT))
        for n in (1, 2):
            if text_of(browser, f'#workers tr[data-worker="dash-{n}"] .running') in ("1", "2"):
                busy.add(f"dash-{n}")
        rate = text_of(browser, '#queues tr[data-queue="default"] .tps') or "0"
        tokens_per_s.append(float(rate.replace(",", "")))
        return bool(seen) and seen[-1] == 0 and job.poll() is not None
    wait_for(drained, 90, "the file job to drain", interval=0.2)
    assert job.returncode == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 60
    assert seen[0] > 0 and seen[-1] == 0, seen
    assert any(later < earlier for earlier, later in zip(seen, seen[1:], strict=False)), seen
    # And both workers were seen running requests, the queue's throughput was shown, and the
    # charts drew the run, TTFT included
    assert busy == {"dash-1", "dash-2"}
    assert max(tokens_per_s) > 0
    assert browser.find_elements("css selector", '#charts [data-chart="tokens_per_s"] path')
    wait_for(lambda: (text_of(browser, '[data-chart="ttft_p50_ms"] .now') or "–")[0].isdigit(),
             10, "a TTFT figure")
    assert SCREENSHOT.stat().st_mtime > time.time() - 120
    assert console_errors(browser) == []


def pool_counters(gateway: GatewayProcess) -> tuple[float, float, float]:
    """(monotonic time, generated tokens, finished requests) summed over the pool's workers,
    from the gateway's /metrics (no key needed)."""
    text = httpx.get(f"{gateway.base_url}/metrics").text
    tokens = requests = 0.0
    for line in text.splitlines():
        if line.startswith("llmq_generation_tokens_total{"):
            tokens += float(line.rsplit(" ", 1)[1])
        elif line.startswith("llmq_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
    return time.monotonic(), tokens, requests


READ_RATES = """
const row = document.querySelector('#queues tr[data-queue="default"]');
const now = (key) => document.querySelector(`[data-chart="${key}"] .now`);
if (!row || !now("tokens_per_s") || !now("requests_per_s")) return null;
const number = (text) => parseFloat(text.replace(/,/g, ""));
return [number(row.querySelector(".tps").textContent),
        number(now("tokens_per_s").textContent),
        number(row.querySelector(".rps").textContent),
        number(now("requests_per_s").textContent)];
"""


def test_the_table_and_the_charts_show_the_same_rates_during_a_steady_run(
        browser, gateway, url, tmp_path) -> None:
    # Given the admin's dashboard, its rates stated over a window
    sign_in(browser, gateway, KEYS["ops"])
    wait_for(lambda: (text_of(browser, "#queues thead .rate-window") or "") == "(1 min)", 15,
             "the rate window in the table's header")
    wait_for(lambda: "1 min window" in (text_of(browser, '[data-chart="tokens_per_s"] h3') or ""),
             15, "the rate window in the chart's title")
    # When a steady file job runs for over a minute
    requests = tmp_path / "steady.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"Steady {i}", "max_tokens": 16,
                                            "ignore_eos": True}) + "\n" for i in range(420)))
    job = llmq_process("submit", "-f", str(requests), "-o", str(tmp_path / "steady.out"),
                       "--no-progress", env=subprocess_env(url))
    started = time.monotonic()
    counted_from = pool_counters(gateway)
    by_metrics: tuple[float, float, list[float]] | None = None
    readings: list[list[float]] = []
    try:
        while job.poll() is None:
            time.sleep(1.0)
            if by_metrics is None and time.monotonic() - counted_from[0] >= 60:
                # The same minute as Prometheus would see it: the gateway's /metrics counters
                now = pool_counters(gateway)
                seconds = now[0] - counted_from[0]
                by_metrics = ((now[1] - counted_from[1]) / seconds,
                              (now[2] - counted_from[2]) / seconds,
                              browser.execute_script(READ_RATES))
            # NOTE: once the run is 25 s old: the table is read live and the chart's point is
            # up to ~2 s older, which within a 60 s window moves a rising rate by under 10%.
            if time.monotonic() - started < 25:
                continue
            reading = browser.execute_script(READ_RATES)
            if reading and all(v == v for v in reading):  # no NaN (a "–")
                readings.append(reading)
    finally:
        job.wait(120)
    assert job.returncode == 0
    # Then every reading of the table's tokens/s and requests/s is within 10% of the chart's
    assert len(readings) >= 5, readings
    # And the rates from the gateway's /metrics counters over that minute agree with the table
    assert by_metrics is not None, "the job ended within a minute"
    metrics_tps, metrics_rps, reading = by_metrics
    assert abs(metrics_tps - reading[0]) <= 0.1 * metrics_tps, (metrics_tps, reading)
    assert abs(metrics_rps - reading[2]) <= 0.1 * metrics_rps, (metrics_rps, reading)
    for table_tps, chart_tps, table_rps, chart_rps in readings:
        assert table_tps > 0 and abs(table_tps - chart_tps) <= 0.1 * table_tps, readings
        assert table_rps > 0 and abs(table_rps - chart_rps) <= 0.1 * table_rps, readings
    # And every chart has gridlines labelled with units, and clock times along its x axis
    tick = text_of(browser, '[data-chart="e2e_p50_ms"] svg text') or ""
    assert tick.endswith(" ms") or tick.endswith(" s"), tick
    assert len(browser.find_elements("css selector",
                                     '[data-chart="tokens_per_s"] svg line.grid')) >= 5
    assert console_errors(browser) == []


def test_a_poison_request_shows_under_dead_letters_and_the_retry_button_requeues_it(
        browser, gateway, url, client, tiny_model) -> None:
    # Given a request that crashes the engine (TEST-ONLY fault) on a queue of its own ...
    with InProcessWorker(url, tiny_model, worker_id="risky-1", queue="risky",
                         fault="raise_in_step:POISON") as faulty:
        client.submit("this one is POISON", request_id="alice:poison-1", queue="risky",
                      max_tokens=4)
        wait_for(lambda: not faulty.alive(), 30, "the poison to crash the engine")
    # ... which the next worker dead-letters instead of running it again (max_deliveries 1)
    with InProcessWorker(url, tiny_model, worker_id="risky-2", queue="risky", max_deliveries=1):
        sign_in(browser, gateway, KEYS["ops"])
        row = '#dead-letters tr[data-queue="risky"]'
        # Then the admin sees it under dead letters, with its code, deliveries and payload
        wait_for(lambda: text_of(browser, f"{row} .code") == "poison", 30, "the dead letter")
        assert text_of(browser, f"{row} .request") == "alice:poison-1"
        assert text_of(browser, f"{row} .deliveries") == "2"
        assert "POISON" in (text_of(browser, f"{row} .payload") or "")
        # When the admin presses Retry
        click(browser, f"{row} button.retry")
        # Then it leaves the dead letters and runs again, on the worker that is healthy now
        wait_for(lambda: text_of(browser, row) is None, 10, "the dead letter to go")
        done = client.result("alice:poison-1", timeout=30)
        assert done.finish_reason in ("stop", "length")
    assert console_errors(browser) == []


def test_the_inspector_streams_a_request_and_its_cancel_button_stops_it(
        browser, gateway, client) -> None:
    # Given a long request of tenant alice (240 tokens at 40 ms a step: ten seconds)
    client.submit("Tell me a long story", request_id="alice:story-1", max_tokens=240,
                  ignore_eos=True)
    # When alice watches it in the inspector by the id she knows
    sign_in(browser, gateway, KEYS["alice"])
    wait_for(lambda: text_of(browser, "#viewer") == "tenant alice", 10, "the dashboard")
    browser.find_element("id", "inspect-id").send_keys("story-1")
    browser.find_element("id", "inspect-go").click()
    # Then its text appears and grows as it streams
    first = wait_for(lambda: text_of(browser, "#inspect-text"), 20, "the first text")
    wait_for(lambda: len(text_of(browser, "#inspect-text") or "") > len(first), 20,
             "more text")
    assert text_of(browser, "#inspect-status").startswith("streaming")
    # And the cancel button stops it
    browser.find_element("id", "inspect-cancel").click()
    wait_for(lambda: text_of(browser, "#inspect-status") == "done: cancelled", 20,
             "the cancelled done event")
    assert client.result("alice:story-1", timeout=5).finish_reason == "cancelled"
    assert console_errors(browser) == []


def test_a_worker_s_state_shows_sleeping_serving_draining_then_gone(
        browser, gateway, url, client, tiny_model) -> None:
    with InProcessWorker(url, tiny_model, worker_id="drainer", queue="slow",
                         fault=f"slow_step:{STEP_MS}") as worker:
        sign_in(browser, gateway, KEYS["ops"])
        state = '#workers tr[data-worker="drainer"] .state'
        wait_for(lambda: text_of(browser, state) == "serving", 20, "it to serve")
        # When an admin puts it to sleep (`llmq admin sleep`), and wakes it again
        (reply,) = call_workers(client, "sleep", {"level": 1}, queue="slow")
        assert reply.ok, reply
        wait_for(lambda: text_of(browser, state) == "sleeping (level 1)", 10, "sleeping")
        assert call_workers(client, "wake_up", queue="slow")[0].ok
        wait_for(lambda: text_of(browser, state) == "serving", 10, "serving again")
        # And when it is told to stop (SIGTERM) in the middle of a long request (120 tokens at
        # 40 ms a step), it drains: no new reads, the request finishes
        client.submit("A long one", request_id="ops-long-1", queue="slow", max_tokens=120,
                      ignore_eos=True)
        running = '#workers tr[data-worker="drainer"] .running'
        wait_for(lambda: text_of(browser, running) == "1", 20, "it to run")
        worker.worker.request_stop()
        # Then the dashboard says so, and the worker leaves the table once done
        wait_for(lambda: text_of(browser, state) == "draining", 10, "draining")
        wait_for(lambda: text_of(browser, state) is None, 30, "the worker to leave")
    assert client.result("ops-long-1", timeout=5).finish_reason == "length"
    assert console_errors(browser) == []


def _dead_letter(r: redis.Redis, request_id: str | None) -> str:
    letter = DeadLetter(queue="shared", entry_id="1-0", request_id=request_id, code="poison",
                        message="killed its workers", deliveries=4, at_ms=int(time.time() * 1000))
    payload = {"json": json.dumps({"id": request_id, "prompt": "Hi", "max_tokens": 2})}
    return r.xadd(Keys().dlq("shared"), encode_dead_letter(letter, payload)).decode()


def test_a_plain_tenant_reaches_only_its_own_dead_letters_and_only_an_admin_all(
        gateway, url, client) -> None:
    # Given dead letters of alice, of bob and of a producer outside the gateway
    client.ensure_group("shared")
    r = redis.Redis.from_url(url)
    _dead_letter(r, "alice:a-1")
    bob_entry = _dead_letter(r, "bob:b-1")
    _dead_letter(r, "cli-1")
    base = f"{gateway.base_url}/dashboard/api"
    alice = httpx.Client(headers={"Authorization": f"Bearer {KEYS['alice']}"})
    ops = httpx.Client(headers={"Authorization": f"Bearer {KEYS['ops']}"})

    def shown(who: httpx.Client) -> set[str]:
        rows = who.get(f"{base}/dead-letters").json()["dead_letters"]
        return {d["request_id"] for d in rows if d["queue"] == "shared"}
    # Then alice sees only hers, by the id she knows; the admin sees them all
    assert shown(alice) == {"a-1"}
    pool = alice.get(f"{base}/pool").json()
    assert pool["viewer"] == {"tenant": "alice", "admin": False}
    assert next(q for q in pool["queues"] if q["queue"] == "shared")["dead_letters"] == 3
    assert shown(ops) == {"alice:a-1", "bob:b-1", "cli-1"}
    # And alice can neither retry bob's nor purge anything but her own
    assert alice.post(f"{base}/dead-letters/shared/{bob_entry}/retry").status_code == 404
    assert alice.post(f"{base}/dead-letters/shared/purge").json()["purged"] == 1
    assert shown(ops) == {"bob:b-1", "cli-1"}
    # While the admin's purge empties the queue's dead letters
    assert ops.post(f"{base}/dead-letters/shared/purge").json()["purged"] == 2
    assert r.xlen(Keys().dlq("shared")) == 0
    r.close()


def test_the_session_cookie_is_strict_and_its_posts_need_the_page_s_token(gateway) -> None:
    # Given alice signed in through the login form
    with httpx.Client(base_url=gateway.base_url) as browser_like:
        answer = browser_like.post("/dashboard/login", data={"key": KEYS["alice"]})
        assert answer.status_code == 303 and answer.headers["location"] == "/dashboard"
        cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
        assert KEYS["alice"] not in cookie  # the key's digest, never the key
        page = browser_like.get("/dashboard").text
        token = page.split('name="llmq-csrf" content="')[1].split('"')[0]
        purge = "/dashboard/api/dead-letters/shared/purge"
        # When a POST comes with the cookie alone (as a forged cross-site form would)
        # Then it is refused; so is one from another origin, token or not
        assert browser_like.post(purge).status_code == 403
        assert browser_like.post(purge, headers={"X-CSRF-Token": token,
                                                 "Origin": "http://evil.example"}
                                 ).status_code == 403
        # And the page's own request, with its token, goes through
        assert browser_like.post(purge, headers={"X-CSRF-Token": token}).status_code == 200


def test_a_tenant_is_told_which_figures_are_the_pool_s_and_which_its_own(browser,
                                                                         gateway) -> None:
    # Given alice, a plain tenant, on the dashboard
    sign_in(browser, gateway, KEYS["alice"])
    wait_for(lambda: "tenant alice" in (text_of(browser, "#scope") or ""), 15, "the scope note")
    # Then the page says the queues and charts are the whole pool's, the dead letters hers
    scope = text_of(browser, "#scope") or ""
    assert "whole pool" in scope and "only your own requests" in scope
    wait_for(lambda: text_of(browser, "#dead-scope") == "(your requests only)", 15,
             "the dead letters' scope")
    # While the admin is told nothing is hidden
    sign_in(browser, gateway, KEYS["ops"])
    wait_for(lambda: text_of(browser, "#dead-scope") == "(every tenant's)", 15, "admin scope")
    assert text_of(browser, "#scope") == ""
