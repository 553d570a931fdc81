"""Decode attention reading K/V blocks in place, against the same attention over gathered blocks.

The compiled kernel (cpu_kernels.py) walks each sequence's block table through the paged cache.
Gathering every sequence's blocks into a fresh cache, in table order, and running the same kernel
over that copy with trivial tables must give the very same floats: whatever the block tables,
lengths, block sizes, head groupings and batch mix. And both must agree with plain torch
attention over the gathered rows (attention.py's fallback when there is no compiler).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmq.worker.engine.model.attention import PagedAttention, k_blocks, v_blocks
from llmq.worker.engine.model.cpu_kernels import CpuKernels

KERNELS = CpuKernels.load()
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def gathered(kv_cache: torch.Tensor, tables: list[list[int]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A new cache holding exactly the tables' blocks, in table order, and the trivial block
    tables into it (block 0 stays a pad, as in the engine)."""
    order = [b for table in tables for b in table]
    copy = kv_cache.index_select(2, torch.tensor([0, *order]))  # [2, kvh, 1 + n, bs, hd]
    new_tables, start = [], 1
    for table in tables:
        new_tables.append(list(range(start, start + len(table))))
        start += len(table)
    return copy, padded(new_tables)


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [seqs, width] int64


def torch_attention(q: torch.Tensor, kv_cache: torch.Tensor, tables: list[list[int]],
                    seq_lens: list[int]) -> torch.Tensor:
    """Each sequence's rows gathered (attention.py's gather, K blocks un-transposed), then
    softmax(q k^T / sqrt(hd)) v in float64: the reference."""
    _, kv_heads, _, block_size, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    attention = PagedAttention(num_heads, kv_heads, head_dim)
    out = []
    for s, (table, n) in enumerate(zip(tables, seq_lens, strict=True)):
        kv = attention._gather(kv_cache, torch.tensor(table))[:, :, :n].double()
        k = kv[0].repeat_interleave(num_heads // kv_heads, 0)  # [heads, n, hd]
        v = kv[1].repeat_interleave(num_heads // kv_heads, 0)
        scores = (q[s].double()[:, None, :] * k).sum(-1) / head_dim ** 0.5  # [heads, n]
        out.append((scores.softmax(-1)[:, None, :] @ v)[:, 0])  # [heads, hd]
    return torch.stack(out).float()


def as_decodes(tables: list[list[int]], seq_lens: list[int], query_lens: list[int]
               ) -> tuple[list[list[int]], list[int]]:
    """Each sequence's last query_len tokens as decodes of their own: (tables, lengths)."""
    row_tables = [t for t, n in zip(tables, query_lens, strict=True) for _ in range(n)]
    row_lens = [s - n + 1 + j for s, n in zip(seq_lens, query_lens, strict=True)
                for j in range(n)]
    return row_tables, row_lens


@st.composite
def decode_batches(draw):
    """A random paged cache and a batch of decodes: lengths, block tables drawn without
    replacement from the whole cache, a block size and a head grouping."""
    block_size = draw(st.sampled_from([1, 3, 4, 16, 32]))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seq_lens = draw(st.lists(st.integers(1, 80), min_size=1, max_size=6))
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed) + draw(st.integers(0, 8))
    free = draw(st.permutations(list(range(1, num_blocks))))
    tables, start = [], 0
    for n in needed:
        tables.append(list(free[start:start + n]))
        start += n
    seed = draw(st.integers(0, 2**31 - 1))
    return block_size, kv_heads, group, head_dim, dtype, seq_lens, tables, num_blocks, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_batches())
def test_in_place_reads_equal_reads_of_the_gathered_blocks(batch):
    block_size, kv_heads, group, head_dim, dtype, seq_lens, tables, num_blocks, seed = batch
    g = torch.Generator().manual_seed(seed)
    # Given a cache of random K/V (every block, used or not, holds finite values) and queries
    kv_cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g)
    lens = torch.tensor(seq_lens)

    # When the kernel reads the blocks where they lie, and reads a gathered copy of them
    in_place = KERNELS.decode_attention(q, kv_cache, padded(tables), lens, head_dim ** -0.5,
                                        torch.empty_like(q))
    copy, copy_tables = gathered(kv_cache, tables)
    from_copy = KERNELS.decode_attention(q, copy, copy_tables, lens, head_dim ** -0.5,
                                         torch.empty_like(q))

    # Then the two are the same floats, and both are attention over the sequence's own rows
    assert torch.equal(in_place, from_copy)
    torch.testing.assert_close(in_place, torch_attention(q, kv_cache, tables, seq_lens),
                               rtol=2e-5, atol=2e-6)


