"""The task of a run, from its config: one constructor per task type."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import (
    ArithmeticTaskConfig,
    DatasetTaskConfig,
    EnvironmentTaskConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
)
from coordinator.tasks.base import Task
from coordinator.tasks.builtin import ArithmeticTask, DatasetTask, JsonlQATask
from coordinator.tasks.episodes import EnvTask
from coordinator.tasks.reasoning_gym import ReasoningGymTask


def make_task(config: TaskConfig, model_dir: Path | str | None = None) -> Task:
    """The task of a run. ``model_dir`` is the model folder (model.path; None for 'tiny'): a chat template is read
    from it when the task asks for one."""
    if isinstance(config, ArithmeticTaskConfig):
        return ArithmeticTask(config)
    folder = None if model_dir in (None, "tiny") else Path(str(model_dir)).expanduser()
    if isinstance(config, DatasetTaskConfig):
        return DatasetTask(config, folder)
    if isinstance(config, ReasoningGymTaskConfig):
        return ReasoningGymTask(config, folder)
    if isinstance(config, EnvironmentTaskConfig):
        return EnvTask(config)  # multi-turn episodes, verified by replay
    return JsonlQATask(config)
