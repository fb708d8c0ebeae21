"""Tasks with verifiable rewards. The reward is always computed here, on the coordinator, from the
completion text; a client never reports a reward."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.config import ArithmeticTaskConfig, DatasetTaskConfig, JsonlTaskConfig
from coordinator.errors import MissingDependency, TaskError
from coordinator.tasks.base import TaskItem, chat_formatter
from coordinator.tasks.data import read_rows, split_items
from coordinator.tasks.rewards import (
    BUILTINS,
    MissingExtra,
    PluginError,
    RewardFailed,
    RewardSet,
    RewardTerm,
    ScoredBatch,
    first_integer,
    load_plugin,
    numbers_match,
    parse_final_number,
    regex_reward,
)

__all__ = ["ArithmeticTask", "DatasetTask", "JsonlQATask", "RewardFailed", "ScoredBatch", "first_integer",
           "parse_final_number"]

logger = logging.getLogger(__name__)


class _OneReward:
    """score() of a task with one fixed, built-in reward."""

    reward_name: str

    def reward(self, item: TaskItem, completion: str) -> float:
        raise NotImplementedError

    def score(self, items: Sequence[TaskItem], completions: Sequence[str]) -> ScoredBatch:
        rewards = [self.reward(it, c) for it, c in zip(items, completions, strict=True)]
        return ScoredBatch(rewards, {self.reward_name: sum(rewards) / len(rewards)} if rewards else {})


class ArithmeticTask(_OneReward):
    """'Q: {a}+{b}= A:' with target ' {a+b}'. Reward 1 iff the first integer in the completion, written in ASCII
    digits (:func:`first_integer`), is a+b."""

    name = "arithmetic"
    reward_name = "first_integer"

    def __init__(self, config: ArithmeticTaskConfig) -> None:
        n = config.max_operand + 1
        items = [TaskItem(self.format_prompt(a, b), str(a + b)) for a in range(n) for b in range(n)]
        random.Random(config.split_seed).shuffle(items)
        if config.heldout_size >= len(items):
            raise TaskError(f"heldout_size {config.heldout_size} leaves no training items; lower it")
        self.heldout = items[: config.heldout_size]
        self.train = items[config.heldout_size :]

    @staticmethod
    def format_prompt(a: int, b: int) -> str:
        return f"Q: {a}+{b}= A:"

    def reward(self, item: TaskItem, completion: str) -> float:
        return 1.0 if first_integer(completion) == int(item.answer) else 0.0


class JsonlQATask(_OneReward):
    """GSM8K-format question/answer pairs from JSONL. Reward 1 iff the final number matches."""

    name = "jsonl"
    reward_name = "last_number"

    def __init__(self, config: JsonlTaskConfig) -> None:
        self.template = config.prompt_template
        items = self._read(config.train_path)
        if config.heldout_path is not None:
            self.train, self.heldout = items, self._read(config.heldout_path)
        else:
            random.Random(config.split_seed).shuffle(items)
            if config.heldout_size >= len(items):
                raise TaskError(f"{config.train_path} has {len(items)} items; heldout_size must be smaller")
            self.heldout, self.train = items[: config.heldout_size], items[config.heldout_size :]

    def _read(self, path: Path) -> list[TaskItem]:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise TaskError(f"cannot read task file {path}: {exc.strerror}") from None
        items = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], str(row["answer"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TaskError(
                    f"{path}:{lineno}: expected a JSON object with 'question' and 'answer' keys"
                ) from None
            if parse_final_number(answer) is None:
                raise TaskError(f"{path}:{lineno}: answer has no final number (GSM8K ends answers with '#### N')")
            items.append(TaskItem(self.template.format(question=question), answer))
        if not items:
            raise TaskError(f"{path} holds no questions")
        return items

    def reward(self, item: TaskItem, completion: str) -> float:
        return 1.0 if numbers_match(completion, item.answer) else 0.0


def _reward_set(config: DatasetTaskConfig) -> RewardSet:
    terms = []
    seen: dict[str, int] = {}
    for spec in config.rewards:
        try:
            if spec.function is not None:
                fn = load_plugin(spec.function)
            elif spec.name == "regex":
                assert spec.pattern is not None  # the config says so
                fn = regex_reward(spec.pattern)
            else:
                assert spec.name is not None
                fn = BUILTINS[spec.name]()
        except MissingExtra as exc:
            raise MissingDependency(str(exc)) from None
        except PluginError as exc:
            raise TaskError(str(exc)) from None
        seen[spec.key] = seen.get(spec.key, 0) + 1
        key = spec.key if seen[spec.key] == 1 else f"{spec.key}#{seen[spec.key]}"
        terms.append(RewardTerm(key=key, fn=fn, weight=spec.weight))
    return RewardSet(terms)


class DatasetTask:
    """Prompts and reference answers from a local dataset (JSONL, Parquet, a datasets folder) with a column
    mapping; prompts formatted by a plain template or the model's chat template; rewards combined with weights
    (coordinator.tasks.rewards)."""

    name = "dataset"

    def __init__(self, config: DatasetTaskConfig, tokenizer_dir: Path | None = None) -> None:
        self.config = config
        self.rewards = _reward_set(config)  # first: a missing extra or plug-in stops the run before reading data
        self._chat = chat_formatter(config.chat_template, config.tokenizer_path or tokenizer_dir)
        train = self._items(config.train_path, config.train_split)
        if config.heldout_path is not None:
            self.train, self.heldout = train, self._items(config.heldout_path, config.heldout_split)
        else:
            self.train, self.heldout = split_items(train, heldout_size=config.heldout_size,
                                                   heldout_fraction=config.heldout_fraction, seed=config.split_seed,
                                                   source=config.train_path)

    def _items(self, path: Path, split: str) -> list[TaskItem]:
        cfg = self.config
        rows = read_rows(path, cfg.format, split)
        if not rows:
            raise TaskError(f"{path} holds no rows")
        wanted = [cfg.prompt_column, *([cfg.answer_column] if cfg.answer_column else []), *cfg.extra_columns]
        sources: list[str | list[dict[str, Any]]] = []
        answers, extras = [], []
        for i, row in enumerate(rows):
            missing = [c for c in wanted if c not in row]
            if missing:
                raise TaskError(f"{path}: row {i} has no column {missing[0]!r} (it has {sorted(row)}); set "
                                f"task.prompt_column / answer_column / extra_columns to its column names")
            prompt = row[cfg.prompt_column]
            if not isinstance(prompt, str) and not _is_conversation(prompt):
                raise TaskError(f"{path}: row {i}: {cfg.prompt_column!r} is neither text nor a list of "
                                f"{{role, content}} messages")
            if not isinstance(prompt, str) and not cfg.chat_template:
                raise TaskError(f"{path}: row {i}: {cfg.prompt_column!r} is a conversation; set chat_template = "
                                f"true to render it with the model's chat template")
            answer = row[cfg.answer_column] if cfg.answer_column else ""
            if answer is None or isinstance(answer, dict | list):
                raise TaskError(f"{path}: row {i}: answer {answer!r} is not text or a number")
            sources.append(prompt)
            answers.append(str(answer))
            extras.append({c: row[c] for c in cfg.extra_columns})
        texts = self._format(sources, extras)
        return [TaskItem(prompt=t, answer=a, source=s if isinstance(s, str) else _last_user(s), columns=x)
                for t, a, s, x in zip(texts, answers, sources, extras, strict=True)]

    def _format(self, sources: list[Any], extras: list[dict[str, Any]]) -> list[str]:
        cfg = self.config

        def fill(src: Any, extra: dict[str, Any]) -> Any:
            return cfg.prompt_template.format(prompt=src, **extra) if isinstance(src, str) else src

        filled = [fill(s, x) for s, x in zip(sources, extras, strict=True)]
        return filled if self._chat is None else self._chat.format(filled, cfg.system_prompt)

    def score(self, items: Sequence[TaskItem], completions: Sequence[str]) -> ScoredBatch:
        columns: dict[str, list[Any]] = {"answer": [it.answer for it in items]}
        for c in self.config.extra_columns:
            columns[c] = [it.columns.get(c) for it in items]
        prompts = [it.source if it.source is not None else it.prompt for it in items]
        return self.rewards.score(prompts, list(completions), columns)

    def reward(self, item: TaskItem, completion: str) -> float:
        try:
            return self.score([item], [completion]).rewards[0]
        except RewardFailed as exc:
            logger.warning("reward failed while evaluating (counted 0): %s", exc.message)
            return 0.0


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def _last_user(messages: list[dict[str, Any]]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""
