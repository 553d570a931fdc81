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
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from llmq.worker.engine.model.tokenizer_vocab import (
    CONTROL,
    END_OF_GENERATION_TEXTS,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    byte_level_token_bytes,
    decoder_kind,
    gguf_pre_tokenizer,
    gguf_value,
    hf_chat_template,
    read_json,
    spm_backend,
    spm_token_bytes,
)

if TYPE_CHECKING:
    from gguf import GGUFReader

    from llmq.worker.engine.model.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

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
        model = gguf_value(reader, "tokenizer.ggml.model")
        tokens: list[str] | None = gguf_value(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        token_types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or (
            [NORMAL] * len(tokens))
        special_ids = frozenset(i for i, t in enumerate(token_types) if t in (CONTROL, UNKNOWN))
        user_defined_ids = [i for i, t in enumerate(token_types) if t == USER_DEFINED]

        if model == "gpt2":
            pre_name = gguf_value(reader, "tokenizer.ggml.pre")
            pre = gguf_pre_tokenizer(pre_name)
            merges = [tuple(m.split(" ", 1))
                      for m in gguf_value(reader, "tokenizer.ggml.merges", [])]
            vocab = {token: i for i, token in enumerate(tokens)}
            backend = _Backend(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            backend.decoder = decoders.ByteLevel()
            token_bytes = [byte_level_token_bytes(t) for t in tokens]
            add_bos_default, strip = pre.add_bos, False
        elif model == "llama":
            add_space_prefix = bool(gguf_value(reader, "tokenizer.ggml.add_space_prefix", True))
            scores = gguf_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend = spm_backend(tokens, scores, token_types, add_space_prefix,
                                       gguf_value(reader, "tokenizer.ggml.unknown_token_id"))
            token_bytes = [spm_token_bytes(t) for t in tokens]
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
            value = gguf_value(reader, key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        eog = {i for i in (eos, token_id("tokenizer.ggml.eot_token_id"),
                           token_id("tokenizer.ggml.eom_token_id")) if i is not None}
        eog.update(i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS)
        template_tokens = {name: tokens[i] for name, i in (
            ("bos_token", bos), ("eos_token", eos),
            ("unk_token", token_id("tokenizer.ggml.unknown_token_id")),
            ("pad_token", token_id("tokenizer.ggml.padding_token_id"))) if i is not None}
        return cls(
            backend, token_bytes, special_ids, bos, eos, frozenset(eog),
            add_bos=bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(gguf_value(reader, "tokenizer.ggml.add_eos_token", False)),
            strip_leading_space=strip,
            chat_template=gguf_value(reader, "tokenizer.chat_template"),
            template_tokens=template_tokens,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json (+ tokenizer_config.json,
        generation_config.json, chat_template.jinja when present)."""
        path = Path(path)
        spec_text = (path / "tokenizer.json").read_text(encoding="utf-8")
        spec = json.loads(spec_text)
        backend = _Backend.from_str(spec_text)
        config = read_json(path / "tokenizer_config.json")
        generation = read_json(path / "generation_config.json")

        size = backend.get_vocab_size(with_added_tokens=True)
        texts = [backend.id_to_token(i) for i in range(size)]
        kind, strip = decoder_kind(spec.get("decoder"))
        to_bytes = byte_level_token_bytes if kind == "byte_level" else spm_token_bytes
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
        eog.update(i for i in special_ids if texts[i] in END_OF_GENERATION_TEXTS)

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
            chat_template=hf_chat_template(path, config),
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
            # NOTE: imported on the first chat request, not at load: jinja2's import is ~30 ms
            # of a worker's start, and prompt-only work never needs it.
            from llmq.worker.engine.model.chat_template import ChatTemplate

            self._compiled_template = ChatTemplate(self.chat_template, self._template_tokens)
        return self._compiled_template.render(messages, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    allow_special_tokens: bool = False, continue_final_message: bool = False,
                    **kwargs: Any) -> list[int]:
        """Prompt ids of a conversation; like transformers, adds no BOS the template lacks.

        Only the template's own markers become control tokens: special-token text inside a
        message's content (`<|im_end|>\n<|im_start|>system`) is encoded as the text it is, so
        content cannot forge a turn. `allow_special_tokens` (trusted callers) parses it as
        specials, as transformers' `apply_chat_template(tokenize=True)` does.
        `continue_final_message`: the prompt ends with the last message's content (what the
        template writes after it is cut, as transformers does), for the model to continue it.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        final = str(messages[-1].get("content") or "").strip() if continue_final_message else ""
        if continue_final_message:
            if not final or final not in text:
                raise ValueError("continue_final_message: the last message needs text content")
            text = text[:text.rindex(final) + len(final)]
        if allow_special_tokens:
            return self.encode(text, add_special_tokens=False)
        assert self._compiled_template is not None  # apply_chat_template compiled it
        parts = self._compiled_template.render_parts(messages, add_generation_prompt, **kwargs)
        if parts is not None and continue_final_message:
            parts = _cut_parts(parts, len(text))
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


def _cut_parts(parts: list[tuple[str, bool]], length: int) -> list[tuple[str, bool]]:
    """The rendered parts cut after `length` characters (continue_final_message)."""
    cut: list[tuple[str, bool]] = []
    for text, from_content in parts:
        if length <= 0:
            break
        cut.append((text[:length], from_content))
        length -= len(text)
    return cut
