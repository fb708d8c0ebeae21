"""The ``reasoning-gym`` task type: questions from one of reasoning-gym's procedural generators, scored by that
dataset's own scorer (``score_answer``), on the coordinator like every reward.

Generation is offline and deterministic: item ``i`` of a dataset depends only on its config and seed, so the API,
the learner and every verifier build the same items independently, and a restart builds them again. The training
set is items ``0 .. size-1``; the held-out set is the next items whose question differs from every training
question (small configs repeat questions, and a repeated one would not be held out).

The completion's answer is the text inside its last ``<answer>…</answer>`` (reasoning-gym's convention, for
instruct models told so in the system prompt), else the whole completion, stripped — the tiny model answers bare.

reasoning-gym is an optional extra (``pip install 'echo-swarm[reasoning-gym]'``) and takes seconds to import, so
it is imported only by a run that names this task type.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.config import ReasoningGymTaskConfig
from coordinator.errors import MissingDependency, TaskError
from coordinator.tasks.base import TaskItem, chat_formatter
from coordinator.tasks.rewards import RewardFailed, RewardSet, RewardTerm, ScoredBatch, final_answer

#: How to get the reasoning-gym task type's optional extra.
REASONING_GYM_INSTALL = "pip install 'echo-swarm[reasoning-gym]' (or pip install reasoning-gym)"
#: A reasoning-gym dataset's settings that the task sets itself, from task.seed and task.size.
REASONING_GYM_RESERVED = ("seed", "size")


def reasoning_gym_datasets() -> Mapping[str, tuple[type, type]]:
    """reasoning-gym's datasets (name → dataset class, config class); MissingDependency without the extra. The
    library is imported here, not at the top: it takes seconds, and only a run of this task type needs it."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a generator must never reach a hub
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise MissingDependency(f"the reasoning-gym task needs reasoning-gym: {REASONING_GYM_INSTALL}") from None
    return DATASETS  # type: ignore[no-any-return]


def check_reasoning_gym_dataset(name: str, config: Mapping[str, Any]) -> None:
    """Raise ValueError, saying how to fix it, unless ``name`` is a reasoning-gym dataset and ``config`` a valid
    configuration of it (checked by the dataset's own config class and its ``validate``)."""
    try:
        registry = reasoning_gym_datasets()
    except MissingDependency as exc:
        raise ValueError(str(exc)) from None
    if name not in registry:
        raise ValueError(f"task.dataset {name!r} is not a reasoning-gym dataset; known datasets: "
                         f"{', '.join(sorted(registry))}")
    _, config_cls = registry[name]
    names = [f.name for f in dataclasses.fields(config_cls) if f.name not in REASONING_GYM_RESERVED]
    reserved = sorted(set(config) & set(REASONING_GYM_RESERVED))
    if reserved:
        raise ValueError(f"task.config may not set {reserved}: use task.seed and task.size")
    unknown = sorted(set(config) - set(names))
    if unknown:
        raise ValueError(f"task.config has {unknown}, which {name} does not take; its settings are: {', '.join(names)}")
    try:
        made = config_cls(**config, seed=0, size=1)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"task.config is not a valid {name} configuration: {exc or type(exc).__name__}") from None


def _fill(template: str, entry: dict[str, Any]) -> str:
    try:
        return template.format(question=entry["question"], metadata=entry.get("metadata") or {})
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        keys = sorted(entry.get("metadata") or {})
        raise TaskError(f"task.prompt_template names {exc} that this dataset's items lack; their metadata keys are "
                        f"{keys}") from None


class ReasoningGymTask:
    """One reasoning-gym dataset as a task: reward = the dataset's ``score_answer`` on the completion's answer."""

    name = "reasoning-gym"

    def __init__(self, config: ReasoningGymTaskConfig, tokenizer_dir: Path | None = None) -> None:
        self.config = config
        reasoning_gym_datasets()  # a missing extra stops the run here, with what to install
        try:
            check_reasoning_gym_dataset(config.dataset, config.config)
        except ValueError as exc:
            raise TaskError(str(exc)) from None
        import reasoning_gym

        try:
            self.dataset = reasoning_gym.create_dataset(config.dataset, seed=config.seed,
                                                        size=config.size + 4 * config.heldout_size, **config.config)
        except Exception as exc:  # a generator's own checks (the config was checked against its class just above)
            raise TaskError(f"reasoning-gym cannot make {config.dataset!r} with this task.config: "
                            f"{type(exc).__name__}: {exc}") from None
        entries = [self._entry(i) for i in range(config.size)]
        seen = {e["question"] for e in entries}
        held = []
        for i in range(config.size, config.size + 4 * config.heldout_size):
            entry = self._entry(i)
            if entry["question"] not in seen:
                seen.add(entry["question"])
                held.append(entry)
                if len(held) == config.heldout_size:
                    break
        if not held:
            raise TaskError(f"{config.dataset} with this task.config repeats its training questions only, so no "
                            f"held-out question exists; widen task.config (e.g. more digits) or lower task.size")
        chat = chat_formatter(config.chat_template, config.tokenizer_path or tokenizer_dir)

        def items(rows: list[dict[str, Any]]) -> list[TaskItem]:
            filled = [_fill(config.prompt_template, r) for r in rows]
            texts = filled if chat is None else chat.format(filled, config.system_prompt)
            return [TaskItem(prompt=t, answer=str(r["answer"]), source=r["question"], columns={"entry": r})
                    for t, r in zip(texts, rows, strict=True)]

        self.train, self.heldout = items(entries), items(held)
        self.rewards = RewardSet([RewardTerm(key=config.dataset, fn=self._score, weight=1.0)])

    def _entry(self, index: int) -> dict[str, Any]:
        try:
            entry = self.dataset[index]
        except Exception as exc:
            raise TaskError(f"reasoning-gym's {self.config.dataset} failed to generate item {index}: "
                            f"{type(exc).__name__}: {exc}") from None
        if not isinstance(entry.get("question"), str):
            raise TaskError(f"reasoning-gym's {self.config.dataset} item {index} has no question text")
        return dict(entry)

    def _score(self, prompts: list[str], completions: list[str], entry: list[dict[str, Any]], **_: Any
               ) -> list[float]:
        return [float(self.dataset.score_answer(answer=final_answer(c), entry=e))
                for c, e in zip(completions, entry, strict=True)]

    def score(self, items: Sequence[Any], completions: Sequence[str]) -> ScoredBatch:
        return self.rewards.score([it.source or it.prompt for it in items], list(completions),
                                  {"entry": [it.columns["entry"] for it in items]})

    def reward(self, item: Any, completion: str) -> float:
        try:
            return self.score([item], [completion]).rewards[0]
        except RewardFailed:
            return 0.0
