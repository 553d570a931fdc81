"""compose.yaml: valid Compose, loopback-only, and in agreement with the worker and Redis config.

Validated against the Compose Specification JSON schema vendored in tests/data/ (see its
README for where it comes from). Values of the form `${VAR:-default}` are interpolated with
their defaults first, as `docker compose` does before it validates.
"""

from __future__ import annotations

import hashlib
import json
import re

import jsonschema
import pytest
import yaml

from tests.unit.worker_settings import ROOT, worker_settings

SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(node):
    """`${VAR:-default}` -> default, recursively (the values compose uses with no .env file)."""
    if isinstance(node, dict):
        return {k: interpolate(v) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v) for v in node]
    if isinstance(node, str):
        return _VAR.sub(lambda m: m.group(2) or "", node)
    return node


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()))


def duration_s(value: str) -> float:
    """Compose durations such as `40s`, `1m30s`."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def redis_conf(compose: dict) -> dict[str, str]:
    """The directives of the redis.conf the redis service mounts and runs with."""
    redis = compose["services"]["redis"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in redis["volumes"]}
    conf_path = next(arg for arg in redis["command"] if arg.endswith(".conf"))
    text = (ROOT / mounted[conf_path]).read_text()
    directives = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            directives[key] = value
    return directives


def test_compose_file_validates_against_the_compose_spec(compose):
    jsonschema.Draft201909Validator(SCHEMA).validate(compose)


def test_the_schema_rejects_a_misspelt_key(compose):
    # Given compose.yaml with a typo a person could make
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["stop_grace_periode"] = "40s"
    # Then validation catches it (the schema is strict, not decorative)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(SCHEMA).validate(broken)


def test_published_ports_listen_on_loopback_only(compose):
    published = []
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            # Long syntax could not name a host IP in this spec version: only strings allowed.
            assert isinstance(port, str), f"{name}: use 'host_ip:host:container' strings"
            published.append(port)
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert published, "expected Redis and the workers' metrics to be reachable from the host"


def test_redis_keeps_an_aof_and_refuses_to_evict(compose):
    # Given the configuration the redis service runs with
    conf = redis_conf(compose)
    # Then writes go to an AOF fsynced every second, into the named volume
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "everysec"
    redis = compose["services"]["redis"]
    data_dir = conf.get("dir", redis["working_dir"])  # Redis writes to `dir`, else its cwd
    data_volume = next(v for v in redis["volumes"] if v.endswith(":" + data_dir))
    assert data_volume.split(":")[0] in compose["volumes"]
    # And a full Redis answers OOM instead of silently evicting queued requests
    assert conf["maxmemory-policy"] == "noeviction"
    assert re.fullmatch(r"\d+(gb|mb|kb)?", conf["maxmemory"], re.I)
    assert conf["maxmemory"] != "0"


def test_redis_loads_the_acl_file_with_the_default_user_off(compose):
    # Given the mounted ACL file
    redis = compose["services"]["redis"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in redis["volumes"]}
    acl_source = mounted[redis_conf(compose)["aclfile"]]
    # Then it is deploy/acl.conf, in which the default (password-less) user is off
    assert acl_source == "./deploy/acl.conf"
    acl = (ROOT / acl_source).read_text()
    assert re.search(r"^user default off\b", acl, re.M)
    # And mounted read-only, so nobody can ACL SAVE users into it from a connection
    assert any(v.startswith(acl_source + ":") and v.endswith(":ro") for v in redis["volumes"])


def test_workers_wait_for_a_healthy_redis_and_log_in_as_the_worker_user(compose):
    worker = compose["services"]["worker"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "healthcheck" in compose["services"]["redis"]
    # The default URL's password is the one whose hash deploy/acl.conf holds for `worker`.
    url = worker["environment"]["LLMQ_REDIS_URL"]
    m = re.fullmatch(r"redis://(\w+):([^@]+)@redis:6379/0", url)
    assert m and m.group(1) == "worker"
    acl = (ROOT / "deploy" / "acl.conf").read_text()
    expected = re.search(r"^user worker .*?#([0-9a-f]{64})", acl, re.M).group(1)
    assert hashlib.sha256(m.group(2).encode()).hexdigest() == expected


def test_workers_run_as_replicas_and_outlast_their_drain(compose):
    worker = compose["services"]["worker"]
    assert worker["deploy"]["replicas"] >= 1
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    drain = float(worker["environment"]["LLMQ_DRAIN_TIMEOUT"])
    # Docker sends SIGKILL after stop_grace_period (default 10 s, shorter than any drain).
    assert duration_s(worker["stop_grace_period"]) >= drain + 10


def test_worker_environment_names_are_settings_the_cli_reads(compose):
    names = set(compose["services"]["worker"]["environment"])
    unknown = names - set(worker_settings())
    assert not unknown, f"compose sets variables no llmq flag reads: {sorted(unknown)}"
    # The metrics port is on, so the health check and Prometheus have something to ask.
    assert int(compose["services"]["worker"]["environment"]["LLMQ_METRICS_PORT"]) > 0


def serve_settings() -> set[str]:
    """The LLMQ_* names `llmq serve` (and the `llmq` group) read."""
    from llmq.cli.main import cli
    from llmq.cli.serve import serve

    names = set()
    for param in [*serve.params, *cli.params]:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def test_the_gateway_logs_in_as_the_gateway_user_and_publishes_on_loopback(compose):
    acl = (ROOT / "deploy" / "acl.conf").read_text()
    expected = re.search(r"^user gateway .*?#([0-9a-f]{64})", acl, re.M).group(1)
    for name in ("gateway", "batch-worker"):
        service = compose["services"][name]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        m = re.fullmatch(r"redis://(\w+):([^@]+)@redis:6379/0",
                         service["environment"]["LLMQ_REDIS_URL"])
        assert m and m.group(1) == "gateway", name
        assert hashlib.sha256(m.group(2).encode()).hexdigest() == expected
    gateway = compose["services"]["gateway"]
    assert gateway["entrypoint"] == ["llmq", "serve"]
    port = gateway["environment"]["LLMQ_SERVE_PORT"]
    assert gateway["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert compose["services"]["batch-worker"]["entrypoint"] == ["llmq", "batch-worker"]


def test_gateway_environment_names_are_settings_llmq_serve_reads(compose):
    names = set(compose["services"]["gateway"]["environment"])
    unknown = names - serve_settings()
    assert not unknown, f"compose sets variables llmq serve does not read: {sorted(unknown)}"
