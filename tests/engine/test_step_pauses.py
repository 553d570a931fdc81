"""Steps paused for an interactive arrival (worker/engine/step_interrupt.py), through the whole
engine (tiny random Llama, float32): a batch step stopped after any decoder layer or any
vocabulary slice of its LM head (llama.py `logits_parts`), with
interactive requests run beside it, resumed or dropped, leaves every request's greedy tokens
what they are when it runs alone, with speculation, n > 1, chunked prefill, the prefix cache,
preemption and aborts in play."""

from __future__ import annotations

import pytest

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.sampling_params import SamplingParams, StructuredOutputParams
from llmq.worker.engine.step_interrupt import StepInterrupt
from tests.engine.spec_oracle import use_oracle
from tests.engine.test_engine_lanes import GREEDY, TWO, make_engine

SHARED = [200 + j for j in range(12)]
LONG = [100 + (j * 7) % 300 for j in range(90)]
BATCH = {"a": SHARED + [5, 6], "b": SHARED + [7, 8, 9], "two": [300 + j for j in range(9)],
         **{f"s{i}": [100 + (i * 31 + j * 17) % 400 for j in range(5 + i)] for i in range(4)},
         "long": LONG}
# interactive prompts: one reusing the long batch prompt's head, whose blocks a paused step
# may be computing (never a prefix-cache hit before they are computed)
ONLINE = {"o0": [150 + j for j in range(7)], "o1": LONG[:40] + [9, 8, 7],
          "o2": SHARED + [11], "o3": [410 + j for j in range(6)]}


LONGER = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


class PauseAfterLayer(StepInterrupt):
    """Pauses the next pausable step at its pause point `layer` (decoder layers, then the LM
    head's slices), once per `arm()`: an interactive arrival at a chosen point of a step."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def _pause_after(self, layer: int) -> bool:
        if self.armed and layer == self.layer:
            self.armed = False
            return True
        return False


def solo_tokens(tiny_model, tiny_model_path, prompts: dict[str, list[int]],
                params: SamplingParams = GREEDY) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens run alone ("two": its 2 completions)."""
    plain = make_engine(tiny_model, tiny_model_path)
    return {name: [o.new_token_ids for o in plain.generate(
        [prompt], TWO if name == "two" else params)] for name, prompt in prompts.items()}


class Run:
    """An engine with batch work, stepped by the test; collects every request's tokens."""

    def __init__(self, engine: EngineCore, layer: int) -> None:
        self.engine = engine
        self.pauses = PauseAfterLayer(layer)
        engine.step_interrupt = self.pauses
        self.tokens: dict[tuple[str, int], list[int]] = {}

    def step(self) -> list[EngineCoreOutput]:
        outs = self.engine.step()
        for out in outs:
            self.tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return outs

    def pause_a_step(self) -> list[EngineCoreOutput]:
        """Step until a step pauses (every step with batch work is pausable but the ones run
        beside a paused step); that step's outputs."""
        self.pauses.arm()
        num_paused = self.pauses.num_paused
        outs = self.step()
        while self.pauses.num_paused == num_paused:
            assert self.engine.has_unfinished_requests(), "no batch work left to pause"
            outs = self.step()
        return outs

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def outputs(self, name: str, n: int) -> list[list[int]]:
        return [self.tokens.get((name, index), []) for index in range(n)]


