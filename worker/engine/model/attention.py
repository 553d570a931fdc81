"""Paged attention over a block KV cache, plus the contiguous-cache path kept as its oracle.

References: vLLM v1 (`AttentionMetadata`, slot mapping, block tables, decodes ordered before
prefills), nano-vllm (`attention.py`, `store_kvcache`), gpt-fast (a preallocated cache and
plain `scaled_dot_product_attention`).

Cache layout, one tensor per layer: `[2, num_kv_heads, num_blocks, block_size * head_dim]`
(allocated as `[2, num_kv_heads, num_blocks, block_size, head_dim]`). A V block holds its
tokens' rows, `[block_size, head_dim]`; a K block holds them transposed, `[head_dim,
block_size]` (`k_blocks` / `v_blocks` give the views). The transposed K lets the decode kernel
score 16 keys with 16-wide multiply-adds instead of one horizontal sum per key (vLLM's CPU
cache transposes K blocks for the same reason). Heads come before blocks so that one
`index_select` along dim 2 fetches a batch's blocks of every head at once.

Every per-step tensor (positions, slot mapping, gather indices, masks) is built once by
`AttentionMetadata.build` and reused by all layers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


@dataclass
class PrefillSeq:
    """One sequence of the step that is not a single-token decode."""

    token_start: int  # first row of its tokens in the flat batch
    query_len: int
    seq_len: int  # context after this step: cached + new
    block_ids: torch.Tensor  # [num_blocks_needed] its blocks, only when it has cached context
    mask: torch.Tensor | None  # [query_len, seq_len] True = may attend; None: plain causal


@dataclass
class AttentionMetadata:
    """Everything the attention of one step needs, for all layers.

    Sequences are ordered decodes (query_len == 1) first, then prefills / prefill chunks.
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] first row of each sequence, then num_tokens
    seq_lens_tensor: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] padded with block 0
    num_decodes: int  # the leading sequences with query_len == 1
    max_decode_seq_len: int
    decode_block_ids: torch.Tensor  # [num_decodes * decode_num_blocks] blocks to gather, row-major
    decode_num_blocks: int  # blocks per decode sequence in the gather (the longest one's)
    # [num_decodes, decode_num_blocks * block_size]: True past the sequence's seq_len
    decode_pad_mask: torch.Tensor
    prefills: list[PrefillSeq]
    _decode_biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict)
    _token_queries: tuple[torch.Tensor, torch.Tensor] | None = None

    def windowed(self, window: int) -> AttentionMetadata:
        """This step's metadata for a sliding-window layer: a query at position p sees keys
        p - window + 1 .. p (transformers' `sliding_window_overlay`). Built on the first
        such layer's call, then shared. Keys before the window stay in the gather, masked:
        their blocks may already be freed and reused (kv_cache_manager.py), so they must
        never count."""
        if window not in self._windowed:
            s_lens = self.seq_lens_tensor[:self.num_decodes]  # [num_decodes]
            ctx = torch.arange(self.decode_pad_mask.shape[1])[None, :]  # [1, ctx]
            pad = self.decode_pad_mask | (ctx <= (s_lens - 1 - window)[:, None])
            prefills = []
            for seq in self.prefills:
                ctx_len = seq.seq_len - seq.query_len
                keys = torch.arange(seq.seq_len)[None, :]  # [1, seq_len]
                query_pos = torch.arange(ctx_len, seq.seq_len)[:, None]  # [q_len, 1]
                mask = (keys <= query_pos) & (keys > query_pos - window)  # [q_len, seq_len]
                prefills.append(PrefillSeq(seq.token_start, seq.query_len, seq.seq_len,
                                           seq.block_ids, mask))
            self._windowed[window] = dataclasses.replace(
                self, decode_pad_mask=pad, prefills=prefills, _decode_biases={},
                _windowed={})
        return self._windowed[window]

    def decode_bias(self, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_kv_heads * num_decodes, 1, ctx]: 0 where a decode may attend, -inf past its
        seq_len. Built on the first layer's call, then shared by the others."""
        key = (num_kv_heads, dtype)
        if key not in self._decode_biases:
            bias = torch.zeros(self.decode_pad_mask.shape, dtype=dtype).masked_fill_(
                self.decode_pad_mask, float("-inf"))  # [num_decodes, ctx]
            self._decode_biases[key] = bias.repeat(num_kv_heads, 1)[:, None, :]
        return self._decode_biases[key]

    def token_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as a one-query "decode" of its own: (block tables
        [num_tokens, max_num_blocks], seq_lens [num_tokens], position + 1), for the
        batch-invariant attention (`PagedAttention.attend`). Built on the first layer's call,
        then shared."""
        if self._token_queries is None:
            seq_of_token = torch.repeat_interleave(  # [num_tokens]
                torch.arange(self.num_seqs), torch.tensor(self.query_lens))
            self._token_queries = (self.block_tables.index_select(0, seq_of_token),
                                   self.positions + 1)
        return self._token_queries

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int) -> AttentionMetadata:
        """Vectorised over tokens: the runner calls this every step with up to max_num_seqs."""
        num_seqs = len(query_lens)
        if not (num_seqs == len(seq_lens) == len(block_tables)) or num_seqs == 0:
            raise ValueError(
                f"need one query_len, seq_len and block table per sequence, got "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}")
        q_lens = np.asarray(query_lens, dtype=np.int64)  # [num_seqs]
        s_lens = np.asarray(seq_lens, dtype=np.int64)  # [num_seqs]
        ctx_lens = s_lens - q_lens  # [num_seqs] tokens already in the cache
        if (q_lens < 1).any() or (ctx_lens < 0).any():
            raise ValueError(f"bad query_lens {query_lens} for seq_lens {seq_lens}")
        num_blocks_needed = -(-s_lens // block_size)  # [num_seqs] ceil
        table_lens = np.fromiter((len(t) for t in block_tables), np.int64, num_seqs)
        if (table_lens < num_blocks_needed).any():
            i = int(np.argmax(table_lens < num_blocks_needed))
            raise ValueError(
                f"sequence {i} has {table_lens[i]} blocks, needs {num_blocks_needed[i]} "
                f"for seq_len {seq_lens[i]}")
        max_num_blocks = int(num_blocks_needed.max())
        tables = np.zeros((num_seqs, max_num_blocks), dtype=np.int64)  # pad: block 0, masked
        for i, table in enumerate(block_tables):  # NOTE: per sequence, not per token
            n = int(num_blocks_needed[i])
            tables[i, :n] = table[:n]

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)  # [num_seqs + 1]
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [num_tokens]
        positions = (np.arange(num_tokens) - query_start_loc[:-1][seq_of_token]
                     + ctx_lens[seq_of_token])  # [num_tokens]
        slot_mapping = (tables[seq_of_token, positions // block_size] * block_size
                        + positions % block_size)  # [num_tokens]

        # NOTE: decodes lead; a later query_len == 1 sequence (a 1-token prefill chunk) is
        # still correct on the prefill path, so only the leading run is batched.
        num_decodes = num_seqs if (q_lens == 1).all() else int(np.argmax(q_lens != 1))
        block_tables_t = torch.from_numpy(tables)
        if num_decodes:
            max_decode_seq_len = int(s_lens[:num_decodes].max())
            decode_num_blocks = -(-max_decode_seq_len // block_size)
            decode_block_ids = block_tables_t[:num_decodes, :decode_num_blocks].reshape(-1)
            decode_pad_mask = (torch.arange(decode_num_blocks * block_size)[None, :]
                               >= torch.from_numpy(s_lens[:num_decodes])[:, None])  # [nd, ctx]
        else:
            max_decode_seq_len = decode_num_blocks = 0
            decode_block_ids = torch.empty(0, dtype=torch.long)
            decode_pad_mask = torch.empty(0, 0, dtype=torch.bool)

        prefills = []
        for i in range(num_decodes, num_seqs):
            q_len, s_len, ctx_len = int(q_lens[i]), int(s_lens[i]), int(ctx_lens[i])
            if ctx_len == 0:  # all its keys are this step's: no gather, plain causal
                block_ids, mask = block_tables_t[i, :0], None
            else:
                block_ids = block_tables_t[i, :int(num_blocks_needed[i])]
                # query row r sits at position ctx_len + r and sees keys 0..ctx_len + r
                mask = (torch.arange(s_len)[None, :]
                        <= torch.arange(ctx_len, s_len)[:, None])  # [q_len, s_len]
            prefills.append(PrefillSeq(int(query_start_loc[i]), q_len, s_len, block_ids, mask))

        return cls(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            block_size=block_size,
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens_tensor=torch.from_numpy(s_lens),
            block_tables=block_tables_t,
            num_decodes=num_decodes,
            max_decode_seq_len=max_decode_seq_len,
            decode_block_ids=decode_block_ids,
            decode_num_blocks=decode_num_blocks,
            decode_pad_mask=decode_pad_mask,
            prefills=prefills,
        )


def k_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The K half as [num_kv_heads, num_blocks, head_dim, block_size] (a view)."""
    _, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    return kv_cache[0].view(kv_heads, num_blocks, head_dim, block_size)


