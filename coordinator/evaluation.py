"""Held-out evaluation: greedy accuracy of a policy on prompts that are never trained on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.tasks import Task, TaskItem


def greedy_accuracy(model: Any, tokenizer: Any, task: Task, items: Sequence[TaskItem], max_tokens: int,
                    batch_size: int = 256) -> float:
    """Share of ``items`` whose greedy completion earns reward 1 under the task's own reward."""
    from shared.policy import generate, stop_token_ids

    was_training = model.training
    model.eval()
    stops = stop_token_ids(tokenizer)
    correct = 0.0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        prompts = [tokenizer.encode(it.prompt) for it in chunk]
        outs = generate(model, prompts, group_size=1, temperature=1.0, max_tokens=max_tokens, stop_ids=stops,
                        seed=None, pad_id=pad_id(tokenizer))
        for it, out in zip(chunk, outs, strict=True):
            correct += task.reward(it, tokenizer.decode(out.token_ids, skip_special_tokens=True))
    model.train(was_training)
    return correct / max(1, len(items))


def pad_id(tokenizer: Any) -> int:
    """Padding id for batching: the tokenizer's pad token, else its end-of-sequence token."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pid) if pid is not None else 0
