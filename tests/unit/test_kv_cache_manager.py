"""KVCacheManager: block tables, prefix caching, and no leaks under any sequence of operations."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmq.worker.engine.kv_cache_manager import KVCacheManager, cdiv
from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), arrival_time=0.0)


def compute(request: Request, num_tokens: int) -> None:
    """What a model step does to the request's bookkeeping."""
    request.num_computed_tokens += num_tokens
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token_ids([request.num_tokens % 7])


def admit(manager: KVCacheManager, request: Request) -> list[int] | None:
    blocks, num_hit = manager.get_computed_blocks(request)
    block_ids = manager.allocate_slots(request, request.num_tokens - num_hit, blocks)
    if block_ids is not None:
        request.num_computed_tokens = num_hit
        compute(request, request.num_tokens - num_hit)
    return block_ids


def test_shared_prefix_hits_full_blocks_only():
    # Given a request of 10 tokens computed and finished
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    admit(manager, first)
    manager.free(first)
    # When a second request shares its first 9 tokens
    second = make_request("b", list(range(9)) + [99, 98])
    blocks, num_hit = manager.get_computed_blocks(second)
    # Then the two full blocks (8 tokens) are hits, the partial third is not
    assert num_hit == 8
    assert [b.block_id for b in blocks] == first_block_ids_of(manager, list(range(10)))[:2]


def first_block_ids_of(manager: KVCacheManager, tokens: list[int]) -> list[int]:
    probe = make_request("probe", tokens + [0])
    blocks, _ = manager.get_computed_blocks(probe)
    return [b.block_id for b in blocks]


def test_never_the_whole_prompt_is_a_hit():
    # Given a finished request of exactly two full blocks
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    # When the same prompt comes again
    blocks, num_hit = manager.get_computed_blocks(make_request("b", list(range(8))))
    # Then one block is left to compute, so the model still produces logits
    assert num_hit == 4 and len(blocks) == 1


def test_same_tokens_after_a_different_prefix_are_no_hit():
    # Given a finished request [0..7]
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    # When a request has the same second block after a different first block
    _, num_hit = manager.get_computed_blocks(make_request("b", [9, 9, 9, 9, 4, 5, 6, 7, 1]))
    # Then nothing is a hit: hashes chain over the whole prefix
    assert num_hit == 0


def test_no_room_returns_none_and_changes_nothing():
    # Given 3 usable blocks, 2 of them held
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = make_request("a", list(range(8)))
    assert admit(manager, holder) is not None
    # When a request needs 2 blocks
    other = make_request("b", list(range(100, 108)))
    # Then it gets None and holds nothing, and the free count is unchanged
    assert manager.allocate_slots(other, 8) is None
    assert other.block_ids == [] and manager.num_free_blocks == 1


def test_free_evicts_a_sequence_tail_first():
    # Given a finished request of 3 full blocks, all cached
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(12)))
    admit(manager, first)
    manager.free(first)
    # When one new block is needed
    manager.allocate_slots(make_request("b", [50, 51]), 2)
    # Then the last block went: the first two are still a prefix hit
    _, num_hit = manager.get_computed_blocks(make_request("c", list(range(12)) + [1]))
    assert num_hit == 8


def test_usage_and_hit_counters():
    # Given 4 usable blocks and a finished request of 8 tokens
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    assert manager.usage == 0.0
    # When a request sharing its first block runs
    second = make_request("b", list(range(4)) + [70, 71])
    admit(manager, second)
    # Then half the blocks are in use and 4 of the 14 queried tokens were hits
    assert manager.usage == 0.5
    assert (manager.num_prefix_hits, manager.num_prefix_queries) == (4, 8 + 6)


def test_without_prefix_caching_nothing_is_shared():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    admit(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 40, 41]]


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / prefill / decode / preempt / finish / abort over a small cache.

    A shadow KV (`content`) records which token sits in each slot, so a prefix hit that hands
    out a block with other tokens, or a write into a block someone else holds, is caught.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.content: dict[int, list[int | None]] = {}
        self.num_added = 0

    def _write(self, request: Request, num_tokens: int) -> None:
        start = request.num_computed_tokens
        for pos in range(start, start + num_tokens):
            block_id = request.block_ids[pos // BLOCK_SIZE]
            block = self.manager.block_pool.blocks[block_id]
            assert block.ref_cnt == 1, f"writing into shared {block}"
            slots = self.content.setdefault(block_id, [None] * BLOCK_SIZE)
            slots[pos % BLOCK_SIZE] = request.all_token_ids[pos]
        compute(request, num_tokens)

    def _held(self) -> tuple[int, list[tuple[int, int]]]:
        return (self.manager.num_free_blocks,
                [(b.block_id, b.ref_cnt) for b in self.manager.block_pool.blocks])

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=14))
    def add(self, prefix, tail):
        tokens = prefix + tail or [0]
        self.num_added += 1
        self.waiting.append(make_request(f"r{self.num_added}", tokens))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        blocks, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit < request.num_tokens
        for i, block in enumerate(blocks):
            expected = request.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            assert self.content[block.block_id] == expected, "prefix hit with other tokens"
        num_new = data.draw(st.integers(1, request.num_tokens - num_hit))
        before = self._held()
        block_ids = self.manager.allocate_slots(request, num_new, blocks)
        if block_ids is None:
            assert self._held() == before and request.block_ids == []
            return
        assert request.block_ids == block_ids
        request.num_computed_tokens = num_hit
        self._write(request, num_new)
        self.waiting.remove(request)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running(self, data):
        request = data.draw(st.sampled_from(self.running))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        before, table = self._held(), list(request.block_ids)
        block_ids = self.manager.allocate_slots(request, num_new)
        if block_ids is None:
            assert self._held() == before and request.block_ids == table
            return
        self._write(request, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = data.draw(st.sampled_from(self.running))
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.running.remove(request)
        self.waiting.insert(0, request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_running(self, data):
        request = data.draw(st.sampled_from(self.running))
        self.manager.free(request)
        self.running.remove(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        request = data.draw(st.sampled_from(self.waiting))
        self.manager.free(request)
        self.waiting.remove(request)

    @invariant()
    def ref_counts_equal_block_table_holders(self):
        holders = Counter(bid for r in self.running for bid in r.block_ids)
        for block in self.manager.block_pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], block
        assert 0 not in holders
        for request in self.running:
            assert len(set(request.block_ids)) == len(request.block_ids)
            assert len(request.block_ids) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
        for request in self.waiting:
            assert request.block_ids == []

    @invariant()
    def free_queue_holds_exactly_the_unheld_blocks(self):
        pool = self.manager.block_pool
        queued = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(queued) == len(set(queued)) == pool.get_num_free_blocks()
        assert set(queued) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash

    def teardown(self):
        # When every request is done, every block is free and usable again.
        for request in self.running:
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.manager.num_usable_blocks
        assert self.manager.usage == 0.0
        everything = make_request("all", [5] * self.manager.num_usable_blocks * BLOCK_SIZE)
        assert self.manager.allocate_slots(everything, everything.num_tokens) is not None


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)
test_kv_cache_manager_never_leaks = KVCacheMachine.TestCase
