"""A worker speculating with a draft model, against a real server: the same answers, and the
proposer and its acceptance rate in the heartbeat and `llmq status`."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from llmq import protocol
from llmq.cli.status import status
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
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


def test_a_worker_drafting_with_a_model_answers_the_same_and_reports_acceptance(
        redis_server, redis_client, tiny_model: Any) -> None:
    # Given the answers of a plain engine, and a worker whose model drafts for itself
    reference = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64),
                           loaded=tiny_model)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = [o.new_token_ids for o in reference.generate(PROMPTS, params)]
    worker = InProcessWorker(redis_server.url, tiny_model, worker_id="drafting",
                             speculative_method="draft", draft=tiny_model)
    with worker:
        # When two requests run on it
        ids = [xadd_json(redis_client, {"prompt_token_ids": prompt, "max_tokens": 30,
                                        "temperature": 0, "ignore_eos": True})
               for prompt in PROMPTS]
        dones = [wait_terminal(redis_client, entry_id) for entry_id in ids]
        key = KEYS.worker("drafting")
        beat = wait_for(lambda: (b := protocol.decode_heartbeat(redis_client.hgetall(key)))
                        .spec_acceptance_rate > 0 and b, 10, "a heartbeat with acceptance")
        shown = CliRunner().invoke(status, ["--redis-url", redis_server.url])
    # Then both answers equal the plain engine's, token for token, several tokens a delta
    for entry_id, done, tokens in zip(ids, dones, expected, strict=True):
        assert isinstance(done, protocol.Done) and done.finish_reason == "length"
        deltas = [e for e in read_events(redis_client, entry_id)
                  if isinstance(e, protocol.Delta)]
        assert [t for d in deltas for t in d.token_ids] == tokens
        assert max(len(d.token_ids) for d in deltas) > 1
    # And the heartbeat and `llmq status` name the proposer, every draft token accepted
    assert beat.speculative_method == "draft"
    assert beat.spec_acceptance_rate == 1.0
    assert shown.exit_code == 0, shown.output
    assert "100% draft" in shown.output
