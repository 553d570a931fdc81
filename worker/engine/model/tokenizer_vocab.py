"""How a vocabulary becomes a `tokenizers` backend: llama.cpp's pre-tokenizers, byte alphabets,
SentencePiece merges by score, and what a tokenizer.json's decoder and chat template say.

Shared by Tokenizer.from_gguf and Tokenizer.from_hf_dir (worker/engine/model/tokenizer.py, whose
docstring names the references).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type), mirrored so that loading a
# tokenizer.json never needs the gguf package.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (llama-vocab.cpp, "special_eog_ids"; ref ggml-org/llama.cpp#9606).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>",
})

# --- llama.cpp pre-tokenizer regexes, applied one after another (llama-vocab.cpp) -------------
# NOTE: llama.cpp writes the GPT-2 regex without its trailing `|\s+`; its custom GPT-2 splitter
# behaves as if it were there, so it is spelled out here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocab token is taken as is
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


DEFAULT_PRE = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
# "smollm" and friends: every digit is its own piece before the GPT-2 split, so "12345" is 5 tokens.
_DIGITS_PRE = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT_PRE,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), _GPT2_PRE),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_PRE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), PreTokenizer((_QWEN2,))),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
}

_SPM_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the printable stand-in character of each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    char_to_byte = {chr(b): b for b in printable}
    # Bytes without a printable form (controls, space, ...) get code points 256, 257, ...
    others = [b for b in range(256) if b not in printable]
    char_to_byte.update({chr(256 + n): b for n, b in enumerate(others)})
    return char_to_byte


_CHAR_TO_BYTE = _byte_level_alphabet()
# NOTE: one `str.translate` per token (each stand-in to the latin-1 character of its byte) is
# ~5x faster than a lookup per character, a tenth of a second of every start for a 128k
# vocabulary. A character outside the alphabet must fail the latin-1 encoding: those above 255
# do; those below (controls, space) are sent to U+0100, which does too.
_TO_LATIN1 = {**{code: "\u0100" for code in range(256)},
              **{ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}}


def byte_level_token_bytes(token: str) -> bytes:
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # NOTE: tokenizers' ByteLevel decoder does the same: a token with a character outside
        # the byte alphabet (added tokens written as raw text) stands for its own UTF-8 bytes.
        return token.encode("utf-8")


def spm_token_bytes(token: str) -> bytes:
    if match := _SPM_BYTE_TOKEN.fullmatch(token):
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_pre_tokenizer(name: str | None) -> PreTokenizer:
    if name is None:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                       "pre-tokenizer (generation quality may suffer)")
        return DEFAULT_PRE
    if name not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); "
                         f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[name]



def spm_backend(tokens: list[str], scores: list[float], token_types: list[int],
                 add_space_prefix: bool, unknown_id: int | None) -> Backend:
    """SentencePiece-style BPE: llama.cpp merges the adjacent pair whose union scores best.

    That is BPE with one merge per way of splitting each normal token, ranked by the merged
    token's score (transformers' GGUF converter builds the same merges).
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    mergeable = {t for t, i in vocab.items() if token_types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for token in mergeable:
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[vocab[token]], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = tokens[unknown_id] if unknown_id is not None and unknown_id < len(tokens) else None
    backend = Backend(models.BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=unk,
                                  fuse_unk=True, byte_fallback=True))
    # NOTE: tokenizers normalizes each stretch of text between special tokens on its own, so
    # the "▁" is prepended after every special token too, as llama.cpp does (is_prev_special).
    escape = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), escape])
                          if add_space_prefix else escape)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])])
    return backend



def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def decoder_kind(decoder: dict[str, Any] | None) -> tuple[str, bool]:
    """('byte_level' | 'spm', strips one leading space) for a tokenizer.json decoder."""
    if decoder is None:
        raise ValueError("tokenizer.json has no decoder; cannot map tokens to bytes")
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        return "byte_level", False
    if "Metaspace" in kinds:
        step = next(s for s in steps if s.get("type") == "Metaspace")
        default_scheme = "always" if step.get("add_prefix_space", True) else "never"
        scheme = step.get("prepend_scheme", default_scheme)
        return "spm", scheme != "never"
    if "ByteFallback" in kinds or any(
            s.get("type") == "Replace" and "\u2581" in json.dumps(s, ensure_ascii=False)
            for s in steps):
        strip = any(s.get("type") == "Strip" and s.get("start", 0) >= 1 for s in steps)
        return "spm", strip
    raise ValueError(f"unsupported tokenizer.json decoder {sorted(k for k in kinds if k)}; "
                     "supported: ByteLevel, Metaspace, SentencePiece-style ByteFallback")


def hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (path / "chat_template.json").exists():
        template = read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
