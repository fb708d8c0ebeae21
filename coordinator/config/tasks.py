"""The ``[task]`` section: one model per task type, told apart by ``type``. Each checks its own shape (templates,
rewards, environment parameters); what a task library itself says of a setting is asked when coordinator.tasks
builds the task."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from coordinator.config.base import StrictModel
from shared.envs import EnvError, parse_params


class ArithmeticTaskConfig(StrictModel):
    """Two-operand addition, 'Q: a+b= A:' → ' a+b'. Sized for the tiny model."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(99, ge=1, le=9999, description="Operands are drawn from 0..max_operand.")
    heldout_size: int = Field(512, ge=16, description="Prompts held out from all training, for evaluation.")
    split_seed: int = Field(0, description="Seed of the fixed train/held-out split.")


class JsonlTaskConfig(StrictModel):
    """Question/answer pairs in GSM8K format: one JSON object per line with 'question' and 'answer', where
    the answer ends in '#### <number>' (or is the bare number)."""

    type: Literal["jsonl"] = "jsonl"
    train_path: Path = Field(description="JSONL file of training questions.")
    heldout_path: Path | None = Field(None, description="JSONL file of held-out questions (default: split).")
    heldout_size: int = Field(256, ge=1, description="Held-out size when splitting train_path.")
    prompt_template: str = Field("Question: {question}\nAnswer:", description="Must contain '{question}'.")
    split_seed: int = 0

    @field_validator("train_path", "heldout_path")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @field_validator("prompt_template")
    @classmethod
    def _has_placeholder(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("prompt_template must contain '{question}', e.g. 'Question: {question}\\nAnswer:'")
        try:
            v.format(question="")
        except (KeyError, IndexError, ValueError):
            raise ValueError("prompt_template may contain only the '{question}' placeholder; write literal braces "
                             "as '{{' and '}}'") from None
        return v


_PLUGIN = re.compile(r"^(?:[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*|.+\.py):[A-Za-z_]\w*$")


class RewardConfig(StrictModel):
    """One reward of a dataset task: a built-in by ``name``, or an operator's ``function`` with TRL's signature
    ``(prompts, completions, **columns) -> list[float]``. The task's reward is Σ weight · value."""

    name: Literal["exact_match", "last_number", "regex", "format", "math"] | None = Field(
        None, description="A built-in: exact_match, last_number (GSM8K final number), regex (needs pattern), format "
        "(an <answer>…</answer> span), math (equivalence by math-verify; the 'math' extra).")
    function: str | None = Field(None, description="A plug-in: 'package.module:function' (importable by the "
                                 "coordinator) or 'path/to/file.py:function'.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Multiplies this reward's value.")
    pattern: str | None = Field(None, description="The regular expression of a 'regex' reward (re.search).")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if (self.name is None) == (self.function is None):
            raise ValueError("a reward has exactly one of 'name' (a built-in) or 'function' ('module:function')")
        if self.function is not None and not _PLUGIN.match(self.function):
            raise ValueError(f"function {self.function!r} must be 'package.module:function' or "
                             f"'path/to/file.py:function'")
        if self.name == "regex":
            if self.pattern is None:
                raise ValueError("the 'regex' reward needs a pattern, e.g. pattern = '^<think>.*</think>'")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {exc}") from None
        elif self.pattern is not None:
            raise ValueError("'pattern' belongs to a 'regex' reward; remove it or set name = 'regex'")
        return self

    @property
    def key(self) -> str:
        """The name its per-reward mean is recorded under."""
        return self.name or self.function or ""


class DatasetTaskConfig(StrictModel):
    """A dataset of prompts (and reference answers) from local files: JSONL, Parquet, or a Hugging Face
    ``datasets`` folder; never downloaded. Prompts are formatted by a plain template or the model's own chat
    template; rewards are built-ins or operator plug-ins, combined with weights."""

    type: Literal["dataset"] = "dataset"
    train_path: Path = Field(description="A .jsonl or .parquet file, or a Hugging Face datasets folder "
                             "(save_to_disk output, or a folder of data files).")
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field(
        "auto", description="auto: from the path (.jsonl/.json, .parquet, a folder is 'hf').")
    train_split: str = Field("train", description="The split to train on when a datasets folder holds several.")
    heldout_path: Path | None = Field(None, description="Held-out prompts from their own file or folder (the same "
                                      "format and columns); default: split train_path.")
    heldout_split: str = Field("test", description="The split of heldout_path when it is a datasets folder with "
                               "several.")
    heldout_size: int | None = Field(None, ge=1, description="Held-out prompts split off train_path (default 256).")
    heldout_fraction: float | None = Field(None, gt=0.0, lt=1.0,
                                           description="Or: this fraction of train_path, held out.")
    split_seed: int = Field(0, description="Seed of the train/held-out shuffle.")
    prompt_column: str = Field("prompt", description="Column holding the prompt (GSM8K: 'question'). A list of "
                               "{role, content} messages is a conversation (needs chat_template).")
    answer_column: str | None = Field("answer", description="Column holding the reference answer passed to the "
                                      "rewards as 'answer'; none for rewards that need no reference.")
    extra_columns: list[str] = Field(default_factory=list, description="Further columns passed to the rewards by "
                                     "name, and usable in prompt_template.")
    prompt_template: str = Field("{prompt}", description="Formats the prompt (the user message, with "
                                 "chat_template): '{prompt}' and any extra column, e.g. 'Question: {prompt}\\nAnswer:'.")
    chat_template: bool = Field(False, description="Render the prompt with the model's own chat template "
                                "(tokenizer_config.json's chat_template) and a generation prompt: for instruct models.")
    system_prompt: str | None = Field(None, description="A system message before the prompt (chat_template only).")
    tokenizer_path: Path | None = Field(None, description="Folder whose tokenizer files hold the chat template "
                                        "(default: model.path).")
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="last_number")],
                                        min_length=1, description="Rewards, summed with their weights.")

    @field_validator("train_path", "heldout_path", "tokenizer_path")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> DatasetTaskConfig:
        if self.heldout_size is not None and self.heldout_fraction is not None:
            raise ValueError("set heldout_size or heldout_fraction, not both")
        if self.heldout_path is not None and (self.heldout_size is not None or self.heldout_fraction is not None):
            raise ValueError("heldout_path replaces the split; remove heldout_size / heldout_fraction")
        reserved = {"prompts", "completions", "answer", self.prompt_column} & set(self.extra_columns)
        if reserved:
            raise ValueError(f"extra_columns may not name {sorted(reserved)}: the rewards get the prompt as 'prompts' "
                             f"and the answer column as 'answer' already")
        if not self.chat_template and self.system_prompt is not None:
            raise ValueError("system_prompt needs chat_template = true (or write the instruction into "
                             "prompt_template)")
        fields = set()
        try:
            for _, field, _, _ in string.Formatter().parse(self.prompt_template):
                if field is not None:
                    fields.add(field)
        except ValueError:
            raise ValueError("prompt_template is not a format string; write literal braces as '{{' and '}}'") from None
        if "prompt" not in fields:
            raise ValueError("prompt_template must contain '{prompt}', e.g. 'Question: {prompt}\\nAnswer:'")
        unknown = fields - {"prompt", *self.extra_columns}
        if unknown:
            raise ValueError(f"prompt_template names {sorted(unknown)}, which are not in extra_columns; add them "
                             f"there or write literal braces as '{{{{' and '}}}}'")
        return self