def pause_points(tiny_model) -> list[int]:
    """After each decoder layer, and after the first, a middle and the last slice of the LM
    head (after the last, the logits are in and sampling is left)."""
    num_layers, num_parts = tiny_model.arch.num_layers, len(tiny_model.model.lm_head.parts)
    assert num_parts > 1
    return [*range(num_layers), *(num_layers + k for k in (0, num_parts // 2, num_parts - 1))]


def test_batch_steps_paused_after_any_layer_or_head_slice_give_every_request_its_solo_tokens(
        tiny_model, tiny_model_path):
    # Given batch prompts (shared prefixes, a long one in chunks, one asking for 2 completions),
    # interactive prompts, and each one's greedy tokens run alone
    expected = solo_tokens(tiny_model, tiny_model_path, {**BATCH, **ONLINE})
    for layer in pause_points(tiny_model):
        # When batch steps (with speculation, 32-token steps, 8 batch prompt tokens a step)
        # pause after `layer` (or head slice) and each pause lets an interactive request in
        engine = make_engine(tiny_model, tiny_model_path, speculative_method="ngram",
                             max_num_batched_tokens=32, max_batch_prefill_tokens=8)
        speculator = use_oracle(engine, {tuple(p): expected[name][0]
                                         for name, p in {**BATCH, **ONLINE}.items()})
        run = Run(engine, layer)
        for name, prompt in BATCH.items():
            engine.add_request(name, prompt, TWO if name == "two" else GREEDY, batch=True)
        paused_interactive = set()  # interactive requests decoding in a paused step
        for name, prompt in ONLINE.items():
            assert not any(o.new_token_ids for o in run.pause_a_step())  # nothing delivered
            paused = engine._paused
            assert paused is not None and paused.forward.num_layers_done == layer + 1
            paused_interactive |= paused.request_ids & set(ONLINE)
            engine.add_request(name, prompt, GREEDY)
            # Then the next steps (two for a prompt longer than a step) give the interactive
            # request its first token, and nothing else
            first: set[str] = set()
            while not first:
                assert engine._paused is paused
                first = {o.request_id for o in run.step() if o.new_token_ids}
            assert first == {name}
            # and the paused step then resumes (one of batch work only: its requests' tokens
            # come in the step after, with none of the interactive one's)
            assert engine._paused is paused
            resumed = {o.request_id for o in run.step() if o.new_token_ids}
            assert name not in resumed and engine._paused is None
        run.finish()
        # And every request produced exactly what it produces alone, nothing was dropped
        for name, outs in expected.items():
            assert run.outputs(name, len(outs)) == outs, (layer, name)
        assert engine.step_interrupt.num_paused == len(ONLINE) and paused_interactive
        assert engine.step_interrupt.num_dropped == 0
        assert speculator.stats.num_accepted_tokens > 0
        assert engine.stats().kv_cache_usage == 0.0


def test_a_paused_step_whose_request_gave_its_seat_away_is_dropped_and_rerun_exactly(
        tiny_model, tiny_model_path):
    # Given 3 seats, all taken by batch requests that every step computes
    prompts = {f"s{i}": BATCH[f"s{i}"] for i in range(3)}
    online = {"o0": ONLINE["o0"], "o3": ONLINE["o3"]}
    expected = solo_tokens(tiny_model, tiny_model_path, prompts, LONGER)
    expected |= solo_tokens(tiny_model, tiny_model_path, online)
    engine = make_engine(tiny_model, tiny_model_path, max_num_seqs=3,
                         max_num_batched_tokens=64, max_batch_prefill_tokens=32)
    run = Run(engine, 0)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, LONGER, batch=True)
    for name, prompt in online.items():
        # When a step pauses after its first layer and an interactive request arrives, whose
        # seat is a batch request of the paused step (preempted)
        run.pause_a_step()
        engine.add_request(name, prompt, GREEDY)
        dropped = engine.step_interrupt.num_dropped
        outs = run.step()
        # Then the interactive request still gets its first token next, and the paused step,
        # one of whose requests is no longer running, is dropped rather than resumed
        assert {o.request_id for o in outs if o.new_token_ids} == {name}
        while engine._paused is not None:
            run.step()
        assert engine.step_interrupt.num_dropped == dropped + 1
    run.finish()
    # And every request still produced exactly what it produces alone
    for name, outs_ in expected.items():
        assert run.outputs(name, 1) == outs_, name
    assert engine.scheduler.num_preemptions >= len(online)
    assert engine.stats().kv_cache_usage == 0.0


def test_a_paused_step_short_of_kv_blocks_for_the_arrival_is_dropped_exactly(
        tiny_model, tiny_model_path):
    # Given a KV cache that batch requests fill (31 blocks of 4 tokens)
    prompts = {f"s{i}": BATCH[f"s{i}"] for i in range(4)} | {"long": LONG[:60]}
    online = {"o0": [150 + j for j in range(30)]}
    expected = solo_tokens(tiny_model, tiny_model_path, {**prompts, **online})
    engine = make_engine(tiny_model, tiny_model_path, num_kv_blocks=32,
                         max_num_batched_tokens=32, max_batch_prefill_tokens=16)
    run = Run(engine, 0)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, GREEDY, batch=True)
    while engine.scheduler.kv_cache_manager.num_free_blocks > 4:
        run.step()
    # When a step pauses and an interactive request needing more blocks than are free arrives
    run.pause_a_step()
    engine.add_request("o0", online["o0"], GREEDY)
    # Then it takes them from batch requests of the paused step, gets its first token next,
    # and the paused step is dropped
    assert {o.request_id for o in run.step() if o.new_token_ids} == {"o0"}
    run.step()
    assert engine.step_interrupt.num_dropped == 1
    run.finish()
    # And every request produced exactly what it produces alone
    for name, outs in expected.items():
        assert run.outputs(name, 1) == outs, name


def test_an_abort_while_a_step_is_paused_drops_it_and_the_others_run_exactly(
        tiny_model, tiny_model_path):
    # Given batch requests and a step of theirs paused
    expected = solo_tokens(tiny_model, tiny_model_path, BATCH)
    engine = make_engine(tiny_model, tiny_model_path, max_num_batched_tokens=32,
                         max_batch_prefill_tokens=8)
    run = Run(engine, 1)
    for name, prompt in BATCH.items():
        engine.add_request(name, prompt, TWO if name == "two" else GREEDY, batch=True)
    run.step()
    run.pause_a_step()
    assert engine._paused is not None
    victim = min(r for r in engine._paused.request_ids if "#" not in r)
    # When one of its requests is cancelled
    engine.abort([victim])
    outs = run.step()
    # Then it is answered `cancelled`, the paused step is dropped, and the rest run as alone
    assert [o.finish_reason for o in outs if o.request_id == victim] == ["cancelled"]
    assert engine.step_interrupt.num_dropped == 1 and engine._paused is None
    run.finish()
    for name, outs_ in expected.items():
        if name != victim:
            assert run.outputs(name, len(outs_)) == outs_, name
    assert engine.stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("point", ["layer", "head"])
def test_a_paused_constrained_batch_request_resumes_where_its_grammar_stood(
        tiny_model, tiny_model_path, point):
    # Given batch requests whose output a regex constrains, and what each writes alone
    regex = StructuredOutputParams("regex", "[a-z]{4}( [a-z]{2,6}){16}")
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_output=regex)
    prompts = {f"s{i}": BATCH[f"s{i}"] for i in range(4)}
    plain = make_engine(tiny_model, tiny_model_path)
    alone = {name: plain.generate([prompt], params)[0] for name, prompt in prompts.items()}
    engine = make_engine(tiny_model, tiny_model_path)
    run = Run(engine, 1 if point == "layer" else pause_points(tiny_model)[-1])
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params, batch=True)
    # When their steps pause (after layer 1, or with their logits in and the grammars not yet
    # applied), again and again, each time for an interactive request
    for i in range(6):
        if not any(r.batch for r in engine.scheduler.requests.values()):
            break
        run.pause_a_step()
        engine.add_request(f"o{i}", ONLINE["o0"], GREEDY)
    run.finish()
    # Then each wrote exactly what it writes alone, its grammar never advanced by a paused step
    assert engine.step_interrupt.num_paused >= 3
    for name, out in alone.items():
        assert run.outputs(name, 1) == [out.new_token_ids], name


