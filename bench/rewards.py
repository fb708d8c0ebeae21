"""Plug-in rewards for benches at real model size (``[[task.rewards]] function = "bench/rewards.py:even_token_ids"``).

A model with random weights never earns a task's reward, so every advantage and every gradient is zero and the
policy never moves (../shared/notes/scale.md). ``even_token_ids`` scores a property of the sampled tokens
themselves: the share of even token ids in a completion. Completions of one prompt differ in it from the first step
on, so every group has non-zero advantages, and the versions a bench publishes differ by training (not by weight
decay): their deltas, verification and memory under gradients are those of a moving policy.

Rewards see the decoded text, so the ids are read back from it: with the project's byte-level tokenizer a token id
below 256 is a byte (its parity is the byte's), and bench/scale.py's 0.5 B-shaped model gets a tokenizer whose ids
from 257 up decode to the text ``<id>`` (``widened_vocab``), so every id the model can sample is visible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_WIDE = re.compile(r"<(\d+)>")


def token_ids_of(text: str) -> list[int]:
    """The token ids a completion decoded from: ``<id>`` markers, and the UTF-8 bytes of the rest."""
    ids: list[int] = []
    at = 0
    for m in _WIDE.finditer(text):
        ids.extend(text[at:m.start()].encode("utf-8", "replace"))
        ids.append(int(m.group(1)))
        at = m.end()
    ids.extend(text[at:].encode("utf-8", "replace"))
    return ids


def even_share(ids: Sequence[int]) -> float:
    return sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0


def even_token_ids(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """Share of even token ids in each completion (0 for an empty one)."""
    return [even_share(token_ids_of(text)) for text in completions]


def widened_vocab(tokenizer_json: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The byte-level tokenizer with ids from its size up to ``vocab_size`` decoding to ``<id>``. Encoding is
    unchanged (there are no merges, so text still encodes byte by byte); only sampled ids get a spelling."""
    vocab = tokenizer_json["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    for k in range(vocab_size):
        if k not in taken:
            vocab[f"<{k}>"] = k
    return tokenizer_json
