"""The raw bytes of a token, for logprobs.

`tokenizer.decode([id])` of a token that holds part of a UTF-8 character gives U+FFFD,
whose bytes (239, 191, 189) are not the token's. The vocabulary entry itself has the
bytes: byte-level BPE (GPT-2, Llama 3, SmolLM2) spells each byte as one printable
character, SentencePiece spells a raw byte as `<0xNN>` and a space as U+2581.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenBytes:
    """token id -> (display text, raw bytes). Text is the UTF-8 string when the bytes are
    valid on their own, else vLLM's `bytes:\\xNN...` spelling."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if tok is None:
            text = str(token_id)
            return text, text.encode()
        raw = self._raw(token_id)
        if raw is None:
            text = tok.decode([token_id])
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _raw(self, token_id: int) -> bytes | None:
        if token_id in self.special:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self.byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return None
        m = _SP_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