def v_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The V half as [num_kv_heads, num_blocks, block_size, head_dim] (a view)."""
    return kv_cache[1]


def store_kv(kv_cache: torch.Tensor, new_kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """new_kv [2 * num_kv_heads, num_tokens, hd] (K heads, then V heads) into their slots."""
    _, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [num_tokens]
    # indexed dims lead the result of a[:, i, :, j]: it is [num_tokens, kv_heads, hd]
    k_blocks(kv_cache)[:, blocks, :, offsets] = new_kv[:kv_heads].transpose(0, 1)
    v_blocks(kv_cache).view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping,
                                                                new_kv[kv_heads:])


class PagedAttention:
    """Attention of one step over the paged cache; owns a reusable gather buffer.

    One instance serves every layer of a model: layers run one after another, so they share
    the buffer, which also keeps it warm in cache from layer to layer.

    Decodes read K/V in place through the block tables with the compiled kernel
    (cpu_kernels.py) when float32 queries meet it; otherwise (no compiler, or the bfloat16
    path) each decode's blocks are gathered into the buffer and attended with bmm.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 kernels: CpuKernels | None = None, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window  # sliding-window attention: keys a query sees, itself included
        self.softcap = softcap  # Gemma 2: scores = softcap * tanh(scores / softcap)
        self._buffer = torch.empty(0)
        # NOTE: the compiled decode kernel attends to a sequence's whole context with plain
        # scores: a sliding-window or soft-capped layer decodes on the torch path.
        self.kernels = (kernels if self.group <= CpuKernels.MAX_GROUP and window is None
                        and softcap is None else None)
        # Batch-invariant decoding (EngineConfig.batch_invariant): every query row, a prompt's
        # too, attends on the decode kernel over the cache (set by the model)
        self.batch_invariant = False

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of `block_ids`, in order, as rows: [2, num_kv_heads, len(block_ids) *
        block_size, hd] (K blocks un-transposed on the way)."""
        _, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        n = block_ids.numel()
        numel = 2 * kv_heads * n * block_size * head_dim
        if self._buffer.numel() < numel or self._buffer.dtype != kv_cache.dtype:
            # NOTE: grown, never shrunk: fresh multi-MB allocations page-fault on every step.
            self._buffer = torch.empty(max(numel, 2 * self._buffer.numel()), dtype=kv_cache.dtype)
        out = self._buffer[:numel].view(2, kv_heads, n, block_size, head_dim)
        torch.index_select(v_blocks(kv_cache), 1, block_ids, out=out[1])
        keys = k_blocks(kv_cache).index_select(1, block_ids)  # [kv_heads, n, hd, block_size]
        out[0].copy_(keys.transpose(2, 3))
        return out.view(2, kv_heads, n * block_size, head_dim)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, num_heads, hd], kv [num_tokens, 2 * num_kv_heads, hd] (K heads then
        V heads) -> [num_tokens, num_heads * hd] in q's dtype. Writes the step's K/V into
        `kv_cache` first."""
        new_kv = kv.transpose(0, 1).to(kv_cache.dtype)  # [2 * kv_heads, num_tokens, hd]
        store_kv(kv_cache, new_kv, meta.slot_mapping)
        # NOTE: prefills attend to this step's K/V rounded as the cache holds them, so a
        # prompt gets the same result prefilled whole or in chunks.
        kv = new_kv.transpose(0, 1).to(q.dtype) if meta.prefills else kv
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, hd]
        return self.attend(q, kv, kv_cache, meta, out)

    def attend(self, q: torch.Tensor, kv: torch.Tensor | None, kv_cache: torch.Tensor,
               meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
        """Attention over a cache that already holds the step's K/V. q [num_tokens,
        num_heads, hd]; kv [num_tokens, 2 * num_kv_heads, hd] as the cache rounds it (read
        only by prefills without cached context); out [num_tokens, num_heads, hd] (any float
        dtype) is filled and returned as [num_tokens, num_heads * hd]."""
        num_tokens = q.shape[0]
        kv_heads, group, head_dim = self.num_kv_heads, self.group, self.head_dim
        if self.window is not None:
            meta = meta.windowed(self.window)
        if self.batch_invariant:
            # NOTE: a prompt's rows as one-query decodes over the cache (the step's K/V are
            # in it): each row's scores, softmax and weighted sum run in one fixed order over
            # its keys, whatever else the step holds, however the prompt was chunked, and
            # whether its first blocks came from the prefix cache. SDPA's order follows the
            # chunk's length and the cached context (its blocking), so a prompt chunked
            # differently attends to rounding-different sums.
            assert self.kernels is not None and q.dtype == torch.float32
            tables, seq_lens = meta.token_queries()
            self.kernels.decode_attention(q, kv_cache, tables, seq_lens, self.scale, out)
            return out.view(num_tokens, self.num_heads * head_dim)
        nd = meta.num_decodes
        if nd and self.kernels is not None and q.dtype == torch.float32:
            # K/V read where they lie, through the block tables: no gather.
            self.kernels.decode_attention(q[:nd], kv_cache, meta.block_tables[:nd],
                                          meta.seq_lens_tensor[:nd], self.scale, out[:nd])
        elif nd:
            # NOTE: in the queries' dtype: float32 queries over a bfloat16 cache attend in
            # float32, as the compiled kernel does.
            gathered = self._gather(kv_cache, meta.decode_block_ids).to(q.dtype)
            gathered = gathered.view(2, kv_heads * nd, -1, head_dim)  # [2, kh * nd, ctx, hd]
            # [kv_heads * nd, group, hd]: each (kv head, sequence) is one small matmul batch,
            # so the query heads of a group share their K/V without repeating it.
            qd = q[:nd].view(nd, kv_heads, group, head_dim).transpose(0, 1).reshape(
                kv_heads * nd, group, head_dim)
            bias = meta.decode_bias(kv_heads, q.dtype)
            if self.softcap is None:
                scores = torch.baddbmm(bias, qd, gathered[0].transpose(1, 2), alpha=self.scale)
            else:  # the cap goes on the raw scores, before the mask
                scores = soft_cap(torch.bmm(qd, gathered[0].transpose(1, 2)) * self.scale,
                                  self.softcap).add_(bias)
            # NOTE: the CPU softmax accumulates in float32 whatever the dtype, like HF's upcast.
            probs = torch.softmax(scores, dim=-1)  # [kv_heads * nd, group, ctx]
            od = torch.bmm(probs, gathered[1])  # [kv_heads * nd, group, hd]
            out[:nd] = od.view(kv_heads, nd, group, head_dim).transpose(0, 1).reshape(
                nd, self.num_heads, head_dim)

        if meta.prefills and self.kernels is not None and q.dtype == torch.float32:
            # NOTE: prompts on the compiled kernel too, K/V read where they lie: SDPA, one
            # call per prompt over gathered K/V, ran 2-3x slower (8 query rows share each K/V
            # block there), and each row now gets the floats it would get as a decode
            self.kernels.prompt_attention(q, kv_cache, meta.block_tables[nd:],
                                          meta.query_start_loc[nd:], meta.seq_lens_tensor[nd:],
                                          self.scale, out)
            return out.view(num_tokens, self.num_heads * head_dim)
        for seq in meta.prefills:
            rows = slice(seq.token_start, seq.token_start + seq.query_len)
            # [kv_heads, group, query_len, hd]: GQA through a stride-0 expand of K/V, which
            # SDPA's CPU kernel reads without materialising the repeat.
            qp = q[rows].transpose(0, 1).reshape(kv_heads, group, seq.query_len, head_dim)
            if seq.seq_len == seq.query_len:  # no cached context: all keys are this step's
                assert kv is not None
                kvp = kv[rows].transpose(0, 1)  # [2 * kv_heads, q_len, hd]
            else:
                kvp = self._gather(kv_cache, seq.block_ids)[:, :, :seq.seq_len].to(q.dtype)
                kvp = kvp.reshape(2 * kv_heads, seq.seq_len, head_dim)
            kp, vp = kvp[:kv_heads], kvp[kv_heads:]  # [kv_heads, seq_len, hd] each
            shape = (kv_heads, group, kp.shape[1], head_dim)
            op = sdpa(qp, kp[:, None].expand(shape), vp[:, None].expand(shape),  # [kh, g, q, hd]
                      seq.mask, self.scale, self.softcap)
            out[rows] = op.reshape(self.num_heads, seq.query_len, head_dim).transpose(0, 1)
        return out.view(num_tokens, self.num_heads * head_dim)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's attention soft-capping: cap * tanh(scores / cap), in place."""
    return scores.div_(cap).tanh_().mul_(cap)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float, softcap: float | None) -> torch.Tensor:
    """scaled_dot_product_attention (mask None: causal), or its plain form where the scores
    are soft-capped, which SDPA cannot do. q [..., q_len, hd], k/v [..., kv_len, hd]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril_()
    scores = soft_cap(q @ k.transpose(-1, -2) * scale, softcap)  # [..., q_len, kv_len]
    scores.masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def contiguous_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor,
                         start_pos: int, window: int | None = None, scale: float | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """The oracle: one sequence, cache [2, num_kv_heads, max_len, hd], plain causal SDPA.

    q [T, num_heads, hd], kv [T, 2 * num_kv_heads, hd] at positions start_pos..start_pos+T-1.
    Returns [T, num_heads * hd]. Kept deliberately simple: K/V heads are repeated outright.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = cache.shape[1]
    end = start_pos + num_tokens
    if end > cache.shape[2]:
        raise ValueError(f"contiguous cache holds {cache.shape[2]} positions, need {end}")
    cache[:, :, start_pos:end] = kv.transpose(0, 1).reshape(2, kv_heads, num_tokens, head_dim)
    group = num_heads // kv_heads
    k = cache[0, :, :end].to(q.dtype).repeat_interleave(group, dim=0)  # [num_heads, end, hd]
    v = cache[1, :, :end].to(q.dtype).repeat_interleave(group, dim=0)  # [num_heads, end, hd]
    keys, query_pos = torch.arange(end)[None, :], torch.arange(start_pos, end)[:, None]
    mask = keys <= query_pos  # [T, end]
    if window is not None:
        mask &= keys > query_pos - window
    out = sdpa(q.transpose(0, 1), k, v, mask, head_dim ** -0.5 if scale is None else scale,
               softcap)
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim)  # [T, num_heads * hd]
