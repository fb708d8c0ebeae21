"""The warm start every built model shares: a short supervised run on the arithmetic task, stopped as soon as greedy
accuracy on a slice of the training prompts reaches a target, so RL begins from a partially competent policy (a
random model's rewards are all 0: no advantage, nothing to learn from).

Used by the built-in tiny model (coordinator.engine.tiny_model) and the family models (coordinator.engine.
family_warm). A prompt is encoded exactly as the demo's jobs and the held-out evaluation encode it — the tokenizer's
own ``encode`` with its special tokens, so a family's <bos> leads — and the answer is what follows the prompt in the
encoding of prompt and answer together, so the model learns the tokens a rollout would sample (a SentencePiece-style
vocabulary spells " 85" alone differently from " 85" after a prompt).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from coordinator.config import ArithmeticTaskConfig
from coordinator.engine.evaluation import greedy_accuracy
from coordinator.tasks.builtin import ArithmeticTask


class WarmStartPlan(Protocol):
    """What the warm start reads from a model's recipe (TinyRecipe and FamilyRecipe both carry these)."""

    @property
    def seed(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def max_sft_steps(self) -> int: ...
    @property
    def check_every(self) -> int: ...
    @property
    def first_check(self) -> int: ...
    @property
    def target_accuracy(self) -> float: ...
    @property
    def check_size(self) -> int: ...
    @property
    def max_operand(self) -> int: ...
    @property
    def split_seed(self) -> int: ...
    @property
    def heldout_size(self) -> int: ...


def arithmetic_task(plan: WarmStartPlan) -> ArithmeticTask:
    """The arithmetic task with the plan's split: the demo's held-out prompts are never trained on."""
    return ArithmeticTask(ArithmeticTaskConfig(max_operand=plan.max_operand, heldout_size=plan.heldout_size,
                                               split_seed=plan.split_seed))


def example_ids(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + <eos>): the prompt as a job carries it, the answer as it continues that prompt."""
    p = list(tokenizer.encode(prompt))
    whole = list(tokenizer.encode(prompt + " " + answer))
    a = whole[len(p):] if whole[: len(p)] == p else list(tokenizer.encode(" " + answer, add_special_tokens=False))
    return p, a + [tokenizer.eos_token_id]


def warm_start(model: Any, tokenizer: Any, plan: WarmStartPlan, progress: Callable[[int, int, float], None]) -> float:
    """Train ``model`` in place until greedy accuracy on ``plan.check_size`` training prompts reaches
    ``plan.target_accuracy`` (checked every ``check_every`` steps from ``first_check``); returns the last accuracy."""
    import torch

    task = arithmetic_task(plan)
    rng = random.Random(plan.seed)
    check_items = task.train[: plan.check_size]
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr)
    acc = 0.0
    for step in range(1, plan.max_sft_steps + 1):
        model.train()
        batch = rng.sample(task.train, plan.batch_size)
        seqs, labels = [], []
        for it in batch:
            p, a = example_ids(tokenizer, it.prompt, it.answer)
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), eos)
        lab = torch.full((len(seqs), width), -100)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, lbl) in enumerate(zip(seqs, labels, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            lab[i, : len(s)] = torch.tensor(lbl)
            mask[i, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= plan.first_check and step % plan.check_every == 0:
            acc = greedy_accuracy(model, tokenizer, task, check_items, max_tokens=8)
            progress(step, plan.max_sft_steps, acc)
            if acc >= plan.target_accuracy:
                return acc
        elif step % 50 == 0:
            progress(step, plan.max_sft_steps, acc)
    return acc
