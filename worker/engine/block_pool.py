"""BlockPool: the fixed-size KV-cache blocks, their ref counts, and the free queue.

After vLLM v1's `v1/core/block_pool.py` and `kv_cache_utils.py` (`KVCacheBlock`,
`FreeKVCacheBlockQueue`), sized like nano-vllm's `block_manager.py`. Pure Python over ints.

A block is in one of three states:
- in use: `ref_cnt > 0`, held by one or more block tables (more than one when a prefix is shared);
- cached free: `ref_cnt == 0` with a `block_hash`: in the free queue, and still findable in
  `cached_block_hash_to_block`, so a later request with the same prefix can take it back;
- free: `ref_cnt == 0`, no hash, in the free queue.

The free queue is a doubly linked list ordered by when blocks were freed: allocation pops the
head, so cached free blocks are evicted least recently used first, and a cached block that is
hit again is unlinked from the middle in O(1).

Block 0 is the null block: it is never handed out, so the model runner may pad block tables
with 0 (and write padding tokens there) without touching any request's KV. The pool therefore
has `num_blocks - 1` usable blocks.
"""

from __future__ import annotations

NULL_BLOCK_ID = 0


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        # Links of the free queue; None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Free blocks, least recently freed first: a doubly linked list between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and debugging (O(n))."""
        blocks = []
        block = self.head.next_free
        while block is not None and block is not self.tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # NOTE: one block per hash. When two requests compute the same block at the same time,
        # the second copy simply stays uncached and is freed like any other block.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, counting cached free blocks (they are evicted on demand)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by some request, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Make a full, computed block findable by its hash (no-op when the hash is taken)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting cached ones; ref_cnt = 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, "
                             f"{self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue in the order given, so
        the first given are the first evicted."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
