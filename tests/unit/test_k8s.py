"""k8s/: rendered by the real kustomize (`kubectl kustomize`), then checked object by object.

Built-in kinds are validated offline against the Kubernetes OpenAPI schemas shipped in the
`kubernetes-validate` package (strict: unknown fields fail); KEDA's custom resources against
the pinned minimal schema in tests/data/keda-v1alpha1.schema.json. The remaining tests check
what no schema can: that the pieces agree with each other and with the worker.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmq.broker.keys import DEFAULT_QUEUE, GROUP, Keys
from llmq.broker.redis_url import RedisURL
from tests.fixtures.redis_cluster import MASTER_NAME
from tests.unit.worker_settings import ROOT, worker_settings

K8S_VERSION = "1.33"  # a Kubernetes release in support; the manifests use only GA APIs
KEDA_SCHEMA = json.loads((ROOT / "tests" / "data" / "keda-v1alpha1.schema.json").read_text())


def render(path: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl (for `kubectl kustomize`) is not installed")
        pytest.skip("kubectl not installed: cannot render the kustomize base")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render("k8s")


@pytest.fixture(scope="module")
def sentinel() -> list[dict]:
    return render("k8s/overlays/sentinel")


@pytest.fixture(scope="module")
def cluster() -> list[dict]:
    return render("k8s/overlays/cluster")


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"].startswith(name))]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def worker_container(objects: list[dict]) -> dict:
    return one(objects, "Deployment", "llmq-worker")["spec"]["template"]["spec"]["containers"][0]


def worker_env(objects: list[dict]) -> dict[str, str]:
    """The worker's environment as the kubelet builds it: envFrom ConfigMaps, then env."""
    container = worker_container(objects)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        cm = one(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(cm["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "<from secret>")
    return env


def secret_data(objects: list[dict], name: str) -> dict[str, str]:
    secret = one(objects, "Secret", name)
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def acl_hashes(acl_text: str) -> dict[str, str]:
    """ACL user -> the SHA-256 hex of its password (`#<hash>` rule)."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^user (\S+) .*?#([0-9a-f]{64})", acl_text, re.M)}


@pytest.mark.parametrize("overlay", ["base", "sentinel", "cluster"])
def test_every_rendered_object_validates_offline(overlay, request):
    # Given the rendered manifests
    objects = request.getfixturevalue(overlay)
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        # When each is checked against its schema, Then none has an unknown or mistyped field
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, KEDA_SCHEMA)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {"Deployment", "PodDisruptionBudget", "ScaledObject", "TriggerAuthentication",
            "Secret", "ConfigMap", "Service", "HorizontalPodAutoscaler"} <= kinds


def test_the_keda_schema_rejects_what_keda_would():
    # Given a trigger whose count is a YAML number and whose metadata key has a typo
    bad = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
           "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": {"name": "x"},
                    "triggers": [{"type": "redis-streams",
                                  "metadata": {"stream": "s", "consumerGroup": "g",
                                               "lagcount": "4"}}]}}
    # Then the pinned schema refuses it, as the CRD's string map and the scaler would
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, KEDA_SCHEMA)
    bad["spec"]["triggers"][0]["metadata"] = {"stream": "s", "consumerGroup": "g", "lagCount": 4}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, KEDA_SCHEMA)


@pytest.mark.parametrize("overlay", ["base", "sentinel", "cluster"])
def test_keda_watches_the_stream_and_group_the_workers_consume(overlay, request):
    # Given the rendered ScaledObject and the workers' queue setting
    objects = request.getfixturevalue(overlay)
    scaled = one(objects, "ScaledObject")
    env = worker_env(objects)
    queue = env.get("LLMQ_QUEUE", DEFAULT_QUEUE)
    keys = Keys(env.get("LLMQ_PREFIX", Keys().prefix))
    # Then every trigger reads a request stream of that queue (its own, or its batch lane:
    # broker/work_lanes.py) and its group, each stream with a lag and an in-flight trigger
    streams = {keys.queue(queue), keys.lane_stream(queue, "batch")}
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"].startswith("redis") and trigger["type"].endswith("-streams")
        assert trigger["metadata"]["stream"] in streams
        assert trigger["metadata"]["consumerGroup"] == GROUP
    assert {t["metadata"]["stream"] for t in scaled["spec"]["triggers"]} == streams
    # And it scales the worker Deployment, from zero, on lag plus in-flight work
    deployment = one(objects, "Deployment", "llmq-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] == 0
    assert scaled["spec"]["maxReplicaCount"] >= 1
    modes = {tuple(sorted(k for k in ("lagCount", "pendingEntriesCount") if k in t["metadata"]))
             for t in scaled["spec"]["triggers"]}
    assert modes == {("lagCount",), ("pendingEntriesCount",)}
    lag = next(t for t in scaled["spec"]["triggers"] if "lagCount" in t["metadata"])
    assert "activationLagCount" in lag["metadata"]


def test_in_flight_target_matches_the_requests_one_worker_runs(base):
    # Given the pending-entries trigger and the worker's batch size
    scaled = one(base, "ScaledObject")
    pending = next(t for t in scaled["spec"]["triggers"] if "pendingEntriesCount" in t["metadata"])
    # Then one worker is kept per max_num_seqs running requests (not fewer, not more)
    assert pending["metadata"]["pendingEntriesCount"] == worker_env(base)["LLMQ_MAX_NUM_SEQS"]


def test_keda_authenticates_as_the_keda_acl_user_with_a_password_redis_accepts(base):
    # Given the TriggerAuthentication every trigger uses and the Secret it names
    auth = one(base, "TriggerAuthentication")
    for trigger in one(base, "ScaledObject")["spec"]["triggers"]:
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    params = {}
    for ref in auth["spec"]["secretTargetRef"]:
        params[ref["parameter"]] = secret_data(base, ref["name"])[ref["key"]]
    # Then it logs in as `keda`, whose password hashes to the one in the ACL Redis loads
    acl = secret_data(base, "llmq-redis-acl")["users.acl"]
    assert params["username"] == "keda"
    assert hashlib.sha256(params["password"].encode()).hexdigest() == acl_hashes(acl)["keda"]


def test_worker_logs_in_as_the_worker_acl_user(base):
    # Given the worker's Redis URL template and the credentials Secret
    env = {v["name"]: v for v in worker_container(base)["env"]}
    url = env["LLMQ_REDIS_URL"]["value"]
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    password = secret_data(base, ref["name"])[ref["key"]]
    acl = secret_data(base, "llmq-redis-acl")["users.acl"]
    # Then the URL names the `worker` user, and its password is the one the ACL expects
    assert url.startswith("redis://worker:$(REDIS_PASSWORD)@llmq-redis:6379")
    assert hashlib.sha256(password.encode()).hexdigest() == acl_hashes(acl)["worker"]


@pytest.mark.parametrize("overlay", ["base", "sentinel", "cluster"])
def test_env_references_come_after_the_variables_they_expand(overlay, request):
    # Given the worker's env list ($(VAR) expands only variables defined earlier in it)
    seen: set[str] = set()
    for var in worker_container(request.getfixturevalue(overlay))["env"]:
        # Then every reference is to a variable already defined
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var.get("value", "")):
            assert ref in seen, f"{var['name']} expands $({ref}) before it is defined"
        seen.add(var["name"])


def test_worker_sets_only_settings_the_cli_reads(base):
    # Given the worker's environment
    names = set(worker_env(base))
    # Then every LLMQ_* name is a documented worker setting (a typo would be silently ignored)
    llmq_names = {n for n in names if n.startswith("LLMQ_")}
    assert llmq_names <= set(worker_settings())
    assert names - llmq_names == {"REDIS_PASSWORD"}


def test_grace_period_outlasts_the_drain_budget(base):
    # Given the pod's grace period and the worker's drain timeout
    spec = one(base, "Deployment", "llmq-worker")["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    drain = int(worker_env(base)["LLMQ_DRAIN_TIMEOUT"])
    # Then the kubelet's SIGKILL comes well after the drain ends, leaving time to hand the
    # unfinished requests back and exit
    assert grace >= drain + 10, (grace, drain)


def test_probes_and_scrape_annotations_point_at_the_metrics_port(base):
    # Given the worker pod
    deployment = one(base, "Deployment", "llmq-worker")
    container = worker_container(base)
    port = int(worker_env(base)["LLMQ_METRICS_PORT"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Then the probes ask the health server for liveness and readiness
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert named[get["port"]] == port
    # And the startup probe allows minutes for loading the model before liveness counts
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    # And Prometheus finds /metrics on that port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_one_worker_per_core_with_one_torch_thread(base):
    # Given the worker's resources and threads
    resources = worker_container(base)["resources"]
    # Then each pod asks for one whole core (Guaranteed QoS: requests equal limits)
    assert resources["requests"]["cpu"] == "1"
    assert resources["requests"] == resources["limits"]
    assert worker_env(base)["LLMQ_THREADS"] == "1"
    # And its memory limit leaves room for the KV-cache budget on top of torch and the weights
    memory_mi = int(resources["limits"]["memory"].removesuffix("Mi"))
    kv_mi = int(worker_env(base)["LLMQ_KV_CACHE_MEMORY_BYTES"]) / 2**20
    assert memory_mi >= kv_mi + 768


def test_runs_as_the_images_non_root_user(base):
    # Given the pod security context and the Dockerfile's USER
    pod = one(base, "Deployment", "llmq-worker")["spec"]["template"]["spec"]
    user = re.search(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    # Then runAsNonRoot can verify it: a numeric uid, the same one
    assert user, "the Dockerfile's USER must be numeric for runAsNonRoot"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user.group(1))


def test_disruption_budget_covers_the_workers_and_never_blocks_at_zero(base):
    # Given the PodDisruptionBudget and the worker pods' labels
    pdb = one(base, "PodDisruptionBudget", "llmq-worker")
    labels = one(base, "Deployment", "llmq-worker")["spec"]["template"]["metadata"]["labels"]
    # Then it selects the workers, and limits how many go at once rather than how many stay
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]


def test_redis_runs_the_same_config_and_acl_as_compose(base):
    # Given what the StatefulSet mounts
    redis = one(base, "StatefulSet", "llmq-redis")
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    config = one(base, "ConfigMap", volumes["config"]["configMap"]["name"])
    acl = secret_data(base, volumes["acl"]["secret"]["secretName"])
    # Then it is byte for byte what deploy/ holds (and compose.yaml mounts)
    assert config["data"]["redis.conf"] == (ROOT / "deploy" / "redis.conf").read_text()
    assert acl["users.acl"] == (ROOT / "deploy" / "acl.conf").read_text()
    # And the data volume is persistent, mounted where Redis writes the AOF (`dir`, else the
    # working directory)
    container = redis["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    dirs = [line.split()[1] for line in config["data"]["redis.conf"].splitlines()
            if line.startswith("dir ")]
    assert mounts["data"] == (dirs[0] if dirs else container["workingDir"])
    assert [c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]] == ["data"]


def _env(container: dict) -> dict[str, str | None]:
    return {v["name"]: v.get("value") for v in container["env"]}


def test_sentinel_overlay_swaps_the_redis_not_the_queue(sentinel):
    # Given the Sentinel overlay
    kinds = {o["kind"] for o in sentinel}
    scaled = one(sentinel, "ScaledObject")
    url = RedisURL.parse(_env(worker_container(sentinel))["LLMQ_REDIS_URL"])
    # Then no in-cluster Redis is rendered, llmq asks the same Sentinels as KEDA for the master
    # set the tests fail over (tests/cluster/test_sentinel.py)
    assert "StatefulSet" not in kinds
    assert (url.kind, url.master_name, url.username) == ("sentinel", MASTER_NAME, "worker")
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-sentinel-streams"
        addresses = trigger["metadata"]["addresses"].split(",")
        assert len(addresses) >= 3
        assert [f"{h}:{p}" for h, p in url.nodes] == addresses
        assert trigger["metadata"]["sentinelMaster"] == MASTER_NAME


def test_cluster_overlay_points_llmq_and_keda_at_the_cluster_and_rq_beside_it(cluster):
    # Given the Cluster overlay
    scaled = one(cluster, "ScaledObject")
    worker = RedisURL.parse(_env(worker_container(cluster))["LLMQ_REDIS_URL"])
    # Then the workers and KEDA name the same cluster nodes
    assert worker.kind == "cluster" and worker.username == "worker"
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-cluster-streams"
        assert trigger["metadata"]["addresses"].split(",") == [
            f"{h}:{p}" for h, p in worker.nodes]
    # And the gateway and the batch worker reach the cluster for llmq and a plain Redis for rq
    # (rq cannot use a cluster): the base's single node, kept for rq's keys only
    assert one(cluster, "StatefulSet", "llmq-redis")
    for name in ("llmq-gateway", "llmq-batch-worker"):
        env = _env(gateway_container(cluster, name))
        assert RedisURL.parse(env["LLMQ_REDIS_URL"]).kind == "cluster"
        assert RedisURL.parse(env["LLMQ_RQ_REDIS_URL"]).kind == "single"
        assert "@llmq-redis:" in env["LLMQ_RQ_REDIS_URL"]


# -- the gateway ----------------------------------------------------------------------------------


def gateway_container(objects: list[dict], name: str = "llmq-gateway") -> dict:
    return one(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", ["base", "sentinel", "cluster"])
def test_gateway_and_batch_worker_log_in_as_the_gateway_acl_user(overlay, request):
    objects = request.getfixturevalue(overlay)
    acl = (ROOT / "deploy" / "acl.conf").read_text()
    for name in ("llmq-gateway", "llmq-batch-worker"):
        container = gateway_container(objects, name)
        env = {v["name"]: v for v in container["env"]}
        url = RedisURL.parse(env["LLMQ_REDIS_URL"]["value"])
        assert (url.username, url.password) == ("gateway", "$(REDIS_PASSWORD)")
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        password = secret_data(objects, ref["name"])[ref["key"]]
        assert hashlib.sha256(password.encode()).hexdigest() == acl_hashes(acl)["gateway"]
    assert gateway_container(objects)["command"] == ["llmq", "serve"]
    assert gateway_container(objects, "llmq-batch-worker")["command"] == ["llmq",
                                                                          "batch-worker"]


def test_gateway_probes_service_and_scrape_point_at_its_port(base):
    deployment = one(base, "Deployment", "llmq-gateway")
    container = gateway_container(base)
    env = {}
    for source in container["envFrom"]:
        env.update(one(base, "ConfigMap", source["configMapRef"]["name"])["data"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named["http"] == int(env["LLMQ_SERVE_PORT"]) and env["LLMQ_SERVE_HOST"] == "0.0.0.0"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    service = one(base, "Service", "llmq-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == named["http"]
    # And it reads its API keys from a Secret, never a ConfigMap
    keys = {v["name"]: v for v in container["env"]}["LLMQ_API_KEYS"]["valueFrom"]
    assert "secretKeyRef" in keys


def test_gateway_scales_on_cpu_and_drains_one_replica_at_a_time(base):
    hpa = one(base, "HorizontalPodAutoscaler", "llmq-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llmq-gateway"
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # Utilisation is a share of the request: the container must request CPU
    assert gateway_container(base)["resources"]["requests"]["cpu"]
    pdb = one(base, "PodDisruptionBudget", "llmq-gateway")
    labels = one(base, "Deployment", "llmq-gateway")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_gateway_sets_only_settings_llmq_serve_reads(base):
    from tests.unit.test_compose import serve_settings

    container = gateway_container(base)
    names = {v["name"] for v in container["env"]}
    for source in container["envFrom"]:
        names |= set(one(base, "ConfigMap", source["configMapRef"]["name"])["data"])
    assert names - {"REDIS_PASSWORD"} <= serve_settings()


MONITORING_SCHEMA = json.loads((ROOT / "tests" / "data" / "monitoring-v1.schema.json")
                               .read_text())


@pytest.fixture(scope="module")
def monitoring() -> list[dict]:
    return render("k8s/overlays/monitoring")


def test_the_monitoring_overlay_validates_and_scrapes_ports_that_exist(monitoring):
    # Given the base plus the Prometheus Operator's monitors
    for obj in monitoring:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(obj, MONITORING_SCHEMA)
        elif obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, KEDA_SCHEMA)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # Then the ServiceMonitor selects the gateway's Service and scrapes a port it names
    service_monitor = one(monitoring, "ServiceMonitor")
    service = one(monitoring, "Service", "llmq-gateway")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() \
        <= service["metadata"]["labels"].items()
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} \
        <= {p["name"] for p in service["spec"]["ports"]}
    # And the PodMonitor selects the worker pods and scrapes their metrics port
    pod_monitor = one(monitoring, "PodMonitor")
    template = one(monitoring, "Deployment", "llmq-worker")["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() \
        <= template["metadata"]["labels"].items()
    ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports
    # And the base alone carries no monitor (its CRDs may not be installed)
    assert all(o["kind"] not in ("PodMonitor", "ServiceMonitor") for o in render("k8s"))


def test_the_monitoring_schema_rejects_what_the_operator_would():
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
           "metadata": {"name": "x"},
           "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "m", "intervall": "5s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, MONITORING_SCHEMA)