class ReasoningGymTaskConfig(StrictModel):
    """A reasoning-gym procedural dataset (basic_arithmetic, gsm_symbolic, countdown, maze, sokoban, ...):
    ``size`` questions generated offline from ``seed`` with the dataset's own ``config``; the dataset's scorer
    is the reward. Needs the ``reasoning-gym`` extra."""

    type: Literal["reasoning-gym"] = "reasoning-gym"
    dataset: str = Field(description="A reasoning-gym dataset name, e.g. 'basic_arithmetic' (an unknown name is "
                         "refused with the list of known ones, when coordinator.tasks checks the task before a run "
                         "starts: the library takes seconds to import, which validating a config never pays).")
    size: int = Field(2000, ge=1, le=1_000_000, description="Questions generated for training.")
    seed: int = Field(0, description="Seed of the generator: the same seed gives the same questions on every "
                      "role and every restart.")
    heldout_size: int = Field(128, ge=1, le=100_000, description="Further questions, generated after the training "
                              "ones and never equal to any of them, held out for evaluation.")
    config: dict[str, Any] = Field(default_factory=dict, description="The dataset's own settings (its config "
                                   "dataclass's fields, e.g. max_digits = 2 for basic_arithmetic).")
    prompt_template: str = Field("{question}", description="Formats the question (the user message, with "
                                 "chat_template), e.g. 'Q: {question} A:'; the item's metadata may be named too, "
                                 "e.g. '{metadata[expression]}' for basic_arithmetic.")
    chat_template: bool = Field(False, description="Render the prompt with the model's own chat template: for "
                                "instruct models (ask for the answer inside <answer></answer> in system_prompt).")
    system_prompt: str | None = Field(None, description="A system message before the question (chat_template "
                                      "only).")
    tokenizer_path: Path | None = Field(None, description="Folder whose tokenizer files hold the chat template "
                                        "(default: model.path).")

    @field_validator("tokenizer_path")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _known_dataset(self) -> ReasoningGymTaskConfig:
        if not self.chat_template and self.system_prompt is not None:
            raise ValueError("system_prompt needs chat_template = true (or write the instruction into "
                             "prompt_template)")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        except ValueError:
            raise ValueError("prompt_template is not a format string; write literal braces as '{{' and '}}'") from None
        roots = {re.split(r"[.\[]", f, maxsplit=1)[0] for f in fields}
        if not fields or not roots <= {"question", "metadata"}:
            raise ValueError("prompt_template may name only the item's '{question}' and its metadata (e.g. "
                             "'{metadata[expression]}'), and must name one, e.g. 'Q: {question} A:' (write literal "
                             "braces as '{{' and '}}')")
        return self


