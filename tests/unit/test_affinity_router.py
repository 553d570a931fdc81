"""Cache affinity without Redis: what a cache publishes, and where a prompt is sent.

The engine's KV cache names its landmark blocks (depths 1, 2, 4, ... blocks); a prompt's
landmarks computed outside the engine must be the same hashes, or no request would ever find
its prefix. The router sends a prompt to the peer holding its prefix deepest, and only when
that beats this worker's own cache by a hop's worth of tokens.
"""

from __future__ import annotations

from llmq.broker.affinity_handover import AffinityHandover, Ticket
from llmq.broker.keys import Keys
from llmq.worker.affinity_keeper import (
    LANES_MARK,
    choose_tickets,
    fit_rooms,
    pack_landmarks,
    read_summary,
    unpack_landmarks,
)
from llmq.worker.affinity_router import AffinityRouter, PeerCache
from llmq.worker.engine.kv_cache_manager import KVCacheManager
from llmq.worker.engine.prefix_landmarks import (
    MAX_LANDMARKS,
    landmark_depths,
    prompt_landmarks,
)
from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams

BLOCK = 16
PREFIX = [11 + i % 300 for i in range(512)]  # 32 blocks


def prompt(suffix: int) -> list[int]:
    return [*PREFIX, 1000 + suffix, 1001, 1002]


def cached_landmarks(*prompts: list[int]) -> list[int]:
    """What an engine's cache publishes after computing these prompts."""
    manager = KVCacheManager(num_blocks=256, block_size=BLOCK)
    for i, tokens in enumerate(prompts):
        request = Request(f"r{i}", tokens, SamplingParams(), arrival_time=0.0)
        blocks, hit = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - hit, blocks)
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
    return manager.cached_landmarks()


def test_the_cache_publishes_the_landmarks_a_prompt_computes_outside_the_engine():
    # Given an engine that computed one prompt with the prefix
    published = set(cached_landmarks(prompt(0)))
    # When another prompt with the prefix is hashed outside the engine
    marks = prompt_landmarks(prompt(1), BLOCK)
    # Then its landmarks 1..32 blocks deep are all in the cache's summary
    assert [depth for depth, _ in marks] == landmark_depths(32) == [1, 2, 4, 8, 16, 32]
    assert {h for _, h in marks} <= published
    # And a summary survives its wire form
    assert unpack_landmarks(pack_landmarks(sorted(published))) == published


def test_evicted_and_reset_prefixes_leave_the_summary():
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK)
    request = Request("a", prompt(0), SamplingParams(), arrival_time=0.0)
    manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.free(request)
    assert manager.cached_landmarks()
    # When the cache is reset, nothing is published any more
    assert manager.reset_prefix_cache()
    assert manager.cached_landmarks() == []


