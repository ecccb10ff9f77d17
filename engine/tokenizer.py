"""A byte-level tokenizer: token id = byte value (vocab 256), so demos take text."""

from __future__ import annotations


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")
