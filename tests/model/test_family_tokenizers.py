"""Each family's tokenizer encodes as `tokenizers` does: byte-level BPE with the Llama 3 and
Qwen2 pre-tokenizers, and Gemma's SentencePiece (no prefix space, byte fallback).

A GGUF holds a tokenizer as a token list, merges and a pre-tokenizer *name*
(`tokenizer.ggml.pre`); llmq maps the name to the family's split rule. Each case writes the same
vocabulary twice: as a GGUF with that name, and as a tokenizer.json with the family's own
pre-tokenizer (its split regex, as the families' tokenizer.json files carry it, then GPT-2 byte
mapping; Llama 3's BPE ignores merges for whole-word tokens). Both must give the same ids on a
corpus of contractions, numbers, whitespace runs, newlines, punctuation and non-Latin text.
"""

from __future__ import annotations

import gguf
import pytest

from llmq.worker.engine.model.tokenizer import Tokenizer
from tests.fixtures.tiny_gguf import tiny_vocab

# The split regexes of Meta's Llama 3 and of Qwen2's tokenizer.json (they differ in how many
# digits one piece may hold: up to three, or one).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'VE got 12345 apples, you'll see 3.14159 and 2026-12-01!",
    "def main():\n    print(\"hello\")\n\n\n    return 0\r\n",
    "  leading   and trailing spaces   ",
    "naïve café, Zürich — 東京 and Москва 🙂",
    "tabs\tand\u00a0non-breaking spaces, 'quoted' \"text\"...",
]
FAMILIES = {"llama-bpe": (LLAMA3_SPLIT, True), "qwen2": (QWEN2_SPLIT, False)}
VOCAB = 400


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_family_pre_tokenizer_encodes_as_tokenizers(tmp_path, write_tokenizer_gguf, pre):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    split, ignore_merges = FAMILIES[pre]
    tokens, types, merges = tiny_vocab(VOCAB)
    # NOTE: digit merges, so how many digits one piece may hold changes the ids
    extra = [("1", "2"), ("12", "3"), ("4", "5"), ("2", "0"), ("20", "2")]
    tokens, types = tokens + [a + b for a, b in extra], types + [1] * len(extra)
    merges = merges + [f"{a} {b}" for a, b in extra]
    # Given the family's tokenizer.json form of a vocabulary
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                     [tuple(m.split(" ")) for m in merges],
                                     ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    # And the same vocabulary as a GGUF naming the family's pre-tokenizer
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, types, pre=pre,
                                merges=merges, bos_token_id=1, eos_token_id=2,
                                add_bos_token=False)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    # Then every text of the corpus encodes to the same ids, and decodes back
    for text in CORPUS:
        assert ours.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == backend.decode(backend.encode(text).ids)


def test_gemma_sentencepiece_encodes_as_tokenizers(tmp_path, write_tokenizer_gguf):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers

    from tests.model.conftest import SPM_PIECES

    # Given a SentencePiece vocabulary (scores by rank, byte fallback) as Gemma's GGUF holds
    # it: no space prepended to the text
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    path = write_tokenizer_gguf(tmp_path / "gemma.gguf", "llama", tokens, types, scores=scores,
                                bos_token_id=1, eos_token_id=2, unk_token_id=0,
                                add_bos_token=False, add_space_prefix=False)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    # And the same vocabulary in Gemma's tokenizer.json form: spaces replaced by "▁", BPE over
    # the merges transformers extracts from a SentencePiece model (every pair of pieces whose
    # join is a piece, ranked by that piece's score), byte fallback
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((a, b) for a in SPM_PIECES for b in SPM_PIECES if a + b in SPM_PIECES),
                    key=lambda pair: vocab[pair[0] + pair[1]])
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    # Then both give the same ids
    for text in ["hello world", "helloworld", " hello", "hello  world", "héllo wörld!",
                 "world hello hello"]:
        assert ours.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
