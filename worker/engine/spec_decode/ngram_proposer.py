"""Prompt-lookup (n-gram) drafts: the tokens that followed the last n tokens before.

After vLLM's `v1/spec_decode/ngram_proposer.py` and the prompt-lookup decoding of
apetresc/prompt-lookup-decoding: when an output copies spans of its prompt (extraction,
re-formatting, summaries, code edits), the last few tokens also occur earlier, and what followed
them there is a good guess of what comes next. No model runs: the draft costs a dict lookup.

Each request keeps an `NgramIndex` of its own tokens (prompt and output), updated incrementally,
so a proposal is O(max_n) whatever the context length. The longest matching n wins; among equal
n-grams the most recent occurrence does (the closest copy source).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> where the tokens after its latest occurrence start.

    Only occurrences with at least one token after them are indexed, so the request's own last n
    tokens never match themselves.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 1  # continuation starts below this are indexed

    def update(self, tokens: Sequence[int]) -> None:
        for start in range(self.num_indexed, len(tokens)):
            for n in range(self.min_n, min(self.max_n, start) + 1):
                self.tables[n][tuple(tokens[start - n:start])] = start
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the last n tokens."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(tokens[-n:]))
            if start is not None:
                return list(tokens[start:start + k])
        return []
