"""A token's text on the wire: its bytes as UTF-8 when they are valid, else vLLM's `bytes:` form.

A token may be part of a character (byte-level BPE splits UTF-8 sequences), so its text alone
can be invalid UTF-8: such a token is written `bytes:\\xe2\\x80` (vLLM's spelling; so is a
token whose own text begins with `bytes:`), and `token_bytes` reads either form back, so
OpenAI's `bytes` lists are exact.
"""

from __future__ import annotations

__all__ = ["token_bytes", "token_text"]

_PREFIX = "bytes:"


def token_text(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = _PREFIX
    return _PREFIX + "".join(f"\\x{b:02x}" for b in raw) if text.startswith(_PREFIX) else text


def token_bytes(text: str) -> bytes:
    """The bytes a `token_text` stands for."""
    if not text.startswith(_PREFIX):
        return text.encode()
    return bytes(int(part, 16) for part in text[len(_PREFIX):].split("\\x")[1:])
