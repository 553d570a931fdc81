"""compose.yaml and k8s/ load the llmq function library as the admin user, before it is needed.

No other llmq user may load code (deploy/acl.conf), so each deployment has one step that does:
compose's one-shot `functions` service, which the workers and front ends wait for, and k8s's
`llmq-functions` Job (workers wait, not ready, until the library is there), in the base and
in both overlays, pointed at the same servers as the workers.
"""

from __future__ import annotations

import hashlib

import pytest
import yaml

from llmq.broker.redis_url import RedisURL
from tests.unit.test_compose import interpolate
from tests.unit.test_k8s import acl_hashes, one, render, secret_data, worker_container
from tests.unit.worker_settings import ROOT

LOAD = ["llmq", "admin", "load-functions"]


def _admin_hash() -> str:
    return acl_hashes((ROOT / "deploy" / "acl.conf").read_text())["admin"]


def test_compose_loads_the_library_as_the_admin_before_anything_uses_it():
    compose = interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()))
    services = compose["services"]
    functions = services["functions"]
    # Given the one-shot service: it runs the load as the admin user, once Redis is healthy
    assert functions["entrypoint"] == LOAD
    assert functions["restart"] == "no"
    assert functions["depends_on"]["redis"]["condition"] == "service_healthy"
    url = RedisURL.parse(functions["environment"]["LLMQ_REDIS_URL"])
    assert url.username == "admin"
    assert hashlib.sha256((url.password or "").encode()).hexdigest() == _admin_hash()
    # Then every service that runs llmq's functions starts only after it succeeded
    for name in ("worker", "gateway", "batch-worker"):
        assert services[name]["depends_on"]["functions"]["condition"] \
            == "service_completed_successfully", name


@pytest.mark.parametrize("overlay", ["k8s", "k8s/overlays/sentinel", "k8s/overlays/cluster"])
def test_k8s_loads_the_library_as_the_admin_where_the_workers_run(overlay):
    objects = render(overlay)
    job = one(objects, "Job", "llmq-functions")
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v for v in container["env"]}
    # Given the Job: it runs the load as the admin user, with the password Redis expects
    assert container["command"] == LOAD
    url = RedisURL.parse(env["LLMQ_REDIS_URL"]["value"])
    assert (url.username, url.password) == ("admin", "$(REDIS_PASSWORD)")
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    password = secret_data(objects, ref["name"])[ref["key"]]
    assert hashlib.sha256(password.encode()).hexdigest() == _admin_hash()
    # Then it reaches the same servers as the workers (every primary of a cluster)
    worker = {v["name"]: v.get("value") for v in worker_container(objects)["env"]}
    worker_url = RedisURL.parse(worker["LLMQ_REDIS_URL"])
    assert (url.kind, url.nodes, url.master_name) \
        == (worker_url.kind, worker_url.nodes, worker_url.master_name)
    # And it retries while Redis starts, and makes way for the next apply's run
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
