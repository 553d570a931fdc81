"""IncrementalDetokenizer: streamed deltas never split a character and add up to the full decode."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmq.worker.engine.detokenizer import IncrementalDetokenizer
from llmq.worker.engine.model.tokenizer import Tokenizer

_FIXTURE_OK = settings(max_examples=300, deadline=None,
                       suppress_health_check=[HealthCheck.function_scoped_fixture])


def _stream(tok: Tokenizer, batches: list[list[int]], skip_special_tokens: bool = True):
    """Feed `batches` to a fresh detokenizer as an engine would: one update per step."""
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3],
                                   skip_special_tokens=skip_special_tokens)
    deltas = [detok.update(batch) for batch in batches]
    return deltas, detok.finish()


def _token_ids(tok: Tokenizer) -> st.SearchStrategy[int]:
    """Any id, weighted towards ids that split characters, special ids and out-of-vocab ids."""
    partial = [i for i, b in enumerate(tok.token_bytes) if _is_partial_utf8(b)]
    return st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(partial),  # lone bytes of emoji / CJK characters, lead or continuation
        st.sampled_from(sorted(tok.special_token_ids)),
        st.integers(tok.vocab_size, tok.vocab_size + 10),  # padded-embedding rows: no text
    )


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _realistic_ids(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Ids of text full of multi-byte characters, the way a model would emit them."""
    chars = st.one_of(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
                      st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
                      st.sampled_from(["é", " ", "\n", "a", "<|im_end|>", "\u200d"]))
    return st.lists(chars, max_size=12).map(lambda cs: tok.encode("".join(cs)))


def _batches(ids: st.SearchStrategy[list[int]]) -> st.SearchStrategy[list[list[int]]]:
    # Cut the sequence into steps of 0..4 tokens (an empty step is legal too).
    return ids.flatmap(lambda seq: st.lists(st.integers(0, 4), max_size=len(seq) + 2).map(
        lambda cuts: _cut(seq, cuts)))


def _cut(seq: list[int], sizes: list[int]) -> list[list[int]]:
    batches, start = [], 0
    for size in sizes:
        batches.append(seq[start:start + size])
        start += size
    batches.append(seq[start:])
    return batches


def _assert_deltas_are_the_decode(tok, batches, skip_special_tokens: bool) -> None:
    deltas, tail = _stream(tok, batches, skip_special_tokens)
    full = tok.decode([i for batch in batches for i in batch], skip_special_tokens)
    # Every delta is the piece of the full decode at its place: no U+FFFD of its own, no
    # half character ...
    offset = 0
    for delta in deltas:
        assert delta == full[offset:offset + len(delta)]
        offset += len(delta)
    # ... and together with finish() they are the full decode exactly
    assert "".join(deltas) + tail == full


@pytest.mark.model
@_FIXTURE_OK
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_add_up_to_the_decode_of_random_ids(smollm_tokenizer, data, skip_special_tokens):
    # Given any token ids (the model may emit any), delivered a few per step
    ids = st.lists(_token_ids(smollm_tokenizer), max_size=24)
    batches = data.draw(_batches(ids))
    # Then streaming them reproduces decode() piece by piece
    _assert_deltas_are_the_decode(smollm_tokenizer, batches, skip_special_tokens)


@pytest.mark.model
@_FIXTURE_OK
@given(data=st.data())
def test_deltas_add_up_to_the_decode_of_emoji_and_cjk(smollm_tokenizer, data) -> None:
    batches = data.draw(_batches(_realistic_ids(smollm_tokenizer)))
    _assert_deltas_are_the_decode(smollm_tokenizer, batches, skip_special_tokens=True)
    # and a complete text never shows a replacement character mid-stream
    deltas, _ = _stream(smollm_tokenizer, batches)
    assert "\ufffd" not in "".join(deltas)


