"""Plug-in rewards for benches at real model size (``[[task.rewards]] function = "bench/rewards.py:even_bytes"``).

A model with random weights never earns a task's reward, so every advantage and every gradient is zero and the
policy never moves (../shared/notes/scale.md). ``even_bytes`` scores a property of the sampled tokens themselves:
with the project's byte-level tokenizer a token id is a byte value, so the share of even bytes in a completion is
the share of even token ids. Completions of one prompt differ in it from the first step on, so every group has
non-zero advantages, and the versions a bench publishes differ by training (not by weight decay): their deltas,
verification and memory under gradients are those of a moving policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def even_bytes(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """Share of the completion's UTF-8 bytes that are even (0 for an empty completion)."""
    scores = []
    for text in completions:
        data = text.encode("utf-8", "replace")
        scores.append(sum(1 for b in data if b % 2 == 0) / len(data) if data else 0.0)
    return scores
