"""Redis in broker/ only: no module outside llmq.broker issues Redis commands itself.

docs/architecture.md says llmq.broker is everything that talks to Redis: the gateway and the CLI
go through its clients and stores (`llmq.broker.exchange`), so key names, retries and error
translation live in one place. The worker's IO threads are the one other place, listed below
with the reason each needs its own connection. This test reads the source (AST, no imports) and
fails naming file:line for any other call on a redis-py client or pipeline.

A value counts as a Redis client or pipeline when it is:
  - an attribute named like one (`.redis`, `.sync_redis`, `.rq_redis`, `.rq`, `._redis`),
  - a name or attribute annotated with a redis-py type (`redis.Redis`, `Pipeline`...),
  - a name or attribute assigned from one, from a connection factory (`connect(...)`,
    `redis.Redis(...)`, `rq_connection(...)`...), or from `<client>.pipeline(...)`.
Any method called on such a value is a command (or sends one: `execute`, `pipeline`), except
the few that do no IO (`close`...). Passing a client to a broker function is fine.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "worker", "gateway", "cli", "jobs")  # everything of llmq but broker/

# The worker's IO modules: each runs on a thread (or the busy loop) with its own connection from
# `WorkerContext.connect`, and its Redis commands are the worker's side of the protocol
# (docs/protocol.md), which no producer API covers.
WORKER_IO = {
    "worker/stream_reader.py": "XREADGROUP of the queue: the worker's inbox",
    "worker/lane_registry.py": "the queue's lanes (HKEYS) and their consumer groups",
    "worker/admission.py": "TIME, the cancel flag and the ack of refused entries at admission",
    "worker/lease_keeper.py": "heartbeats, lease renewal and fencing, hand-backs",
    "worker/reclaimer.py": "XAUTOCLAIM / XCLAIM of dead workers' entries, dead-lettering",
    "worker/result_writer.py": "result events and XACK in one MULTI per batch",
    "worker/cluster_pipelines.py": "the result writer's MULTI per cluster node (slot by slot)",
    "worker/stream_follower.py": "XREAD of the cancel and control streams every worker follows",
    "worker/control_listener.py": "the answers to utility calls (`llmq admin`)",
    "worker/cancel_listener.py": "EXISTS of the owner's cancel flag before an abort",
    "worker/unread_loss.py": "XINFO GROUPS and the lost-unread count: a queue trimmed unread",
    "worker/worker.py": "the consumer group, the function library, deregistering on exit",
    "worker/affinity_keeper.py": "prefix-cache summaries, ticket backlogs, XREAD of its tickets",
}

REDIS_ATTRS = {"redis", "sync_redis", "rq_redis", "_rq_redis", "rq", "_redis"}
FACTORIES = {"connect", "connect_async", "connect_at_most_once", "dedicated_connection",
             "rq_connection", "Redis", "StrictRedis", "RedisCluster", "from_url", "from_pool",
             "master_for"}
NO_IO = {"close", "aclose", "get_encoder", "get_connection_kwargs"}


class _RedisCalls(ast.NodeVisitor):
    """Finds the Redis commands modules issue (see the module docstring). Attributes are learnt
    over all the modules given together (one package: a base class may open the connection its
    subclasses use), names within each module."""

    def __init__(self, trees: list[ast.Module]) -> None:
        self.attrs = set(REDIS_ATTRS)
        self.names: set[str] = set()
        while True:  # to a fixed point: an assignment may copy what a later one binds
            before = len(self.attrs)
            for tree in trees:
                self.names = set()
                self._learn(tree)
            if len(self.attrs) == before:
                return

    def calls(self, tree: ast.Module) -> list[ast.Call]:
        self.names = set()
        self._learn(tree)
        self._found: list[ast.Call] = []
        self.visit(tree)
        return self._found

    def _learn(self, tree: ast.Module) -> None:
        """Names and attributes holding a client or pipeline, to a fixed point."""
        while True:
            before = len(self.names) + len(self.attrs)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and self._is_redis(node.value):
                    for target in node.targets:
                        self._bind(target)
                elif isinstance(node, ast.AnnAssign) and (
                        _redis_annotation(node.annotation)
                        or (node.value is not None and self._is_redis(node.value))):
                    self._bind(node.target)
                elif isinstance(node, ast.arg) and node.annotation is not None and \
                        _redis_annotation(node.annotation):
                    self.names.add(node.arg)
                elif isinstance(node, ast.withitem) and node.optional_vars is not None and \
                        self._is_redis(node.context_expr):
                    self._bind(node.optional_vars)
            if len(self.names) + len(self.attrs) == before:
                return

    def _bind(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.names.add(target.id)
        elif isinstance(target, ast.Attribute):
            self.attrs.add(target.attr)

    def _is_redis(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Attribute):
            return node.attr in self.attrs
        if isinstance(node, ast.Await):
            return self._is_redis(node.value)
        if isinstance(node, ast.IfExp):
            return self._is_redis(node.body) or self._is_redis(node.orelse)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                return func.id in FACTORIES
            if isinstance(func, ast.Attribute):
                return func.attr in FACTORIES or (func.attr == "pipeline"
                                                  and self._is_redis(func.value))
        return False

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr not in NO_IO and \
                self._is_redis(func.value):
            self._found.append(node)
        self.generic_visit(node)


def _redis_annotation(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return any(word in text for word in ("Redis", "Pipeline"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@functools.cache
def redis_calls(package: str) -> dict[str, list[str]]:
    """Per module of a package (top-level folder): `file:line: call` for each Redis command."""
    paths = sorted((ROOT / package).rglob("*.py"))
    trees = {path.relative_to(ROOT).as_posix(): _parse(path) for path in paths}
    finder = _RedisCalls(list(trees.values()))
    return {where: [f"{where}:{call.lineno}: {ast.unparse(call.func)}(...)"
                    for call in finder.calls(tree)] for where, tree in trees.items()}


def calls_in(source: str, where: str) -> list[str]:
    tree = ast.parse(source, where)
    return [f"{where}:{call.lineno}: {ast.unparse(call.func)}(...)"
            for call in _RedisCalls([tree]).calls(tree)]


def test_only_broker_and_the_worker_io_modules_issue_redis_commands() -> None:
    # Given every module of llmq outside broker/, When their source is searched for calls on
    # Redis clients and pipelines
    found = [call for package in PACKAGES for where, calls in redis_calls(package).items()
             if where not in WORKER_IO for call in calls]
    # Then there are none: such a call belongs behind a broker API
    assert found == [], ("Redis commands outside llmq.broker (move them behind a broker store, "
                         "see llmq.broker.exchange):\n" + "\n".join(found))


@pytest.mark.parametrize("module", sorted(WORKER_IO))
def test_each_allowed_worker_module_still_needs_its_exemption(module: str) -> None:
    # Given a worker module on the allow list, Then it does issue Redis commands (else its
    # exemption is stale and would hide a newcomer)
    assert redis_calls("worker")[module], f"{module} issues no Redis command: drop it from " \
        "WORKER_IO"


@pytest.mark.parametrize("snippet", [
    "client.redis.xadd(key, fields)",
    "self.state.client.redis.hgetall(key)",
    "pipe = self.client.redis.pipeline(transaction=True)\npipe.set(key, b'1')",
    "async def f(r: redis.asyncio.Redis) -> None:\n    await r.execute_command('PING')",
    "self.conn = connect(url)\nself.conn.fcall('llmq_submit', 0)",
    "with client.redis.pipeline() as p:\n    p.xread({key: '0'})",
])
def test_a_redis_command_added_to_the_gateway_is_caught(snippet: str) -> None:
    # Given a gateway module that issues a Redis command itself (on line 3)
    source = "def probe(client, key, url, fields):\n    pass\n" + snippet + "\n"
    # When it is checked, Then the call is reported with its file and line
    found = calls_in(source, "gateway/probe.py")
    assert found and found[-1].startswith(f"gateway/probe.py:{2 + snippet.count(chr(10)) + 1}:")


def test_calls_that_only_look_alike_are_not_commands() -> None:
    # Given dict and job-meta calls named like commands, and a client passed to a broker API
    source = ("meta = job.meta.get('status')\nstore.set(x)\nload_functions(client.redis)\n"
              "client.redis.close()\n")
    # When checked, Then nothing is reported
    assert calls_in(source, "gateway/probe.py") == []
