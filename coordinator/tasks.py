"""Tasks with verifiable rewards. The reward is always computed here, on the coordinator, from the
completion text; a client never reports a reward."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from coordinator.config import ArithmeticTaskConfig, JsonlTaskConfig, TaskConfig
from shared.errors import EchoSwarmError

# Numbers are ASCII digits only. Python's \d (and int(), float()) also take Arabic-Indic, Devanagari, fullwidth
# and every other Unicode decimal digit; the answer a reward counts is written in ASCII digits, so "٤٢" or "４２" is
# not 42. A run of digits is found with the Unicode \d (so "4٢" is one run, not "4" followed by text) and a run
# holding any non-ASCII digit is not a number at all: it counts as text, like a word. The sign is the ASCII "-".
_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _ascii_numbers(pattern: re.Pattern[str], text: str) -> Iterator[str]:
    return (m.group() for m in pattern.finditer(text) if m.group().isascii())


class TaskError(EchoSwarmError):
    """A task's data file is missing or malformed."""


@dataclass(frozen=True)
class TaskItem:
    prompt: str
    answer: str


class Task(Protocol):
    name: str
    train: list[TaskItem]
    heldout: list[TaskItem]

    def reward(self, item: TaskItem, completion: str) -> float: ...


def first_integer(text: str) -> int | None:
    """The first integer written in ASCII digits in ``text`` (with a directly preceding ``-``), or None. A run of
    digits that holds any other Unicode digit ("٤٢", "４2") is not an integer: it is skipped like a word."""
    first = next(_ascii_numbers(_INT, text), None)
    return None if first is None else int(first)


class ArithmeticTask:
    """'Q: {a}+{b}= A:' with target ' {a+b}'. Reward 1 iff the first integer in the completion, written in ASCII
    digits (:func:`first_integer`), is a+b."""

    name = "arithmetic"

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


def parse_final_number(text: str) -> float | None:
    """GSM8K convention: the number after '####' if present, else the last number in the text. Numbers are ASCII
    digits with optional ``,`` grouping, a ``.`` fraction and a leading ``-``; a number holding any other Unicode
    digit is text, as in :func:`first_integer`."""
    if "####" in text:
        text = text.split("####")[-1]
        candidate = next(_ascii_numbers(_NUMBER, text), None)
    else:
        numbers = list(_ascii_numbers(_NUMBER, text))
        candidate = numbers[-1] if numbers else None
    if candidate is None:
        return None
    try:
        return float(candidate.replace(",", ""))
    except ValueError:
        return None


class JsonlQATask:
    """GSM8K-format question/answer pairs from JSONL. Reward 1 iff the final number matches."""

    name = "jsonl"

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
        got = parse_final_number(completion)
        want = parse_final_number(item.answer)
        return 1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0


def make_task(config: TaskConfig) -> Task:
    if isinstance(config, ArithmeticTaskConfig):
        return ArithmeticTask(config)
    return JsonlQATask(config)