def test_bfloat16_output_is_the_float32_output_rounded():
    # Given one decode over a bfloat16 cache
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 3, 9, 16, 64, generator=g).bfloat16()
    q = torch.randn(2, 9, 64, generator=g)
    tables, lens = torch.tensor([[3, 5, 1], [2, 4, 0]]), torch.tensor([40, 17])

    # When the kernel writes float32 and bfloat16 outputs
    out32 = KERNELS.decode_attention(q, kv_cache, tables, lens, 0.125, torch.empty(2, 9, 64))
    out16 = KERNELS.decode_attention(q, kv_cache, tables, lens, 0.125,
                                     torch.empty(2, 9, 64, dtype=torch.bfloat16))

    # Then the bfloat16 one is the float32 one rounded to nearest even, as torch rounds
    assert torch.equal(out16, out32.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_last_blocks_unused_slots_never_reach_the_output(dtype):
    # Given sequences whose last block is part full, its unused slots holding NaN and inf (a
    # freed block's leftovers can be anything), and the same cache with those slots zeroed
    g = torch.Generator().manual_seed(1)
    block_size, lens = 16, torch.tensor([37, 16, 5, 50])
    tables = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 0, 0, 0], [6, 7, 8, 9]])
    clean = torch.randn(2, 2, 10, block_size, 64, generator=g)
    dirty = clean.clone()
    for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
        last, used = table[(n - 1) // block_size], (n - 1) % block_size + 1
        for cache, fill in ((clean, 0.0), (dirty, float("nan"))):
            k_blocks(cache)[:, last, :, used:] = fill  # K blocks are stored transposed
            v_blocks(cache)[:, last, used:] = fill
        k_blocks(dirty)[:, last, ::2, used:] = float("inf")
    q = torch.randn(4, 6, 64, generator=g)

    # When the kernel attends over both
    out_dirty = KERNELS.decode_attention(q, dirty.to(dtype), tables, lens, 0.125,
                                         torch.empty_like(q))
    out_clean = KERNELS.decode_attention(q, clean.to(dtype), tables, lens, 0.125,
                                         torch.empty_like(q))

    # Then the outputs are the same finite floats: only the sequence's own keys count
    assert torch.isfinite(out_dirty).all()
    assert torch.equal(out_dirty, out_clean)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_batches(), st.data())
def test_a_prompts_rows_get_what_each_gets_alone_as_a_decode(batch, data):
    block_size, kv_heads, group, head_dim, dtype, seq_lens, tables, num_blocks, seed = batch
    # Given prompts (or prompt chunks after cached context) whose K/V are in the cache: each
    # sequence's last query_len tokens are this step's queries
    query_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g)
    starts = torch.tensor([0, *np.cumsum(query_lens)])

    # When the prompt kernel attends every row at once
    out = KERNELS.prompt_attention(q, kv_cache, padded(tables), starts, torch.tensor(seq_lens),
                                   head_dim ** -0.5, torch.empty_like(q))

    # Then each row is the very floats of that token alone, as a decode at its position (to
    # rounding where one query head has a kv head alone and head_dim has a scalar tail)
    row_tables, row_lens = as_decodes(tables, seq_lens, query_lens)
    alone = KERNELS.decode_attention(q, kv_cache, padded(row_tables), torch.tensor(row_lens),
                                     head_dim ** -0.5, torch.empty_like(q))
    if group > 1 or head_dim % 16 == 0:
        assert torch.equal(out, alone)
    else:
        torch.testing.assert_close(out, alone, rtol=1e-6, atol=1e-6)
    # And attention over each row's own keys
    torch.testing.assert_close(out, torch_attention(q, kv_cache, row_tables, row_lens),
                               rtol=2e-5, atol=2e-6)
