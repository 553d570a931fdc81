"""Bad words (vLLM's `bad_words`) as token ids, and which token each bans next.

Pure Python, so the gate (worker/engine/input_processor.py) can tokenize them without torch;
worker/engine/logits_adjustments.py applies the bans to the logits.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["bad_word_token_ids", "banned_next"]


def banned_next(words: tuple[tuple[int, ...], ...], history: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(history) >= len(prefix)
                          and tuple(history[len(history) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def bad_word_token_ids(words: tuple[str, ...], encode: Callable[[str], list[int]]
                       ) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM derives them (`SamplingParams.update_from_tokenizer`):
    the word as written, and with one leading space when that tokenizes differently with the
    same number of tokens (a word mid-sentence). `encode(text)` gives ids without specials."""
    found: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if bare:
            found.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            found.append(spaced)
    return tuple(found)