def test_only_steps_with_batch_work_pause_and_only_once_asked():
    # Given the interrupt of an engine
    interrupt = StepInterrupt()
    # Then a step of interactive work only never pauses, and a batch step pauses only once an
    # interactive request was queued, until the busy loop drains its inbox
    assert interrupt.pause_check(has_batch_work=False) is None
    check = interrupt.pause_check(has_batch_work=True)
    assert check is not None and not check(0)
    interrupt.request()
    assert check(1)
    interrupt.clear()
    assert not check(2)


def test_paused_steps_under_a_draft_model_give_every_request_its_solo_tokens(
        tiny_model, tiny_model_path):
    # Given batch and interactive prompts and each one's greedy tokens run alone
    expected = solo_tokens(tiny_model, tiny_model_path, {**BATCH, **ONLINE})
    # When the model drafts for itself (every draft accepted: the draft's KV must stay at each
    # request's tokens through pauses) and batch steps pause after layer 1 for each arrival
    engine = EngineCore(EngineConfig(
        model=str(tiny_model_path), dtype="float32", num_kv_blocks=256, block_size=4,
        speculative_method="draft", draft_model=str(tiny_model_path),
        max_num_batched_tokens=32, max_batch_prefill_tokens=8), loaded=tiny_model,
        draft=tiny_model)
    run = Run(engine, 1)
    for name, prompt in BATCH.items():
        engine.add_request(name, prompt, TWO if name == "two" else GREEDY, batch=True)
    for name, prompt in ONLINE.items():
        run.pause_a_step()
        engine.add_request(name, prompt, GREEDY)
        while engine._paused is not None:
            run.step()
    run.finish()
    # Then every request produced exactly what it produces alone, with drafts accepted
    for name, outs in expected.items():
        assert run.outputs(name, len(outs)) == outs, name
    assert engine.step_interrupt.num_paused == len(ONLINE)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_acceptance_rate == 1.0
    assert stats.kv_cache_usage == 0.0
