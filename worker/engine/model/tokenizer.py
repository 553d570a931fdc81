"""Tokenizer: text <-> token ids for a Llama-family model, from GGUF metadata or tokenizer.json.

References:
- llama.cpp `src/llama-vocab.cpp`: vocab types (`tokenizer.ggml.model`: "gpt2" byte-level BPE,
  "llama" SentencePiece-style BPE with byte fallback), the pre-tokenizer regexes picked by
  `tokenizer.ggml.pre`, which token types are special, and the end-of-generation token list.
- Hugging Face `tokenizers`, which runs the BPE itself; `pre_tokenizers.Split` with the llama.cpp
  regexes (Oniguruma understands `\\p{L}`, `\\p{N}` and look-ahead) reproduces llama.cpp's
  `unicode_regex_split`, which also keeps unmatched text as its own piece.
- vLLM's `transformers_utils/detokenizer_utils.py` for what a streaming detokenizer needs.

Decoding does not go through `tokenizers`: every token id maps once, at load, to the exact bytes it
stands for (`token_bytes`), and `decode` is the lossy UTF-8 decoding of their concatenation (the
same as `tokenizers`' ByteLevel decoder). The incremental detokenizer (worker/engine/detokenizer.py)
works on the same table, so streamed text always equals `decode` of the same ids.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from llmq.worker.engine.model.chat_template import ChatTemplate

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type), mirrored so that loading a
# tokenizer.json never needs the gguf package.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (llama-vocab.cpp, "special_eog_ids"; ref ggml-org/llama.cpp#9606).
_END_OF_GENERATION_TEXTS = frozenset({
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
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocab token is taken as is
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


_DEFAULT_PRE = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = _PreTokenizer((_GPT2,))
# "smollm" and friends: every digit is its own piece before the GPT-2 split, so "12345" is 5 tokens.
_DIGITS_PRE = _PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)

_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT_PRE,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), _GPT2_PRE),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_PRE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _PreTokenizer((_QWEN2,))),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
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


def _byte_level_token_bytes(token: str) -> bytes:
    try:
        return bytes([_CHAR_TO_BYTE[c] for c in token])
    except KeyError:
        # NOTE: tokenizers' ByteLevel decoder does the same: a token with a character outside
        # the byte alphabet (added tokens written as raw text) stands for its own UTF-8 bytes.
        return token.encode("utf-8")


def _spm_token_bytes(token: str) -> bytes:
    if match := _SPM_BYTE_TOKEN.fullmatch(token):
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class Tokenizer:
    """Encode text, decode ids, render chat templates; built by `from_gguf` or `from_hf_dir`.

    Attributes other modules rely on: `vocab_size`, `bos_token_id`, `eos_token_id`,
    `eos_token_ids` (eos plus end-of-turn tokens: stop on any of them), `add_bos`,
    `chat_template`, and for the detokenizer `token_bytes` (id -> the bytes it stands for),
    `special_token_ids` (what `skip_special_tokens` drops) and `strip_leading_space`
    (SentencePiece-style vocabularies drop the space their first token starts with).
    """

    def __init__(
        self,
        backend: _Backend,
        token_bytes: list[bytes],
        special_token_ids: frozenset[int],
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool = False,
        add_eos: bool = False,
        strip_leading_space: bool = False,
        chat_template: str | None = None,
        template_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.token_bytes = token_bytes
        self.special_token_ids = special_token_ids
        self.vocab_size = len(token_bytes)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos and bos_token_id is not None
        self.add_eos = add_eos and eos_token_id is not None
        self.strip_leading_space = strip_leading_space
        self.chat_template = chat_template
        self._template_tokens = dict(template_tokens or {})
        self._compiled_template: ChatTemplate | None = None
        self._split_backend: _Backend | None = None  # built on first use (_text_backend)
        self._text_backend_lock = threading.Lock()

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Tokenizer:
        """Build from the `tokenizer.ggml.*` metadata of an open GGUF file."""
        model = _gguf_value(reader, "tokenizer.ggml.model")
        tokens: list[str] | None = _gguf_value(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        token_types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type") or (
            [_NORMAL] * len(tokens))
        special_ids = frozenset(i for i, t in enumerate(token_types) if t in (_CONTROL, _UNKNOWN))
        user_defined_ids = [i for i, t in enumerate(token_types) if t == _USER_DEFINED]

        if model == "gpt2":
            pre_name = _gguf_value(reader, "tokenizer.ggml.pre")
            pre = cls._gguf_pre_tokenizer(pre_name)
            merges = [tuple(m.split(" ", 1))
                      for m in _gguf_value(reader, "tokenizer.ggml.merges", [])]
            vocab = {token: i for i, token in enumerate(tokens)}
            backend = _Backend(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            backend.decoder = decoders.ByteLevel()
            token_bytes = [_byte_level_token_bytes(t) for t in tokens]
            add_bos_default, strip = pre.add_bos, False
        elif model == "llama":
            add_space_prefix = bool(_gguf_value(reader, "tokenizer.ggml.add_space_prefix", True))
            scores = _gguf_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend = cls._spm_backend(tokens, scores, token_types, add_space_prefix,
                                       _gguf_value(reader, "tokenizer.ggml.unknown_token_id"))
            token_bytes = [_spm_token_bytes(t) for t in tokens]
            add_bos_default, strip = True, add_space_prefix
        else:
            raise ValueError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")

        # Specials written in the text (<|im_start|>) are matched whole, before the pre-tokenizer,
        # as llama.cpp does with parse_special=true; user-defined tokens are matched too but are
        # ordinary text when decoding.
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in sorted(special_ids)])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i in user_defined_ids])

        def token_id(key: str) -> int | None:
            value = _gguf_value(reader, key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        eog = {i for i in (eos, token_id("tokenizer.ggml.eot_token_id"),
                           token_id("tokenizer.ggml.eom_token_id")) if i is not None}
        eog.update(i for i, t in enumerate(tokens) if t in _END_OF_GENERATION_TEXTS)
        template_tokens = {name: tokens[i] for name, i in (
            ("bos_token", bos), ("eos_token", eos),
            ("unk_token", token_id("tokenizer.ggml.unknown_token_id")),
            ("pad_token", token_id("tokenizer.ggml.padding_token_id"))) if i is not None}
        return cls(
            backend, token_bytes, special_ids, bos, eos, frozenset(eog),
            add_bos=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token", False)),
            strip_leading_space=strip,
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
            template_tokens=template_tokens,
        )

    @staticmethod
    def _gguf_pre_tokenizer(name: str | None) -> _PreTokenizer:
        if name is None:
            logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                           "pre-tokenizer (generation quality may suffer)")
            return _DEFAULT_PRE
        if name not in _PRE_TOKENIZERS:
            raise ValueError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); "
                             f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
        return _PRE_TOKENIZERS[name]

    @staticmethod
    def _spm_backend(tokens: list[str], scores: list[float], token_types: list[int],
                     add_space_prefix: bool, unknown_id: int | None) -> _Backend:
        """SentencePiece-style BPE: llama.cpp merges the adjacent pair whose union scores best.

        That is BPE with one merge per way of splitting each normal token, ranked by the merged
        token's score (transformers' GGUF converter builds the same merges).
        """
        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        mergeable = {t for t, i in vocab.items() if token_types[i] in (_NORMAL, _USER_DEFINED)}
        ranked = []
        for token in mergeable:
            for k in range(1, len(token)):
                left, right = token[:k], token[k:]
                if left in mergeable and right in mergeable:
                    ranked.append((-scores[vocab[token]], vocab[left], vocab[right], left, right))
        ranked.sort()
        unk = tokens[unknown_id] if unknown_id is not None and unknown_id < len(tokens) else None
        backend = _Backend(models.BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=unk,
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

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json (+ tokenizer_config.json,
        generation_config.json, chat_template.jinja when present)."""
        path = Path(path)
        spec_text = (path / "tokenizer.json").read_text(encoding="utf-8")
        spec = json.loads(spec_text)
        backend = _Backend.from_str(spec_text)
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        size = backend.get_vocab_size(with_added_tokens=True)
        texts = [backend.id_to_token(i) for i in range(size)]
        kind, strip = _decoder_kind(spec.get("decoder"))
        to_bytes = _byte_level_token_bytes if kind == "byte_level" else _spm_token_bytes
        token_bytes = [b"" if t is None else to_bytes(t) for t in texts]
        added = {t["id"]: t for t in spec.get("added_tokens", [])}
        special_ids = frozenset(i for i, t in added.items() if t.get("special"))

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos, eos = token_id(config.get("bos_token")), token_id(config.get("eos_token"))
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        if eos is None and isinstance(gen_eos_ids[0], int):
            eos = gen_eos_ids[0]
        eog = {i for i in (eos, *gen_eos_ids) if isinstance(i, int)}
        eog.update(i for i in special_ids if texts[i] in _END_OF_GENERATION_TEXTS)

        with_specials = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
        detected_bos = bos is not None and with_specials[:1] == [bos] and without[:1] != [bos]
        detected_eos = eos is not None and with_specials[-1:] == [eos] and without[-1:] != [eos]

        template_tokens = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                template_tokens[name] = value
        return cls(
            backend, token_bytes, special_ids, bos, eos, frozenset(eog),
            add_bos=bool(config.get("add_bos_token", detected_bos)),
            add_eos=bool(config.get("add_eos_token", detected_eos)),
            strip_leading_space=strip,
            chat_template=_hf_chat_template(path, config),
            template_tokens=template_tokens,
        )

    # --- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, *,
               split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed as specials, unless
        `split_special_tokens`: then `<|im_start|>` in the text is just text (several ordinary
        tokens), which is how untrusted text must be encoded.

        `add_special_tokens` adds BOS (and EOS) only where the model asks for them (`add_bos`);
        rendered chat templates already carry their specials, see `encode_chat`.
        """
        backend = self._text_backend() if split_special_tokens else self._backend
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self.add_eos:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that do not form UTF-8 become U+FFFD."""
        table, size = self.token_bytes, self.vocab_size
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        data = b"".join(table[i] for i in token_ids if i not in skip and 0 <= i < size)
        text = data.decode("utf-8", errors="replace")
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (BPE and pre-tokenization run there)."""
        return self._backend

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of a token (byte-level form, e.g. 'Ġhello'), None if unknown."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # --- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation rendered with the model's own template (as transformers renders it)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of "
                             "messages, or use a model that ships one")
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template, self._template_tokens)
        return self._compiled_template.render(messages, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    allow_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        """Prompt ids of a conversation; like transformers, adds no BOS the template lacks.

        Only the template's own markers become control tokens: special-token text inside a
        message's content (`<|im_end|>\n<|im_start|>system`) is encoded as the text it is, so
        content cannot forge a turn. `allow_special_tokens` (trusted callers) parses it as
        specials, as transformers' `apply_chat_template(tokenize=True)` does.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if allow_special_tokens:
            return self.encode(text, add_special_tokens=False)
        assert self._compiled_template is not None  # apply_chat_template compiled it
        parts = self._compiled_template.render_parts(messages, add_generation_prompt, **kwargs)
        if parts is None:
            # NOTE: the template reshapes content so it cannot be told apart: refuse content
            # that holds a special token, encode the rest as before (nothing to forge with).
            contents = [m.get("content") for m in messages if isinstance(m, dict)]
            if forged := self._special_texts_in([c for c in contents if isinstance(c, str)]):
                raise ValueError(f"message content holds the special token {forged!r} and this "
                                 "model's chat template cannot keep content apart from its "
                                 "markers: remove it, or set allow_special_tokens")
            return self.encode(text, add_special_tokens=False)
        return self._encode_parts(parts)

    def _encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Ids of rendered parts: the specials the template wrote are control tokens, content is
        encoded with specials split. Same ids as encoding the text whole when content holds no
        special text, because `tokenizers` itself cuts the text at every special and encodes
        the stretches between them apart: only the cuts that fall in content are skipped."""
        text = "".join(t for t, _ in parts)
        content: list[tuple[int, int]] = []
        pos = 0
        for part, from_content in parts:
            if from_content:
                content.append((pos, pos + len(part)))
            pos += len(part)
        whole = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for token_id, (start, stop) in zip(whole.ids, whole.offsets, strict=True):
            if token_id not in self.special_token_ids or any(
                    start < c_stop and c_start < stop for c_start, c_stop in content):
                continue
            ids += self._text_backend().encode(text[pos:start], add_special_tokens=False).ids
            ids.append(token_id)
            pos = stop
        ids += self._text_backend().encode(text[pos:], add_special_tokens=False).ids
        return ids

    def _text_backend(self) -> _Backend:
        """A copy of the backend that encodes special-token text as ordinary text."""
        with self._text_backend_lock:
            if self._split_backend is None:
                backend = _Backend.from_str(self._backend.to_str())
                backend.encode_special_tokens = True
                self._split_backend = backend
            return self._split_backend

    def _special_texts_in(self, texts: list[str]) -> str | None:
        """The first special token's text found in any of `texts`, or None."""
        for text in texts:
            for token_id in self._backend.encode(text, add_special_tokens=False).ids:
                if token_id in self.special_token_ids:
                    return self._backend.id_to_token(token_id)
        return None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, add_bos={self.add_bos})")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _decoder_kind(decoder: dict[str, Any] | None) -> tuple[str, bool]:
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


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (path / "chat_template.json").exists():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