def run_once(manager: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    request = Request(request_id, tokens, SamplingParams(), arrival_time=0.0)
    blocks, hit = manager.get_computed_blocks(request)
    manager.allocate_slots(request, request.num_tokens - hit, blocks)
    request.num_computed_tokens = request.num_tokens
    manager.free(request)


def test_a_cache_that_holds_a_long_history_publishes_only_its_most_recent_prefixes():
    # Given a cache big enough to keep every prefix a long-lived pool has served (a small
    # model's): more distinct prompts than a summary carries, one block each
    manager = KVCacheManager(num_blocks=2 * MAX_LANDMARKS + 2_000, block_size=BLOCK)
    history = [[7, i // 1000, i % 1000, *range(BLOCK)] for i in range(MAX_LANDMARKS + 500)]
    for i, tokens in enumerate(history):
        run_once(manager, f"r{i}", tokens)
    assert len(manager.block_pool.cached_block_hash_to_block) >= len(history)
    # Then the snapshot the busy loop takes four times a second stays at the bound, whatever
    # the history: the most recent prefixes, not the oldest
    published = set(manager.cached_landmarks())
    assert len(published) == MAX_LANDMARKS
    assert prompt_landmarks(history[-1], BLOCK)[0][1] in published
    assert prompt_landmarks(history[0], BLOCK)[0][1] not in published
    # And an old prefix asked again (still cached: a hit) is published again
    again = [*history[0][:BLOCK], 99]
    run_once(manager, "again", again)
    assert manager.num_prefix_hits == BLOCK
    published = manager.cached_landmarks()
    assert prompt_landmarks(history[0], BLOCK)[0][1] in published
    assert len(published) == MAX_LANDMARKS


def test_a_prompt_goes_to_the_peer_holding_its_prefix_deepest():
    # Given peer b holds the whole 512-token prefix, c only a different one
    router = AffinityRouter(BLOCK, min_tokens=256)
    other = cached_landmarks([5 + i % 7 for i in range(600)])
    router.update([], [PeerCache("c", frozenset(other)),
                       PeerCache("b", frozenset(cached_landmarks(prompt(0))))])
    # Then a prompt with the prefix goes to b, one without it stays here
    route = router.target(prompt(1))
    assert route is not None and route.worker_id == "b"
    # And the route names the prefix: its 32-block landmark, which b's summary holds
    assert route.prefix == prompt_landmarks(prompt(1), BLOCK)[-1][1]
    assert router.target([9] * 600) is None


def test_a_prompt_stays_when_this_worker_holds_as_much_or_the_match_is_short():
    router = AffinityRouter(BLOCK, min_tokens=256)
    holder = PeerCache("b", frozenset(cached_landmarks(prompt(0))))
    # Given this worker holds the prefix too: a tie keeps it here
    router.update(cached_landmarks(prompt(0)), [holder])
    assert router.target(prompt(1)) is None
    # Given this worker is computing it right now (admitted, not cached yet): the same
    router.update([], [holder])
    router.claim(prompt(2))
    assert router.target(prompt(3)) is None
    # Given only 128 shared tokens: below min_tokens, not worth a hop
    short = AffinityRouter(BLOCK, min_tokens=256)
    short.update([], [PeerCache("b", frozenset(cached_landmarks(PREFIX[:128] + [1, 2])))])
    assert short.target(PREFIX[:128] + [7] * 300) is None


def test_a_peer_with_a_full_backlog_gets_nothing_more():
    router = AffinityRouter(BLOCK, min_tokens=256, max_backlog=4)
    marks = frozenset(cached_landmarks(prompt(0)))
    router.update([], [PeerCache("b", marks, backlog=4)])
    assert router.target(prompt(1)) is None
    # And between two holders the one with the shorter backlog is chosen
    router.update([], [PeerCache("b", marks, backlog=3), PeerCache("c", marks, backlog=1)])
    route = router.target(prompt(1))
    assert route is not None and route.worker_id == "c"


def test_an_idle_worker_steals_one_prefix_whole():
    ripe = [Ticket(f"{i}-0", f"e{i}", prefix, 5000) for i, prefix in enumerate("abacbbc")]
    # Given it holds none of them: the prefix most tickets wait for, oldest first
    assert [t.entry_id for t in choose_tickets(ripe, 2, lambda p: False)] == ["e1", "e4"]
    # Given it holds c already: c's, which hit its cache
    assert [t.entry_id for t in choose_tickets(ripe, 8, lambda p: p == "c")] == ["e3", "e6"]
    assert choose_tickets([], 4, lambda p: True) == []


def test_lane_entries_go_only_to_peers_that_take_lane_tickets():
    router = AffinityRouter(BLOCK, min_tokens=64)
    marks = sorted(cached_landmarks(prompt(0)))
    # Given b's summary from this release (with the mark) and c's from the one before
    b = read_summary("b", pack_landmarks([*marks, LANES_MARK]), 0)
    c = read_summary("c", pack_landmarks(marks), 0)
    assert b.takes_lanes and not c.takes_lanes
    assert b.landmarks == c.landmarks == frozenset(marks)
    # Then a queue-stream entry may go to either, a lane entry only to b
    router.update([], [c])
    assert router.target(prompt(1)) is not None
    assert router.target(prompt(1), on_lane=True) is None
    router.update([], [c, b])
    route = router.target(prompt(1), on_lane=True)
    assert route is not None and route.worker_id == "b"


def test_batch_lane_tickets_are_taken_only_into_batch_room():
    lanes = AffinityHandover(Keys(), "default").lane
    tickets = [Ticket(f"{i}-0", f"e{i}", "p", 0, lane)
               for i, lane in enumerate(["batch", "", "batch:acme", "interactive:acme", ""])]
    # Given room for three, of which none for batch work: the interactive ones, in order
    assert [t.entry_id for t in fit_rooms(tickets, lanes, 3, 0)] == ["e1", "e3", "e4"]
    # Given room for one batch entry: the first batch ticket too
    assert [t.entry_id for t in fit_rooms(tickets, lanes, 3, 1)] == ["e0", "e1", "e3"]
    assert [t.entry_id for t in fit_rooms(tickets, lanes, 8, 8)] == [f"e{i}" for i in range(5)]
