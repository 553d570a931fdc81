"""Parallel sampling (n > 1) in the scheduler: the prompt's full blocks are computed once and
shared by reference, every completion ends with its own indexed output, aborts reach them all.

Driven by scheduler_harness's fake runner, whose "KV cache" is read back through the block tables:
a shared block overwritten by one child would change its siblings' tokens."""

from __future__ import annotations

from collections import defaultdict

import pytest

from llmq.protocol.errors import RequestRejected
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.request import Request
from tests.unit.scheduler_harness import VOCAB, Engine, run_alone


def per_child(request_id: str, num_outputs: int, context: list[int]) -> int:
    """Tokens that depend on which child reads the context, as seeds would make them."""
    return hash((request_id.rsplit("#", 1)[-1], tuple(context))) % (VOCAB - 1)


def solo_tokens(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """What completion `index` draws when it runs alone as a plain request."""
    def as_child(request_id, num_outputs, context):
        return per_child(f"x#{index}", num_outputs, context)
    return run_alone(prompt, next_token=as_child, max_tokens=max_tokens)[1]


class ParallelEngine(Engine):
    """Collects outputs per (request id, index): n completions share one request id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices: dict[tuple[str, int], list[EngineCoreOutput]] = defaultdict(list)

    def _collect(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            key = (output.request_id, output.index)
            assert not (self.choices[key] and self.choices[key][-1].finished), "after finish"
            self.choices[key].append(output)

    def choice_tokens(self, request_id: str, index: int) -> list[int]:
        return [t for o in self.choices[(request_id, index)] for t in o.new_token_ids]

    def finals(self, request_id: str) -> list[EngineCoreOutput]:
        return [outs[-1] for (rid, _), outs in sorted(self.choices.items()) if rid == request_id
                and outs[-1].finished]

    def blocks_in_use(self) -> int:
        kv = self.scheduler.kv_cache_manager
        return kv.num_usable_blocks - kv.num_free_blocks


def test_n_completions_share_the_prompt_blocks_computed_once():
    # Given a 22-token prompt (5 full blocks of 4 before its last token) asked for n=4
    engine = ParallelEngine(num_kv_blocks=64, next_token=per_child,
                            enable_prefix_caching=False)
    prompt = list(range(100, 122))
    request = engine.add(prompt, request_id="r", max_tokens=6, n=4)
    # When the parent's prefill step runs
    engine.step()
    # Then it computed the 20 shared tokens once, and nothing was sampled
    assert engine.steps[0].num_scheduled_tokens == {"r": 20}
    assert not engine.step_outputs[0]
    # When the four children take over
    engine.step()
    # Then each computed only the prompt's tail, and they share the five prompt blocks
    assert engine.steps[1].num_scheduled_tokens == {f"r#{i}": 2 for i in range(4)}
    shared = engine.scheduler.requests["r#0"].block_ids[:5]
    assert all(engine.scheduler.requests[f"r#{i}"].block_ids[:5] == shared for i in range(4))
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[b].ref_cnt for b in shared] == [4] * 5
    assert engine.blocks_in_use() == 5 + 4  # the shared prompt + one tail block per child
    # When they run to the end
    engine.run()
    # Then there are four completions, indexed 0..3, each as long as asked, and all blocks free
    finals = engine.finals("r")
    assert [o.index for o in finals] == [0, 1, 2, 3]
    assert all(o.finish_reason == "length" and o.usage.completion_tokens == 6 for o in finals)
    assert all(o.usage.prompt_tokens == 22 for o in finals)
    assert engine.all_blocks_free() and not engine.scheduler.has_unfinished_requests()
    # And each equals a plain request that reads the same (unshared) prompt
    for i in range(4):
        assert engine.choice_tokens("r", i) == solo_tokens(prompt, i, 6)
    assert request.fork_at == 20


def test_a_prompt_shorter_than_a_block_runs_n_plain_requests():
    engine = ParallelEngine(next_token=per_child)
    engine.add([1, 2, 3], request_id="r", max_tokens=3, n=3)
    engine.run()
    assert [o.index for o in engine.finals("r")] == [0, 1, 2]
    assert len({tuple(engine.choice_tokens("r", i)) for i in range(3)}) == 3


def test_a_parent_counts_as_n_running_sequences():
    # Given four seats, a parent asking for four completions, and one more request
    engine = ParallelEngine(max_num_seqs=4)
    engine.add(list(range(10)), request_id="r", max_tokens=3, n=4)
    engine.add([5, 6, 7], request_id="o", max_tokens=3)
    # When everything runs
    engine.run()
    # Then the other request waited while the parent and then its children held all four seats
    for step in engine.steps:
        if any(rid.startswith("r") for rid in step.num_scheduled_tokens):
            assert "o" not in step.num_scheduled_tokens
    assert engine.finals("o")[0].finish_reason == "length"
    assert len(engine.finals("r")) == 4


def test_abort_before_the_fork_ends_all_n_completions():
    engine = ParallelEngine(max_num_batched_tokens=8)
    engine.add(list(range(40)), request_id="r", max_tokens=5, n=3)
    engine.step()  # the parent is prefilling in chunks of 8
    engine.scheduler.finish_requests("r")
    outputs = engine.scheduler.take_finished_outputs()
    assert sorted((o.index, o.finish_reason) for o in outputs) == [
        (0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert engine.all_blocks_free() and not engine.scheduler.has_unfinished_requests()


def test_abort_after_the_fork_reaches_every_child_still_running():
    engine = ParallelEngine()
    engine.add(list(range(10)), request_id="r", max_tokens=50, n=3)
    for _ in range(4):
        engine.step()
    engine.scheduler.finish_requests(["r"])
    engine._collect(engine.scheduler.take_finished_outputs())
    assert [(o.index, o.finish_reason) for o in engine.finals("r")] == [
        (0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert engine.all_blocks_free()
    # And the id is free again for a new request
    engine.add([1, 2], request_id="r", max_tokens=1)


def test_children_preempted_for_room_still_give_their_solo_outputs():
    # Given n=4 on a cache too small to hold four children to the end
    engine = ParallelEngine(num_kv_blocks=14, next_token=per_child, max_num_preemptions=100,
                            enable_prefix_caching=False)
    prompt = list(range(200, 213))
    engine.add(prompt, request_id="r", max_tokens=12, n=4)
    engine.run()
    # Then preemption happened and changed nothing
    assert engine.scheduler.num_preemptions > 0
    for i in range(4):
        assert engine.choice_tokens("r", i) == solo_tokens(prompt, i, 12)
    assert engine.all_blocks_free()


def test_n_beyond_max_num_seqs_or_a_duplicate_id_is_refused():
    engine = ParallelEngine(max_num_seqs=4)
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        engine.add([1, 2, 3], max_tokens=2, n=5)
    engine.add(list(range(10)), request_id="r", max_tokens=20, n=2)
    engine.step()
    engine.step()  # forked: only r#0 and r#1 are in the engine now
    with pytest.raises(RequestRejected, match="already"):
        engine.scheduler.add_request(Request("r", [1, 2], engine.scheduler.requests[
            "r#0"].sampling_params))


def test_a_parent_whose_prefix_is_all_cached_forks_without_computing_anything():
    # Given a prompt already served once, its full blocks in the prefix cache
    engine = ParallelEngine(next_token=per_child)
    prompt = list(range(300, 318))  # 18 tokens: 4 full blocks of 4 before the last token
    engine.add(prompt, request_id="first", max_tokens=2)
    engine.run()
    # When it is asked for again with n=2
    engine.add(prompt, request_id="again", max_tokens=3, n=2)
    engine.run()
    # Then the parent never ran: the children started from the cached blocks
    assert all("again" not in s.num_scheduled_tokens for s in engine.steps)
    finals = engine.finals("again")
    assert [(o.index, o.usage.cached_prompt_tokens) for o in finals] == [(0, 16), (1, 16)]
    for i in range(2):
        assert engine.choice_tokens("again", i) == solo_tokens(prompt, i, 3)
    assert engine.all_blocks_free()
