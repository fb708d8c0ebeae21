"""What every task is: a list of items with prompts and answers, and how a result's completions are scored.

The vocabulary that the task types (coordinator.tasks.builtin, .reasoning_gym, .episodes) and their users (the
roles, the evaluation, the run files) share, in a module that imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordinator.errors import TaskError
from coordinator.tasks.prompts import ChatFormatter
from coordinator.tasks.rewards import ScoredBatch


@dataclass(frozen=True)
class TaskItem:
    prompt: str  # the formatted prompt text: what the job's tokens encode (TextCodec.encode)
    answer: str
    source: str | None = field(default=None, compare=False)  # the dataset's prompt before formatting
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)  # extra columns


class Task(Protocol):
    name: str
    train: list[TaskItem]
    heldout: list[TaskItem]

    def reward(self, item: TaskItem, completion: str) -> float:
        """One completion's reward, for evaluation and displays (a reward that fails counts 0 here)."""
        ...

    def score(self, items: Sequence[TaskItem], completions: Sequence[str]) -> ScoredBatch:
        """The rewards of a result's completions, what the learner trains on; raises :class:`RewardFailed`."""
        ...


def chat_formatter(enabled: bool, folder: Path | None) -> ChatFormatter | None:
    """The model's chat template when a task asks for one (``folder``: task.tokenizer_path, else model.path)."""
    if not enabled:
        return None
    if folder is None:
        raise TaskError("task.chat_template needs the model's tokenizer folder: set model.path to a model folder, or "
                        "task.tokenizer_path")
    return ChatFormatter(folder)
