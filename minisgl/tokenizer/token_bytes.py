"""The raw bytes behind one vocabulary entry, for tokens that are not text on their own.

A byte-level BPE vocabulary (GPT-2's scheme: SmolLM2, Llama 3, Qwen) splits a multi-byte
character such as 日 over several tokens; decoded alone, each shows as U+FFFD. OpenAI's
logprobs carry each token's `bytes` so that a client can join them back, so those bytes must
come from the vocabulary entry: byte-level BPE writes every byte as one printable character,
and SentencePiece's byte fallback writes it as "<0xNN>".
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, Optional

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's character for each byte, reversed (character -> byte). Bytes that are
    printable Latin-1 characters stand for themselves; the other 68 (controls, space, and a few
    Latin-1 gaps) are written, in byte order, as the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    kept = set(printable)
    others = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer: Optional[Any], token_id: int, text: str) -> Optional[bytes]:
    """The bytes token `token_id` stands for where its text decoded alone (`text`) is not them
    (it holds U+FFFD: part of a character), else None (the bytes are `text`'s UTF-8)."""
    if tokenizer is None or "\ufffd" not in text:
        return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    match = _BYTE_PIECE.fullmatch(piece)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    table = byte_level_alphabet()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None