@pytest.mark.model
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_decode_agrees_with_the_tokenizers_library(smollm_tokenizer, data, skip_special_tokens):
    ids = data.draw(st.lists(_token_ids(smollm_tokenizer).filter(
        lambda i: i < smollm_tokenizer.vocab_size), max_size=24))
    assert smollm_tokenizer.decode(ids, skip_special_tokens) == (
        smollm_tokenizer.backend.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.mark.model
@pytest.mark.parametrize("text", ["😀", "中文字符", "👩‍👩‍👧 family", "naïve café"])
def test_character_split_across_tokens_appears_once_complete(smollm_tokenizer, text) -> None:
    # Given text whose characters byte-level BPE splits across several tokens
    ids = smollm_tokenizer.encode(text)
    assert len(ids) > 1
    # When the tokens arrive one per step
    deltas, tail = _stream(smollm_tokenizer, [[i] for i in ids])
    # Then no step shows part of a character, and the text is whole at the end
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + tail == text


@pytest.mark.model
def test_emoji_is_held_back_until_its_last_byte(smollm_tokenizer) -> None:
    ids = smollm_tokenizer.encode("😀")  # 4 bytes in 3 tokens
    assert len(ids) == 3
    deltas, tail = _stream(smollm_tokenizer, [[i] for i in ids])
    assert deltas == ["", "", "😀"] and tail == ""


@pytest.mark.model
def test_generation_cut_mid_character_ends_like_decode(smollm_tokenizer) -> None:
    # Given a request stopped (max_tokens) after " " and 3 of the emoji's 4 bytes (one token)
    first = smollm_tokenizer.encode("ok 😀")[:-1]
    deltas, tail = _stream(smollm_tokenizer, [[i] for i in first])
    # Then the space is streamed at once, and the held-back bytes come out at finish() as
    # decode renders them
    assert deltas == ["ok", " "]
    assert tail == "\ufffd" == smollm_tokenizer.decode(first)[-1]


@pytest.mark.model
def test_special_tokens_are_skipped_or_kept(smollm_tokenizer) -> None:
    ids = smollm_tokenizer.encode("Hi!<|im_end|>")
    assert "".join(_stream(smollm_tokenizer, [[i] for i in ids])[0]) == "Hi!"
    kept, _ = _stream(smollm_tokenizer, [[i] for i in ids], skip_special_tokens=False)
    assert "".join(kept) == "Hi!<|im_end|>"


def test_sentencepiece_stream_drops_the_first_leading_space_like_decode(spm_tokenizer) -> None:
    # Given a SentencePiece-style vocabulary, whose decode drops the text's leading space
    ids = spm_tokenizer.encode("hello world 😀", add_special_tokens=False)
    # When the tokens stream one per step
    deltas, tail = _stream(spm_tokenizer, [[i] for i in ids])
    # Then only the first piece loses its space, and the emoji's four byte tokens show up once
    assert deltas[:2] == ["hello", " world"]
    assert deltas[-4:] == ["", "", "", "😀"]
    assert "".join(deltas) + tail == spm_tokenizer.decode(ids) == "hello world 😀"


@_FIXTURE_OK
@given(data=st.data())
def test_sentencepiece_deltas_add_up_to_the_decode(spm_tokenizer, data) -> None:
    ids = st.lists(_token_ids(spm_tokenizer), max_size=24)
    _assert_deltas_are_the_decode(spm_tokenizer, data.draw(_batches(ids)), skip_special_tokens=True)


def test_detokenizer_imports_neither_torch_nor_tokenizers() -> None:
    # The scheduler imports it; it must stay pure Python (docs/design.md, "Layers and import rules")
    code = ("import sys, llmq.worker.engine.detokenizer; "
            "print(sorted(m for m in ('torch', 'tokenizers', 'redis') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_invalid_bytes_are_shown_at_once_and_valid_prefixes_held(spm_tokenizer) -> None:
    # Given byte tokens: E0 A0 is the start of a valid 3-byte character, E0 80 never can be
    byte = {b: spm_tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0xE0, 0xA0, 0x80, 0xA4)}
    valid = IncrementalDetokenizer(spm_tokenizer, [])
    invalid = IncrementalDetokenizer(spm_tokenizer, [])
    # Then the valid start waits for its last byte, and the invalid one is replaced right away
    assert [valid.update([byte[b]]) for b in (0xE0, 0xA0, 0xA4)] == ["", "", "\u0824"]
    assert [invalid.update([byte[b]]) for b in (0xE0, 0x80)] == ["", "\ufffd\ufffd"]
    assert invalid.finish() == ""
