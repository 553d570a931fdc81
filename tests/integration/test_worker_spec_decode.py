"""A worker running speculative decoding (prompt lookup, a draft model), against a real server:
the same answers, deltas of several tokens, the opt-out honoured, and the acceptance rate in its
heartbeat and `llmq status`."""

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


def plain_answers(tiny_model: Any) -> list[list[int]]:
    """PROMPTS' greedy tokens from a plain engine (no speculation)."""
    reference = EngineCore(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64),
                           loaded=tiny_model)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    return [o.new_token_ids for o in reference.generate(PROMPTS, params)]


def run_prompts(worker: InProcessWorker, worker_id: str, redis_client, redis_url: str,
                speculative: tuple[bool, bool] = (True, True)) -> tuple[list[str], Any, Any]:
    """PROMPTS through `worker` (`worker_id`), each opting in or out of speculation on the
    wire: the entry ids, once both are done and a heartbeat counts accepted drafts, with that
    heartbeat and `llmq status`'s output."""
    with worker:
        ids = [xadd_json(redis_client, {"prompt_token_ids": prompt, "max_tokens": 30,
                                        "temperature": 0, "ignore_eos": True,
                                        "speculative": opt_in})
               for prompt, opt_in in zip(PROMPTS, speculative, strict=True)]
        for entry_id in ids:
            done = wait_terminal(redis_client, entry_id)
            assert isinstance(done, protocol.Done) and done.finish_reason == "length"
        key = KEYS.worker(worker_id)
        beat = wait_for(lambda: (b := protocol.decode_heartbeat(redis_client.hgetall(key)))
                        .spec_acceptance_rate > 0 and b, 10, "a heartbeat with acceptance")
        shown = CliRunner().invoke(status, ["--redis-url", redis_url])
    assert shown.exit_code == 0, shown.output
    return ids, beat, shown


def streamed(redis_client, entry_id: str) -> list[protocol.Delta]:
    return [e for e in read_events(redis_client, entry_id) if isinstance(e, protocol.Delta)]


def test_speculating_worker_streams_the_same_answers_and_reports_acceptance(
        redis_server, redis_client, tiny_model: Any) -> None:
    # Given the answers of a plain engine, and a worker speculating from them (some wrong)
    expected = plain_answers(tiny_model)
    worker = InProcessWorker(redis_server.url, tiny_model, worker_id="speculating",
                             speculative_method="ngram")
    speculator = use_oracle(worker.engine, {tuple(p): e for p, e in zip(PROMPTS, expected,
                                                                        strict=True)})
    # When one request speculates and one opts out on the wire
    ids, beat, shown = run_prompts(worker, "speculating", redis_client, redis_server.url,
                                   (True, False))
    # Then both answers equal the plain engine's, token for token
    for entry_id, tokens in zip(ids, expected, strict=True):
        assert [t for d in streamed(redis_client, entry_id) for t in d.token_ids] == tokens
    # And the speculating one streamed several tokens per delta; the other one token each
    assert max(len(d.token_ids) for d in streamed(redis_client, ids[0])) > 1
    assert max(len(d.token_ids) for d in streamed(redis_client, ids[1])) == 1
    # And the heartbeat says the worker speculates, with the acceptance its engine counted
    stats = speculator.stats
    assert beat.speculative_method == "ngram"
    assert 0 < beat.spec_acceptance_rate < 1
    assert beat.spec_acceptance_rate == pytest.approx(stats.acceptance_rate, abs=1e-3)
    # And `llmq status` shows it beside the worker
    assert "SPEC ACCEPT" in shown.output
    assert f"{beat.spec_acceptance_rate:.0%} ngram" in shown.output


def test_a_worker_drafting_with_a_model_answers_the_same_and_reports_acceptance(
        redis_server, redis_client, tiny_model: Any) -> None:
    # Given the answers of a plain engine, and a worker whose model drafts for itself
    expected = plain_answers(tiny_model)
    worker = InProcessWorker(redis_server.url, tiny_model, worker_id="drafting",
                             speculative_method="draft", draft=tiny_model)
    # When two requests run on it
    ids, beat, shown = run_prompts(worker, "drafting", redis_client, redis_server.url)
    # Then both answers equal the plain engine's, token for token, several tokens a delta
    for entry_id, tokens in zip(ids, expected, strict=True):
        deltas = streamed(redis_client, entry_id)
        assert [t for d in deltas for t in d.token_ids] == tokens
        assert max(len(d.token_ids) for d in deltas) > 1
    # And the heartbeat and `llmq status` name the proposer, every draft token accepted
    assert beat.speculative_method == "draft"
    assert beat.spec_acceptance_rate == 1.0
    assert "100% draft" in shown.output
