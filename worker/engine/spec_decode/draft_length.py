"""How many draft tokens a request proposes next: adapted to its own acceptance.

A verified draft of d tokens costs a forward pass over d + 1 positions instead of 1; a token
rejected early wastes the rest. So each request keeps its own draft length k:
- every draft accepted: k grows by 2 (up to the configured maximum), the copy run goes on;
- some accepted: k becomes one more than what was accepted, the length runs tend to have;
- none accepted: k halves, and after repeated misses the request stops proposing for a
  doubling number of steps (up to `MAX_COOLDOWN_STEPS`), then tries k = 1 again.
A request whose tokens never repeat proposes nothing and runs plain decodes: only the n-gram
lookup (a dict access) is spent on it. After HF transformers' assisted generation
("heuristic" num_assistant_tokens schedule) with a back-off for free-form text.
"""

from __future__ import annotations

MAX_COOLDOWN_STEPS = 64


class DraftLength:
    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.k = max_k
        self.misses = 0  # verified drafts in a row with nothing accepted
        self.cooldown = 0  # steps left without proposing

    def next_k(self) -> int:
        """The draft length for this step (0 while cooling down); call once per step."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return self.k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        if num_accepted == num_drafts:
            self.misses = 0
            self.k = min(self.max_k, self.k + 2)
        elif num_accepted > 0:
            self.misses = 0
            self.k = min(self.max_k, num_accepted + 1)
        else:
            self.misses += 1
            self.k = max(1, self.k // 2)
            if self.misses >= 2:
                self.cooldown = min(MAX_COOLDOWN_STEPS, 1 << (self.misses - 2))