class EnvironmentTaskConfig(StrictModel):
    """Multi-turn episodes in a built-in environment (shared.envs: gridworld, sokoban), verified by replay: the
    coordinator replays every episode's actions in its own copy from the job's seed and computes the reward."""

    type: Literal["environment"] = "environment"
    env: str = Field("gridworld", description="The environment: gridworld | sokoban.")
    params: dict[str, Any] = Field(default_factory=dict, description="The environment's parameters, e.g. "
                                   "{width = 3, height = 3} for gridworld, {size = 6, boxes = 1} for sokoban.")
    max_turns: int = Field(4, ge=1, le=64, description="Turns per episode at most (sampling.max_tokens per turn).")
    max_observation_tokens: int = Field(64, ge=1, le=1024, description="Tokens of one observation at most.")
    episodes: int = Field(4096, ge=2, le=1_000_000, description="Episode seeds drawn (0..episodes-1); starts that "
                          "repeat an earlier seed's first observation are dropped.")
    heldout_size: int = Field(16, ge=1, description="Distinct starting states held out from training, for "
                              "evaluation.")
    split_seed: int = Field(0, description="Seed of the train/held-out shuffle of the starting states.")
    prompt_template: str = Field("{observation}", description="Formats the first observation into the prompt; "
                                 "must contain '{observation}'.")

    @model_validator(mode="after")
    def _known(self) -> EnvironmentTaskConfig:
        try:
            parse_params(self.env, self.params)
        except EnvError as exc:
            raise ValueError(str(exc)) from None
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        except ValueError:
            raise ValueError("prompt_template is not a format string; write literal braces as '{{' and '}}'") from None
        if fields != {"observation"}:
            raise ValueError("prompt_template must contain '{observation}' and no other field, e.g. "
                             "'Reach the goal.\n{observation}'")
        return self


TaskConfig = Annotated[ArithmeticTaskConfig | JsonlTaskConfig | DatasetTaskConfig | ReasoningGymTaskConfig
                       | EnvironmentTaskConfig,
                       Field(discriminator="type")]
