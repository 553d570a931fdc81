"""`llmq serve`: the OpenAI-compatible gateway (llmq.gateway) under uvicorn.

    llmq serve --api-key alice=sk-alice --api-key bob=sk-bob      # 127.0.0.1:8000
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-alice python my_app.py
    open http://127.0.0.1:8000/dashboard                          # sign in with a key

Flags map onto `GatewaySettings`, each with its `LLMQ_*` variable. The gateway is stateless:
run as many as you like behind a load balancer, all pointed at the same Redis.
"""

from __future__ import annotations

import faulthandler
import signal

import click

from llmq.cli.options import connection_options
from llmq.cli.tracing_option import otlp_traces_endpoint_option, start_tracing


@click.command()
@connection_options
@click.option("--host", envvar="LLMQ_SERVE_HOST", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface).")
@click.option("--port", envvar="LLMQ_SERVE_PORT", type=click.IntRange(0, 65535), default=8000,
              show_default=True)
@click.option("--api-key", "api_keys", envvar="LLMQ_API_KEYS", multiple=True, metavar="TENANT=KEY",
              help="An API key and the tenant it acts for (repeatable; LLMQ_API_KEYS holds "
                   "several, separated by commas or spaces). A bare KEY is tenant `default`.")
@click.option("--api-keys-file", envvar="LLMQ_API_KEYS_FILE", multiple=True,
              type=click.Path(exists=True, dir_okay=False),
              help="A file of `TENANT=KEY` lines (# comments).")
@click.option("--no-auth", is_flag=True, envvar="LLMQ_NO_AUTH",
              help="Serve without keys, everyone as tenant `default` (trusted networks only).")
@click.option("--admin-tenant", "admin_tenants", envvar="LLMQ_ADMIN_TENANTS", multiple=True,
              metavar="TENANT",
              help="A tenant whose keys see and act on the whole pool in the dashboard: every "
                   "dead letter and request (repeatable; LLMQ_ADMIN_TENANTS holds several).")
@click.option("--max-queue", envvar="LLMQ_MAX_QUEUE", type=click.IntRange(min=1),
              default=10_000, show_default=True,
              help="Unread requests in a queue above which new ones get 429.")
@click.option("--request-timeout", envvar="LLMQ_REQUEST_TIMEOUT",
              type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a request may take before the gateway answers 504.")
@click.option("--max-file-bytes", envvar="LLMQ_MAX_FILE_BYTES", type=click.IntRange(min=1),
              default=64 << 20, show_default=True, help="Largest file /v1/files accepts.")
@click.option("--max-body-bytes", envvar="LLMQ_MAX_BODY_BYTES", type=click.IntRange(min=1),
              default=4 << 20, show_default=True,
              help="Largest request body read (file uploads: --max-file-bytes); a larger one, "
                   "even streamed, is cut there with 413.")
@click.option("--file-ttl", envvar="LLMQ_FILE_TTL", type=click.IntRange(min=60),
              default=7 * 24 * 3600, show_default=True,
              help="Seconds files, batches and batch results are kept.")
@click.option("--dashboard-interval", envvar="LLMQ_DASHBOARD_INTERVAL",
              type=click.FloatRange(1.0, 300.0), default=10.0, show_default=True,
              help="Seconds between the dashboard's chart samples (the same on every replica).")
@click.option("--disconnect-grace", envvar="LLMQ_DISCONNECT_GRACE",
              type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a stream whose client went away waits for a resume before its "
                   "request is cancelled (0: at once).")
@click.option("--metrics-require-key", is_flag=True, envvar="LLMQ_METRICS_REQUIRE_KEY",
              help="Answer /metrics only with an API key (default: open, as scrapers expect).")
@click.option("--log-requests", is_flag=True, envvar="LLMQ_LOG_REQUESTS",
              help="One access-log line per request.")
@otlp_traces_endpoint_option
def serve(redis_url: str | None, prefix: str, queue: str, host: str, port: int,
          api_keys: tuple[str, ...], api_keys_file: tuple[str, ...], no_auth: bool,
          admin_tenants: tuple[str, ...], max_queue: int, request_timeout: float,
          max_file_bytes: int, max_body_bytes: int, file_ttl: int, dashboard_interval: float,
          disconnect_grace: float, metrics_require_key: bool, log_requests: bool,
          otlp_traces_endpoint: str | None) -> None:
    """Serve the OpenAI API (chat, completions, files, batches) in front of the pool."""
    import uvicorn

    from llmq.broker.settings import BrokerSettings
    from llmq.gateway.api_keys import ApiKeys
    from llmq.gateway.app import create_app
    from llmq.gateway.settings import GatewaySettings

    try:
        keys = ApiKeys.parse(api_keys, files=api_keys_file, anonymous=no_auth,
                             admin_tenants=admin_tenants)
        settings = GatewaySettings(
            keys, BrokerSettings.from_env(redis_url=redis_url, prefix=prefix, queue=queue),
            max_queue=max_queue, request_timeout=request_timeout,
            max_file_bytes=max_file_bytes, max_body_bytes=max_body_bytes, file_ttl=file_ttl,
            dashboard_interval=dashboard_interval, disconnect_grace=disconnect_grace,
            metrics_require_key=metrics_require_key)
    except (ValueError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    start_tracing("llmq-gateway", otlp_traces_endpoint)
    server: uvicorn.Server | None = None
    app = create_app(settings, redis_url=redis_url,
                     shutting_down=lambda: server is not None and server.should_exit)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=log_requests, loop="auto",
        http="auto", timeout_graceful_shutdown=30, proxy_headers=True, server_header=False))
    tenants = ", ".join(sorted(keys.tenants))
    click.echo(f"llmq serve: http://{host}:{port}/v1 (tenants: {tenants}); dashboard: "
               f"http://{host}:{port}/dashboard", err=True)
    # NOTE: `kill -USR1 <pid>` prints every thread's stack to stderr, as for a worker.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    server.run()
