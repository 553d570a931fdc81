"""KVCacheManager: block tables of requests, and prefix caching over the block pool.

After vLLM v1's `v1/core/kv_cache_manager.py` (`get_computed_blocks`, `allocate_slots`
returning None when full, `free` in reverse order) and nano-vllm's `block_manager.py`. Pure
Python over ints and lists.

Prefix caching: block i of a request is identified by a chained hash,
`hash(block i-1's hash, the block's token ids)`, so equal hashes mean equal whole prefixes,
not just equal blocks. Hashes are computed incrementally into `request.block_hashes`, for full
blocks only. A block enters the cache once every token in it has been computed, and stays
findable after its request frees it, until the pool evicts it (least recently freed first).

NOTE: hashes are the first 128 bits of SHA-256 over (parent hash, token ids). Python's
`hash()` of a tuple is faster (0.1 us against 1 us for a 16-token block, measured here) but is
a 64-bit non-cryptographic hash: crafted prompts could collide with another tenant's prefix and
read its KV (vLLM moved to SHA-256 for the same reason). At one hash per block the cost is
noise next to the model. A request under a LoRA adapter roots its chain at the adapter's
`cache_salt` (a hash of its files) instead of NONE_HASH: the same tokens under another adapter, or
under the base model, have other KV, so none of their blocks may ever match.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from llmq.worker.engine.block_pool import BlockPool, KVCacheBlock
from llmq.worker.engine.prefix_landmarks import MAX_LANDMARKS, is_landmark, short_hash
from llmq.worker.engine.request import Request

NONE_HASH = 0  # the parent of a request's first block


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    data = parent_hash.to_bytes(16, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Set when every layer of the model attends only to its last `sliding_window` tokens
        # (Mistral): blocks wholly before the window are freed (`_free_out_of_window`).
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Counted once per (re)admission of a request: tokens looked up, tokens found.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # Hashes of the landmark blocks most recently offered to the cache or hit in it
        # (worker/engine/prefix_landmarks.py), least recent first, at most MAX_LANDMARKS, pruned
        # of evicted ones by `cached_landmarks`: what a worker tells its peers it holds.
        # NOTE: bounded, not every landmark the cache holds: the busy loop snapshots them four
        # times a second, and a cache of many blocks holds every prefix a pool ever served.
        self._landmarks: OrderedDict[int, None] = OrderedDict()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (cached free blocks are free)."""
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        Takes no reference: pass the blocks to `allocate_slots` before anything else allocates.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        # NOTE: never the whole sequence: the last token must be computed to get logits.
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` (from `get_computed_blocks`) are only for a request that holds no
        blocks; they are counted as computed. Returns the block ids appended to
        `request.block_ids` (cache hits first), or None, changing nothing, when there is no room.
        """
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks and self.sliding_window is not None:
            self._free_out_of_window(request, req_blocks)
        new_computed = list(new_computed_blocks)
        if new_computed and (req_blocks or request.num_computed_tokens):
            raise ValueError(f"{request_id}: cache hits are only for a request with no blocks")
        num_held = len(req_blocks) if req_blocks else 0
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - num_held - len(new_computed), 0)
        # NOTE: hits sitting in the free queue are taken out of it, so they count against room.
        num_evictable_hits = sum(1 for block in new_computed if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None

        # NOTE: touch the hits before allocating, or allocation could evict them.
        self.block_pool.touch(new_computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(new_computed)
            if self.enable_prefix_caching:
                self.num_prefix_queries += request.num_tokens
                self.num_prefix_hits += len(new_computed) * self.block_size
                for i, block in enumerate(new_computed):
                    if is_landmark(i) and block.block_hash is not None:
                        self._note_landmark(block.block_hash)
        added = new_computed + new_blocks
        req_blocks.extend(added)
        self._cache_full_blocks(request)
        block_ids = [block.block_id for block in added]
        request.block_ids.extend(block_ids)
        return block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; full computed ones stay cached until evicted."""
        request_id = request.request_id
        if request_id in self.req_to_blocks:
            self._cache_full_blocks(request)
            blocks = self.req_to_blocks.pop(request_id)
            del self.num_cached_blocks[request_id]
            # NOTE: reversed, so a sequence's tail, the part least likely to be shared, is
            # evicted before its head.
            null = self.block_pool.null_block
            self.block_pool.free_blocks([block for block in blocks[::-1] if block is not null])
        request.block_ids.clear()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks wholly past its first `num_tokens` tokens: those that held
        only draft tokens the verification rejected (worker/engine/spec_decode/speculator.py).
        They were never offered to the prefix cache: only computed tokens are."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        dropped = blocks[keep:]
        del blocks[keep:]
        del request.block_ids[keep:]
        self.block_pool.free_blocks(dropped[::-1])

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks (one more reference each) and its computed tokens.

        The parent must hold only full blocks, all computed: the child writes its own tokens
        into blocks of its own, so nothing the siblings share is ever written again.
        """
        blocks = self.req_to_blocks[parent.request_id]
        assert parent.num_computed_tokens == len(blocks) * self.block_size, parent
        null = self.block_pool.null_block
        self.block_pool.touch([block for block in blocks if block is not null])
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks[parent.request_id]
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def cached_landmarks(self) -> list[int]:
        """Short hashes of the landmark blocks the prefix cache holds now (cache affinity)."""
        cached = self.block_pool.cached_block_hash_to_block
        for evicted in [h for h in self._landmarks if h not in cached]:
            del self._landmarks[evicted]
        return [short_hash(h) for h in self._landmarks]

    def _note_landmark(self, block_hash: int) -> None:
        """A landmark block was cached or hit: the most recent one now; the least recent
        beyond MAX_LANDMARKS are forgotten (their blocks stay cached, only unpublished)."""
        self._landmarks[block_hash] = None
        self._landmarks.move_to_end(block_hash)
        if len(self._landmarks) > MAX_LANDMARKS:
            self._landmarks.popitem(last=False)

    def _free_out_of_window(self, request: Request, req_blocks: list[KVCacheBlock]) -> None:
        """Free the request's blocks that hold only keys no later query can see.

        The next query is at position `num_computed_tokens`, and sees keys from
        `num_computed_tokens - sliding_window + 1` on; every block wholly before that is
        freed and replaced by the null block in `req_blocks`, so positions keep their index.
        The runner's block table keeps the old ids: the attention masks those positions
        (attention.py `AttentionMetadata.windowed`), so whatever the block holds next never
        counts. Full blocks are offered to the prefix cache first, so a later request with
        the same prefix can still find them until they are evicted.
        """
        assert self.sliding_window is not None
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        num_out = max(first_needed, 0) // self.block_size
        null = self.block_pool.null_block
        stale = [block for block in req_blocks[:num_out] if block is not null]
        if not stale:
            return
        self._cache_full_blocks(request)
        req_blocks[:num_out] = [null] * num_out
        self.block_pool.free_blocks(stale)

    def _cache_full_blocks(self, request: Request) -> None:
        """Offer blocks that are full of computed tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks[request_id]
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request_id]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
            if is_landmark(i):
                self._note_landmark(request.block_hashes[i])
        self.num_cached_blocks[request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its tokens."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        lora = request.sampling_params.lora
        parent = hashes[-1] if hashes else NONE_HASH if lora is None else lora.cache_salt
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hash_block_tokens(parent, tokens[start:start + size])
            hashes.append(parent)
