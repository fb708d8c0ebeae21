"""The task of a run, from its config: one constructor per task type, and the check of a task's settings by its own
library before a run starts (the config models check only their own shape, so that validating a config, which
every role process does, never imports a task library)."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import (
    ArithmeticTaskConfig,
    ConfigError,
    DatasetTaskConfig,
    EnvironmentTaskConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
)
from coordinator.tasks.base import Task
from coordinator.tasks.builtin import ArithmeticTask, DatasetTask, JsonlQATask
from coordinator.tasks.episodes import EnvTask
from coordinator.tasks.reasoning_gym import ReasoningGymTask, check_reasoning_gym_dataset


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


def check_task(config: TaskConfig) -> None:
    """ConfigError, saying how to fix it, unless the task's library accepts its settings: reasoning-gym knows the
    dataset and its config (its registry takes seconds to import, so only a run of that type pays it, once before
    it starts and again in each role that builds the task). The other task types have no library to ask."""
    if isinstance(config, ReasoningGymTaskConfig):
        try:
            check_reasoning_gym_dataset(config.dataset, config.config)
        except ValueError as exc:
            raise ConfigError(f"invalid coordinator config:\n  task.reasoning-gym: {exc}") from None
