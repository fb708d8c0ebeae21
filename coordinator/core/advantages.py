"""GRPO advantages: each sample's reward normalised within its prompt's group."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean(group)) / (std(group) + eps) for consecutive groups of ``group_size``.

    A group whose rewards are all equal carries no learning signal and gets advantage 0 for every sample.
    The population standard deviation is used (as in the GRPO paper's reference implementation).
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.extend(0.0 if std < eps else (r - mean) / (std + eps) for r in group)
    return out
