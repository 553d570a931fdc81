"""A worker running speculative decoding, against a real server: the same answers, deltas of
several tokens, the opt-out honoured, and the acceptance rate in its heartbeat."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from llmq import protocol
from llmq.cli.status import status
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
from tests.engine.spec_oracle import use_oracle
from tests.integration.worker_harness import (
    KEYS,
    InProcessWorker,
    read_events,
    wait_for,
    wait_terminal,
    xadd_json,
)

pytestmark = pytest.mark.redis

PROMPTS = [[100 + (i * 37 + j * 11) % 400 for j in range(7 + i)] for i in range(2)]


def test_speculating_worker_streams_the_same_answers_and_reports_acceptance(
        redis_server, redis_client, tiny_model: Any) -> None:
    # Given the answers of a plain engine, and a worker speculating from them (some wrong)
    reference = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64),
                           loaded=tiny_model)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = [o.new_token_ids for o in reference.generate(PROMPTS, params)]
    worker = InProcessWorker(redis_server.url, tiny_model, worker_id="speculating",
                             speculative_method="ngram")
    speculator = use_oracle(worker.engine, {tuple(p): e for p, e in zip(PROMPTS, expected,
                                                                        strict=True)})
    with worker:
        # When one request speculates and one opts out on the wire
        ids = [xadd_json(redis_client, {"prompt_token_ids": prompt, "max_tokens": 30,
                                        "temperature": 0, "ignore_eos": True,
                                        "speculative": speculative})
               for prompt, speculative in zip(PROMPTS, (True, False), strict=True)]
        dones = [wait_terminal(redis_client, entry_id) for entry_id in ids]
        key = KEYS.worker("speculating")
        beat = wait_for(lambda: (b := protocol.decode_heartbeat(redis_client.hgetall(key)))
                        .spec_acceptance_rate > 0 and b, 10, "a heartbeat with acceptance")
        shown = CliRunner().invoke(status, ["--redis-url", redis_server.url])
    # Then both answers equal the plain engine's, token for token
    for entry_id, done, tokens in zip(ids, dones, expected, strict=True):
        assert isinstance(done, protocol.Done) and done.finish_reason == "length"
        deltas = [e for e in read_events(redis_client, entry_id)
                  if isinstance(e, protocol.Delta)]
        assert [t for d in deltas for t in d.token_ids] == tokens
    # And the speculating one streamed several tokens per delta; the other one token each
    first = [e for e in read_events(redis_client, ids[0]) if isinstance(e, protocol.Delta)]
    second = [e for e in read_events(redis_client, ids[1]) if isinstance(e, protocol.Delta)]
    assert max(len(d.token_ids) for d in first) > 1
    assert max(len(d.token_ids) for d in second) == 1
    # And the heartbeat says the worker speculates, with the acceptance its engine counted
    stats = speculator.stats
    assert beat.speculative_method == "ngram"
    assert 0 < beat.spec_acceptance_rate < 1
    assert beat.spec_acceptance_rate == pytest.approx(stats.acceptance_rate, abs=1e-3)
    # And `llmq status` shows it beside the worker
    assert shown.exit_code == 0, shown.output
    assert "SPEC ACCEPT" in shown.output
    assert f"{beat.spec_acceptance_rate:.0%} ngram" in shown.output
