"""Key names: the schema of broker/keys.py, and names that must never become part of a key."""

from __future__ import annotations

import fnmatch

import pytest

from llmq.broker.keys import GROUP, InvalidName, Keys, validate_name
from llmq.broker.settings import BrokerSettings

BAD_NAMES = [
    "",
    "a{b}",
    "{tag}",
    "a*",
    "a?b",
    "a[b]",
    "with space",
    "line\nbreak",
    "trailing\n",
    "tab\t",
    "nul\x00",
    "slash/",
    "ünïcode",
    "x" * 129,
    "x" * 10_000,
]


def test_default_schema_is_v2_with_hash_tags() -> None:
    # Given the default prefix
    keys = Keys()
    # Then what one script touches shares a hash tag: the queue's keys carry the queue name...
    assert keys.queue("default") == "llmq:q:{default}"
    assert keys.dlq("default") == "llmq:dlq:{default}"
    assert keys.cancel("default") == "llmq:cancel:{default}"
    assert keys.handbacks("default") == "llmq:hb:{default}"
    assert keys.control("default") == "llmq:ctl:{default}"
    assert keys.idempotency("default", "req-1") == "llmq:id:{default}:req-1"
    # ... a request's keys its id, so result streams spread over a cluster by request id
    assert keys.result("req-1") == "llmq:r:{req-1}"
    assert keys.cancel_flag("req-1") == "llmq:x:{req-1}"
    assert keys.stream_options("r1") == "llmq:sse:{r1}"
    # ... and single keys none
    assert keys.worker("w1") == "llmq:w:w1"
    assert keys.workers() == "llmq:workers"
    assert keys.queues() == "llmq:queues"
    assert keys.control_reply("c1") == "llmq:ctlr:c1"
    # And a batch's keys its batch id, a gateway tenant's files the tenant
    assert keys.batch_output("b1") == "llmq:batch:{b1}:output"
    assert keys.file("acme", "f1") == "llmq:file:{acme}:f1"
    assert keys.tenant_files("acme") == "llmq:files:{acme}"
    assert GROUP == "workers"


def test_a_tenants_keys_live_in_a_space_the_shared_producer_globs_cannot_reach() -> None:
    # Given gateway request ids `<tenant>:<id>`
    keys = Keys()
    # Then every key of tenant acme's ids starts `llmq:t:<kind>:{acme:` (or `llmq:t:id:acme:`)
    assert keys.result("acme:7f3a") == "llmq:t:r:{acme:7f3a}"
    assert keys.cancel_flag("acme:7f3a") == "llmq:t:x:{acme:7f3a}"
    assert keys.stream_options("acme:7f3a") == "llmq:t:sse:{acme:7f3a}"
    assert keys.idempotency("default", "acme:7f3a") == "llmq:t:id:acme:7f3a:{default}"
    # And none matches the shared producer's patterns (llmq:r:*, llmq:x:*, llmq:id:*), nor does
    # bob's id `bob:acme:1` match acme's marker glob
    for key in (keys.result("acme:1"), keys.cancel_flag("acme:1"),
                keys.idempotency("q", "acme:1")):
        assert not fnmatch.fnmatchcase(key, "llmq:r:*") and not key.startswith(
            ("llmq:x:", "llmq:id:", "llmq:r:"))
    assert not fnmatch.fnmatchcase(keys.idempotency("q", "bob:acme:1"), "llmq:t:id:acme:*")


def test_the_v1_queue_name_is_built_only_to_be_detected() -> None:
    assert Keys().legacy_queue("default") == "llmq:q:default"


def test_prefix_is_configurable() -> None:
    assert Keys("tenant-a").result("r") == "tenant-a:r:{r}"


@pytest.mark.parametrize("prefix", ["", "a b", "{a}{b}", "{a", "a}", "{llmq}", "x*", "x" * 65,
                                    "p\n"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(InvalidName, match="invalid prefix"):
        Keys(prefix)


@pytest.mark.parametrize("name", ["default", "a", "req_1.2:3-x", "1796013460689-0", "x" * 128])
def test_valid_names_pass_unchanged(name: str) -> None:
    assert validate_name("request_id", name) == name
    assert Keys().result(name).endswith(":{" + name + "}")


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:20])
@pytest.mark.parametrize("build", ["queue", "dlq", "cancel", "result", "cancel_flag",
                                   "legacy_queue", "worker", "control", "control_reply"])
def test_bad_names_never_become_keys(build: str, name: str) -> None:
    # Given a name with a hash tag, a glob, a newline, or 10k characters
    # When any key is built from it
    # Then it is refused, naming the rule, and no key comes out
    with pytest.raises(InvalidName, match=r"must match \[A-Za-z0-9_\.:-\]\{1,128\}"):
        getattr(Keys(), build)(name)


@pytest.mark.parametrize("value", [None, 5, b"bytes", ["a"]])
def test_non_strings_are_refused(value: object) -> None:
    with pytest.raises(InvalidName):
        validate_name("queue", value)


def test_refusal_message_shows_a_long_name_shortened() -> None:
    with pytest.raises(InvalidName) as info:
        Keys().result("x" * 10_000)
    assert len(str(info.value)) < 200


def test_settings_come_from_the_environment() -> None:
    # Given the deployment's environment variables
    env = {"LLMQ_REDIS_URL": "redis://r:6379/1", "LLMQ_PREFIX": "ours", "LLMQ_QUEUE": "big",
           "LLMQ_RESULT_TTL": "60", "LLMQ_RESULT_MAXLEN": "500"}
    # When settings are read, with one override
    settings = BrokerSettings.from_env(env, queue="small")
    # Then each variable lands in its field and the explicit value wins
    assert settings == BrokerSettings("redis://r:6379/1", "ours", "small", 60, 500)
    assert settings.keys.queue(settings.queue) == "ours:q:{small}"


@pytest.mark.parametrize("env, message", [
    ({"LLMQ_RESULT_TTL": "soon"}, "LLMQ_RESULT_TTL must be an integer"),
    ({"LLMQ_RESULT_MAXLEN": "0"}, "result_maxlen must be >= 1"),
    ({"LLMQ_QUEUE": "a b"}, "invalid queue"),
    ({"LLMQ_PREFIX": "a*"}, "invalid prefix"),
])
def test_bad_settings_are_refused_with_the_reason(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BrokerSettings.from_env(env)
