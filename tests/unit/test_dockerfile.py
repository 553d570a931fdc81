"""Dockerfile and .dockerignore: the contract the compose and k8s files rely on.

No Docker engine runs here, so the image is not built in the tests; these read the Dockerfile
for what the deployments depend on: the entrypoint, the stop signal, a numeric non-root user,
the metrics port, CPU-only torch at the package's pin, the tracing extra and the model baked in.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

import pytest

from tests.unit.worker_settings import ROOT


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    result: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            result.append([])
        if result:
            result[-1].append((instruction.upper(), args.strip()))
    return result


@pytest.fixture(scope="module")
def final() -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for instruction, args in stages()[-1]:
        by_name.setdefault(instruction, []).append(args)
    return by_name


def image_env(final) -> dict[str, str]:
    env = {}
    for args in final.get("ENV", []):
        env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def test_the_worker_is_the_entrypoint_and_stops_on_sigterm(final):
    # Exec form: the worker is PID 1 (or tini's child) and receives SIGTERM itself, not a shell.
    assert [json.loads(a) for a in final["ENTRYPOINT"]] == [["llmq", "worker"]]
    assert final["STOPSIGNAL"] == ["SIGTERM"]


def test_runs_as_a_numeric_non_root_user(final):
    (user,) = final["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit(), "runAsNonRoot can only verify a numeric USER"
    assert int(uid) != 0


def test_metrics_port_is_on_and_exposed(final):
    port = image_env(final)["LLMQ_METRICS_PORT"]
    assert int(port) > 0
    assert port in " ".join(final["EXPOSE"]).split()
    (check,) = final["HEALTHCHECK"]
    assert "/healthz" in check and "LLMQ_METRICS_PORT" in check


def test_torch_comes_from_the_cpu_index_at_the_packages_pin():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    runs = [args for stage in stages() for instruction, args in stage if instruction == "RUN"]
    torch_runs = [r for r in runs if re.search(r"\btorch==", r)]
    assert torch_runs, "torch must be installed on its own, before the package"
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_runs[0]
    assert re.search(rf"(?<![\w.-]){re.escape(pin)}(?![\w.])", torch_runs[0]), pin


def test_the_package_is_installed_with_the_tracing_extra():
    # `--otlp-traces-endpoint` and the OTEL_* variables need the `otel` extra's packages.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "otel" in pyproject["project"]["optional-dependencies"]
    runs = [args for stage in stages() for instruction, args in stage if instruction == "RUN"]
    assert any(re.fullmatch(r"pip install '?/src\[otel\]'?", r) for r in runs), runs


def test_the_default_model_is_baked_into_the_model_dir(final):
    build = stages()[0]
    model_dir = image_env(final)["LLMQ_MODEL_DIR"]
    build_env = " ".join(args for instruction, args in build if instruction == "ENV")
    assert f"LLMQ_MODEL_DIR={model_dir}" in build_env
    assert ("RUN", "python -m llmq.worker.engine.model.default_model") in build
    assert any(args.endswith(f" {model_dir} {model_dir}") for args in final["COPY"])


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removeprefix("**/")):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_inputs_and_drops_the_heavy_rest():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # llmq/ and the folders its links point at (the package's code)
    links = [path for path in (ROOT / "llmq").iterdir() if path.is_symlink()]
    needed = ["pyproject.toml", "llmq", *(path.resolve().relative_to(ROOT).as_posix()
                                          for path in links)]
    assert len(links) >= 5, "llmq/ should link protocol, broker, worker, gateway and cli"
    if isinstance(pyproject["project"].get("readme"), str):
        needed.append(pyproject["project"]["readme"])
    for path in needed:
        assert not _ignored(path, patterns), f".dockerignore drops {path}, which pip needs"
    # A virtualenv or a model cache in the context would add gigabytes to every build.
    for path in (".venv", ".git", "worker/__pycache__", "SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert _ignored(path, patterns), f".dockerignore should drop {path}"
