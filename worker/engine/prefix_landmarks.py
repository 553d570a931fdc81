"""Prefix landmarks: the few block hashes that name a cached prefix, for cache affinity.

A prompt's KV blocks are named by a hash chain (worker/engine/kv_cache_manager.py): block i's
hash covers every token up to the end of block i, so one hash names a whole prefix. A worker
tells its peers which prefixes its cache holds by publishing the hashes of its cached blocks at
the *landmark* indices 0, 1, 3, 7, 15, ... (blocks 1, 2, 4, 8, 16, ... deep), not every block:
a prefix of n blocks costs log2(n) hashes, and a peer's match depth is known to within a factor
of two, which is all a routing decision needs (worker/affinity_router.py).

Published hashes are the chain hash's low 64 bits: a collision (2^-64 per pair, or a crafted
prompt) only sends a request to a worker that then computes its prefix; the engine itself keys
its cache by the whole 128 bits.

Pure Python over ints: shared by the engine (what it caches) and the worker (what a prompt asks).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_LANDMARKS", "is_landmark", "landmark_depths", "prompt_landmarks", "short_hash"]

_MASK64 = (1 << 64) - 1
# The most landmarks a worker keeps track of and publishes (8 bytes each: a 32 KiB summary): the
# most recently cached or hit ones. A cache holds about log2(depth) of them per distinct prefix,
# and a cache of many blocks (a small model's, or a large KV budget) keeps the prefixes of every
# request a long-lived pool has served: an unbounded summary cost the busy loop time in
# proportion to the pool's history (bench/results/pool-rounds-2026-12-02.txt).
MAX_LANDMARKS = 4096


def is_landmark(block_index: int) -> bool:
    """Whether block `block_index` (0-based) is a landmark: its depth is a power of two."""
    depth = block_index + 1
    return depth & (depth - 1) == 0


def short_hash(block_hash: int) -> int:
    """The 64 bits of a block hash that are published."""
    return block_hash & _MASK64


def landmark_depths(num_blocks: int) -> list[int]:
    """Depths in blocks (1, 2, 4, ...) of the landmarks of a prefix `num_blocks` long."""
    depths, depth = [], 1
    while depth <= num_blocks:
        depths.append(depth)
        depth *= 2
    return depths


def prompt_landmarks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(depth in blocks, short hash) of each landmark of the prompt's full blocks, shallowest
    first: the hashes its prefix would have in an engine's cache."""
    # NOTE: imported here: the KV cache manager imports `is_landmark` from this module.
    from llmq.worker.engine.kv_cache_manager import NONE_HASH, hash_block_tokens

    out: list[tuple[int, int]] = []
    parent = NONE_HASH
    num_blocks = len(token_ids) // block_size
    for index in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[index * block_size:(index + 1) * block_size])
        if is_landmark(index):
            out.append((index + 1, short_hash(parent)))
    return out
