"""Draft-model proposals: a smaller model of the same tokenizer drafts k tokens greedily.

After vLLM's draft-model proposer (`v1/spec_decode/`, `speculative_config.model`) and HF
transformers' assisted generation: e.g. SmolLM2-135M drafting for a larger SmolLM2 or a
Llama-geometry model sharing its vocabulary. The target verifies the draft in one forward pass
exactly as it does a prompt-lookup draft (worker/engine/spec_decode/rejection_sampler.py).

- Greedy drafts: the draft distribution q is one-hot at the draft's argmax, so the existing
  verification (accept x with probability p(x), else sample p without x) is speculative
  sampling's rule for this q as it stands: there is no other draft distribution to pass, and
  seeded requests keep drawing the very tokens they draw without speculation.
- Its own paged KV cache, in the draft model's geometry, with its own block tables from a free
  list (block 0 pads tables, as in the target's). No prefix caching: a request whose prompt hit
  the target's prefix cache still has its prompt computed here, on its first draft.
- Which cached positions are still right is decided by content: a `DraftSequence` remembers the
  tokens its KV was computed for, and only the longest prefix shared with the request's tokens
  now is kept. That one rule rolls back rejected draft positions, a stop inside an accepted
  run, anything. Requests that left the running set (finished, aborted, preempted, forked)
  are freed at the next pass: a preempted request recomputes its draft KV when it drafts again.
- One batched pass per engine step, before the scheduler: each drafting request's catch-up
  chunk (the tokens since its last draft: the accepted ones and the target's own, or its whole
  prompt the first time, in chunks of at most `max_num_batched_tokens` a pass, drafting only
  once caught up), then k - 1 one-token decodes batched over the requests still drafting.
- Memory is bounded: as many blocks as the target's KV cache (plus one per running request for
  the draft positions); a request that finds none free does not draft this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from llmq.worker.engine.model.attention import AttentionMetadata
from llmq.worker.engine.spec_decode.rejection_sampler import as_decode_rows

if TYPE_CHECKING:
    from llmq.worker.engine.model.llama import LlamaForCausalLM
    from llmq.worker.engine.request import Request

# A catch-up chunk up to this long runs as decode rows (one kernel call with the decodes), a
# longer one (a prompt) on the prefill path: as the target's verification rows do.
MAX_DECODE_ROWS_CHUNK = 16


def check_same_vocabulary(target_name: str, target_tokens: list[bytes], draft_name: str,
                          draft_tokens: list[bytes]) -> None:
    """Refuse a draft whose tokenizer is not the target's: its token ids would mean other text."""
    if target_tokens == draft_tokens:
        return
    if len(target_tokens) != len(draft_tokens):
        detail = f"{len(draft_tokens)} tokens against the target's {len(target_tokens)}"
    else:
        first = next(i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens, strict=True))
                     if a != b)
        detail = (f"token {first} is {draft_tokens[first]!r} in the draft, "
                  f"{target_tokens[first]!r} in the target")
    raise ValueError(f"draft model {draft_name} does not share the vocabulary of the target "
                     f"model, {target_name} ({detail}): a draft model must use the target's "
                     f"tokenizer")


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class DraftSequence:
    """One request in the draft's cache: `token_ids[i]`'s KV is at position i of `block_ids`."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # The leading tokens copied from the request (not drafted): a request's tokens only ever
    # grow, so these stay right and only the drafted ones after them need comparing.
    num_confirmed: int = 0


@dataclass
class _Drafting:
    """A request in this pass: its catch-up chunk starts at `start`; k tokens to propose."""

    request_id: str
    seq: DraftSequence
    start: int
    chunk: list[int]
    k: int
    proposals: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """The request's tokens the draft is for."""
        return self.start + len(self.chunk)


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, vocab_size: int, num_blocks: int,
                 block_size: int, max_num_batched_tokens: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's: a draft token is always one it knows
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.kv_caches = model.make_kv_caches(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # popped from the end: 1, 2, ...
        self.seqs: dict[str, DraftSequence] = {}
        self.proposals: dict[str, tuple[int, list[int]]] = {}  # id -> (num_tokens, draft)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def take(self, request: Request) -> list[int]:
        """This step's draft for the request, if the last pass made one for its tokens now."""
        made = self.proposals.pop(request.request_id, None)
        if made is None or made[0] != request.num_tokens:
            return []
        return made[1]

    def retain(self, running_ids: set[str]) -> None:
        """Free the sequences of requests that are no longer running."""
        for request_id in [r for r in self.seqs if r not in running_ids]:
            self.free(request_id)

    def free(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.free_blocks.extend(reversed(seq.block_ids))

    def sleep(self) -> None:
        """Drop the cache (the engine sleeps with no request in it)."""
        self.seqs.clear()
        self.proposals.clear()
        self.kv_caches = []

    def wake_up(self) -> None:
        self.kv_caches = self.model.make_kv_caches(self.num_blocks, self.block_size)
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]], running_ids: set[str]) -> None:
        """Draft up to k tokens for each (request, k), batched; `take` hands them out.
        Sequences of requests not in `running_ids` are freed first."""
        self.retain(running_ids)
        self.proposals.clear()
        drafting = self._catch_up_chunks(wanted)
        if not drafting:
            return
        # Catch-up: short chunks as decode rows first (the attention's order), prompts after.
        drafting.sort(key=lambda d: len(d.chunk) > MAX_DECODE_ROWS_CHUNK)
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []
        for d in drafting:
            input_ids.extend(d.chunk)
            if len(d.chunk) <= MAX_DECODE_ROWS_CHUNK:
                as_decode_rows(d.start, len(d.chunk), d.seq.block_ids, query_lens, seq_lens,
                               tables)
            else:
                query_lens.append(len(d.chunk))
                seq_lens.append(d.start + len(d.chunk))
                tables.append(d.seq.block_ids)
            last_rows.append(len(input_ids) - 1)
            d.seq.token_ids.extend(d.chunk)
            d.seq.num_confirmed = len(d.seq.token_ids)
        next_tokens = self._forward_argmax(input_ids, query_lens, seq_lens, tables, last_rows)
        for d, token in zip(drafting, next_tokens, strict=True):
            if d.k > 0:
                d.proposals.append(token)
        # Then one-token decodes, each feeding the previous draft token, while any wants more.
        for j in range(1, max(d.k for d in drafting)):
            active = [d for d in drafting if d.k > j]
            if not active:
                break
            positions = [len(d.seq.token_ids) for d in active]
            for d in active:
                d.seq.token_ids.append(d.proposals[-1])
            next_tokens = self._forward_argmax(
                [d.proposals[-1] for d in active], [1] * len(active),
                [p + 1 for p in positions], [d.seq.block_ids for d in active],
                list(range(len(active))))
            for d, token in zip(active, next_tokens, strict=True):
                d.proposals.append(token)
        for d in drafting:
            if d.proposals:
                self.proposals[d.request_id] = (d.num_tokens, d.proposals)

    def _catch_up_chunks(self, wanted: list[tuple[Request, int]]) -> list[_Drafting]:
        """Each request's tokens the draft cache lacks (at least its last one, whose logits
        give the first draft token), within the pass's token budget and the free blocks.
        Shortest first: a prompt being caught up never keeps the running ones from drafting."""
        lacking: list[tuple[Request, DraftSequence, int, int]] = []
        for request, k in wanted:
            seq = self.seqs.setdefault(request.request_id, DraftSequence())
            tokens = request.all_token_ids
            confirmed = seq.num_confirmed
            start = min(confirmed + common_prefix_len(seq.token_ids[confirmed:],
                                                      tokens[confirmed:]), len(tokens) - 1)
            del seq.token_ids[start:]  # the rest was a rejected draft (or recomputed anyway)
            seq.num_confirmed = min(confirmed, start)
            lacking.append((request, seq, start, k))
        lacking.sort(key=lambda item: item[0].num_tokens - item[2])
        budget = self.token_budget
        drafting: list[_Drafting] = []
        for request, seq, start, k in lacking:
            if budget <= 0:
                break
            chunk = request.all_token_ids[start:start + budget]
            if start + len(chunk) < request.num_tokens:
                k = 0  # a prompt caught up in pieces: it drafts once all of it is in
            if not self._reserve(seq, start + len(chunk) + max(k - 1, 0)):
                continue
            budget -= len(chunk)
            drafting.append(_Drafting(request.request_id, seq, start, chunk, k))
        return drafting

    def _reserve(self, seq: DraftSequence, num_positions: int) -> bool:
        """Give the sequence exactly the blocks `num_positions` need; False if none are free
        (it then keeps what it had)."""
        needed = -(-num_positions // self.block_size)
        missing = needed - len(seq.block_ids)
        if missing > len(self.free_blocks):
            return False
        if missing < 0:  # blocks only a rolled-back draft used
            self.free_blocks.extend(reversed(seq.block_ids[needed:]))
            del seq.block_ids[needed:]
        for _ in range(missing):
            seq.block_ids.append(self.free_blocks.pop())
        return True

    def _forward_argmax(self, input_ids: list[int], query_lens: list[int], seq_lens: list[int],
                        tables: list[list[int]], rows: list[int]) -> list[int]:
        """One draft forward pass; the argmax token of each of `rows`."""
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), metadata,
                            self.kv_caches)  # [num_tokens, hidden_size]
        logits = self.model.compute_logits(hidden[rows])  # [len(rows), draft vocab]
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()
