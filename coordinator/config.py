"""Coordinator configuration: one pydantic model per concern, loaded from TOML, overridable by CLI flags.

Every model forbids unknown keys, so a typo in a config file is an error that names the key rather than
a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coordinator.core.scheduling import SyncPolicy
from coordinator.errors import MissingDependency
from coordinator.limits import MAX_MESSAGE_BYTES, body_cap, result_size_cap
from shared.envs import EnvError, parse_params
from shared.errors import EchoSwarmError
from shared.messages import MAX_COMPLETIONS


class ConfigError(EchoSwarmError):
    """A configuration file or flag is invalid; the message names the key and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Which policy to train."""

    path: str = Field(
        "tiny",
        description="A local Hugging Face model folder (config.json, *.safetensors, tokenizer files), or "
        "'tiny' for the built-in ~1M-parameter Qwen2 model warm-started on the arithmetic task.",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="Where the learner runs.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the learner (unless "
                                                  "learner.precision = 'bf16') and of the verifier's replicas.")


class ArithmeticTaskConfig(_Strict):
    """Two-operand addition, 'Q: a+b= A:' → ' a+b'. Sized for the tiny model."""

    type: Literal["arithmetic"] = "arithmetic"
    max_operand: int = Field(99, ge=1, le=9999, description="Operands are drawn from 0..max_operand.")
    heldout_size: int = Field(512, ge=16, description="Prompts held out from all training, for evaluation.")
    split_seed: int = Field(0, description="Seed of the fixed train/held-out split.")


class JsonlTaskConfig(_Strict):
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


class RewardConfig(_Strict):
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


class DatasetTaskConfig(_Strict):
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


class ReasoningGymTaskConfig(_Strict):
    """A reasoning-gym procedural dataset (basic_arithmetic, gsm_symbolic, countdown, maze, sokoban, ...):
    ``size`` questions generated offline from ``seed`` with the dataset's own ``config``; the dataset's scorer
    is the reward. Needs the ``reasoning-gym`` extra."""

    type: Literal["reasoning-gym"] = "reasoning-gym"
    dataset: str = Field(description="A reasoning-gym dataset name, e.g. 'basic_arithmetic' (an unknown name is "
                         "refused with the list of known ones).")
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
        check_reasoning_gym_dataset(self.dataset, self.config)
        return self


class EnvironmentTaskConfig(_Strict):
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


class LearnerConfig(_Strict):
    """GRPO with a PPO-style clipped ratio; one optimiser step per policy version."""

    lr: float = Field(1e-4, gt=0, lt=1, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip: ratios outside 1±clip_eps stop the gradient.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="GRPO groups per optimiser step.")
    group_size: int = Field(8, ge=2, le=64, description="Samples per prompt; advantages are normalised within a group.")
    max_steps: int = Field(200, ge=0, description="Optimiser steps (= policy versions) before the run finishes.")
    correction: Literal["behaviour-clip", "decoupled", "m2po", "none"] = Field(
        "behaviour-clip", description="Correction for rollouts not sampled by this step's policy: stale ones "
        "(async mode) and quantised ones (a llama.cpp or bf16 client's π_b is its own precision's, never πθ; a "
        "fresh torch float32 rollout trains as plain GRPO under every choice). behaviour-clip: PPO's clipped ratio "
        "πθ/π_b anchored at the policy that generated the rollout, so tokens earlier steps already moved past "
        "1±clip_eps get no further push. decoupled (AReaL; Yao et al.'s truncated importance sampling for a "
        "quantised sampler): the clip around this step's policy, times the truncated weight min(is_cap, π_prox/π_b). "
        "m2po (M2PO, arXiv 2510.01161): the unclipped ratio πθ/π_b, with the fewest tokens of largest "
        "(log πθ/π_b)² masked so that the batch's mean of it stays within m2_threshold; for large max_staleness. "
        "none: every rollout trained as if this step's policy had sampled it (the ablation baseline: biased "
        "for stale or quantised rollouts).")
    m2_threshold: float = Field(0.04, gt=0, le=10, description="m2po only: bound τ on the batch's mean of "
                                "(log πθ/π_b)² over the tokens trained on (the paper's and AReaL's 0.04); tokens "
                                "with the largest squares are masked until it holds (step metric "
                                "m2po_masked_fraction).")
    is_cap: float = Field(2.0, ge=1.0, description="Bound on the importance ratio: behaviour-clip cuts πθ/π_b at "
                          "is_cap for negative advantages (dual clip); decoupled truncates π_prox/π_b at is_cap "
                          "(1 means ratios above 1 are cut to 1).")
    is_level: Literal["token", "sequence"] = Field(
        "token", description="Decoupled correction only: importance weight per token (π_prox/π_b of that token) or "
        "per sequence (the product over the whole completion, the same weight on every token, truncated at is_cap).")
    staleness_decay: float = Field(1.0, gt=0, le=1, description="Loss weight decay^staleness per rollout "
                                   "(1: stale rollouts count fully, relying on the importance correction).")
    seed: int = Field(0, description="Seeds prompt selection and per-job sampling seeds.")
    eval_every: int = Field(25, ge=0, description="Held-out evaluation every N steps (0: only first and last).")
    eval_size: int = Field(512, ge=1, description="Held-out prompts per evaluation (capped by the task's held-out set).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads for the learner (default: torch's choice).")
    lora_rank: int = Field(0, ge=0, le=1024, description="0: train all weights. r > 0: train rank-r LoRA adapters "
                           "(peft) on lora_targets with the base frozen; the base is published once per run and "
                           "clients (torch and llama.cpp) then fetch only a small adapter per version. 4 is a "
                           "sensible start (adapter ≈ 0.7 % of the tiny model, far less for larger ones).")
    lora_alpha: float = Field(8.0, gt=0, description="LoRA scale numerator: the update is alpha/r · B·A.")
    lora_targets: list[str] = Field(["q_proj", "v_proj"], min_length=1, max_length=16,
                                    description="Linear modules that get adapters (Qwen2/Llama names).")
    checkpoint_every_steps: int = Field(10, ge=0, description="Write a learner checkpoint (trainable weights and "
                                        "optimizer state) every N steps (0: no step-count trigger). A restart "
                                        "resumes from the newest checkpoint and replays the steps recorded since "
                                        "(docs/run-dir.md); fewer checkpoints cost less disk and I/O, more replay.")
    checkpoint_every_s: float = Field(600.0, ge=0, description="Also write a checkpoint when this many seconds "
                                      "have passed since the last one (0: no time trigger).")
    world_size: int = Field(1, ge=1, le=1024, description="Learner ranks (torch.distributed): the learner role "
                            "starts world_size - 1 more processes and shards the model over all of them with FSDP2 "
                            "(one GPU each on CUDA, gloo on CPU). Started under torchrun, the ranks come from "
                            "torchrun instead (leave this at 1 or set it to torchrun's count).")
    fsdp: bool | None = Field(None, description="Shard the model with FSDP2 (torch fully_shard). None: when "
                              "world_size > 1. true with world_size = 1: FSDP over one device (for mixed precision "
                              "on one GPU).")
    mixed_precision: Literal["off", "bf16"] = Field("off", description="With FSDP: bf16 parameters and compute, "
                                                    "float32 gradient reduction, weights and optimizer. Needs "
                                                    "model.dtype = float32 (the float32 master weights).")
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in the backward "
                                           "pass instead of keeping them (less memory, about one more forward).")
    precision: Literal["float32", "bf16"] = Field(
        "float32", description="float32: torch's AdamW over model.dtype weights (16 B/param of weights, gradients "
        "and moments in float32). bf16: weights, gradients and both AdamW moments in bfloat16 (8 B/param), every "
        "update stochastically rounded so that small steps add up as in float32 on average "
        "(coordinator.engine.bf16_adamw; learning compared in docs/benchmarks.md). One device, full weights; the "
        "verifier still computes in model.dtype.")

    @model_validator(mode="after")
    def _some_checkpoint_trigger(self) -> LearnerConfig:
        if self.checkpoint_every_steps == 0 and self.checkpoint_every_s == 0:
            raise ValueError("learner.checkpoint_every_steps and learner.checkpoint_every_s are both 0, so a restart "
                             "would replay the whole run; set either (e.g. checkpoint_every_steps = 10)")
        return self

    @model_validator(mode="after")
    def _ranks_need_fsdp(self) -> LearnerConfig:
        if self.world_size > 1 and self.fsdp is False:
            raise ValueError(f"learner.world_size = {self.world_size} shards the model with FSDP; remove "
                             f"learner.fsdp = false, or set world_size = 1")
        if self.mixed_precision != "off" and not self.sharded:
            raise ValueError("learner.mixed_precision needs FSDP: set learner.fsdp = true (FSDP over one device) or "
                             "learner.world_size > 1; for bf16 everywhere set model.dtype = 'bfloat16' instead")
        return self

    @property
    def sharded(self) -> bool:
        """Whether the learner runs under torch.distributed with FSDP2 (coordinator.engine.fsdp)."""
        return bool(self.fsdp) or (self.fsdp is None and self.world_size > 1)

    @model_validator(mode="after")
    def _bf16_precision_on_one_device(self) -> LearnerConfig:
        if self.precision != "bf16":
            return self
        if self.sharded:
            raise ValueError("learner.precision = 'bf16' trains on one device; on FSDP ranks use "
                             "learner.mixed_precision = 'bf16' (bf16 compute over float32 master weights) instead, "
                             "or set learner.world_size = 1 and remove learner.fsdp")
        if self.lora_rank > 0:
            raise ValueError("learner.precision = 'bf16' keeps all weights and their AdamW state in bfloat16; with "
                             "LoRA only the small adapters train: set learner.precision = 'float32' (and model.dtype "
                             "= 'bfloat16' to hold the frozen base in bfloat16), or learner.lora_rank = 0")
        return self

    @model_validator(mode="after")
    def _sequence_weight_needs_decoupled(self) -> LearnerConfig:
        if self.is_level == "sequence" and self.correction != "decoupled":
            raise ValueError("learner.is_level = 'sequence' weights the decoupled correction only; set "
                             "learner.correction = 'decoupled' as well, or leave is_level at 'token'")
        return self


class SamplingConfig(_Strict):
    """How clients sample: the full softmax at a temperature (no truncation, so logprobs are exact)."""

    temperature: float = Field(1.0, gt=0, le=4)
    max_tokens: int = Field(8, ge=1, le=4096, description="New tokens per completion, at most.")


class JobsConfig(_Strict):
    prompts_per_job: int = Field(8, ge=1, le=256, description="Prompts (GRPO groups) per leased job.")
    lease_timeout_s: float = Field(120.0, gt=0, description="Seconds a client has to return a leased job before it is reissued.")
    retry_after_s: float = Field(0.5, gt=0, le=60, description="Seconds an idle client is told to wait before asking again.")
    long_poll_s: float = Field(10.0, ge=0, le=25, description="Seconds a lease request waits for a job before "
                               "answering 'none yet' (must stay below the clients' 30 s request timeout).")
    speed_aware: bool = Field(True, description="Give free queue slots to the clients expected to return soonest, "
                              "and in async-push-pull only jobs a client can return while they are within "
                              "max_staleness, no earlier than the learner needs them (core.pacing). Off: first "
                              "come, first served, filling the queue to max_staleness.")
    secret_plans: bool = Field(True, description="Key every job's prompts and sampling seed with a secret of this "
                               "run (kept in its database): the seed is the job's secret sampling key (shared.sampler), "
                               "so a client cannot compute another job's sampling noise, nor its own before it holds "
                               "the lease. Off: plans follow from learner.seed alone, so two runs with one seed draw "
                               "the same jobs (the demo and the benchmarks that compare sync modes run by run).")


class BackendTolerance(_Strict):
    mean_tol: float = Field(gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    max_tol: float = Field(gt=0, description="Max |Δ logprob| of any single token (nats).")
    choice_tol: float | None = Field(None, gt=0, description="Largest keyed-sampler margin of any token, in logit "
                                     "units (÷ the job's temperature); None: verification.choice_tol.")


# Keyed-sampler margins (shared.sampler), in logit units: the check divides them by the job's temperature, as an
# honest margin is the two implementations' logit difference at a near-tie, divided by T. Torch clients are
# recomputed by torch from the same safetensors: margins exactly 0 (bit-identical logits), 0.02 leaves room for
# other devices' arithmetic. llama.cpp clients are recomputed by llama.cpp on the very GGUF file they ran
# (coordinator.engine.llama_verifier), replaying the client's own evaluations (prompt prefill, then one token at a
# time), so the kernels and their rounding are the client's. Source: tests/integration/test_llama_verifier.py and
# bench/choice_calibration.py --verifier own (docs/benchmarks.md, "Quantised volunteers"): 3,000 honest results at
# f16, q8_0, q6_K, q5_K_M, q4_K_M and q4_0, T 1.0 and 0.7, not one token off the keyed argmax, per-token |Δ logprob|
# ≤ 2e-6. The tolerance 0.1 is headroom for hardware the calibration has not seen (a CUDA or Metal client against a
# CPU verifier is unmeasured: docs/security.md §4; operators watch echo_swarm_choice_margin_ratio). Before issue 36 llama.cpp results were
# checked against a torch float32 recompute, and the quantisation itself had to pass: f16 0.5, q8_0 2.5.
CHOICE_TOL_TORCH = 0.02
CHOICE_TOL_LLAMA = 0.1

#: The GGUF precisions a run can publish (snapshots.gguf; coordinator.publish.gguf_export writes f32 and f16,
#: llama.cpp's quantiser the rest), each a backend class of llama.cpp results, "llama-<precision>".
GGUF_PRECISIONS = ("f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0")

# Logprob check of llama.cpp results against the same own-precision recompute: the reported logprobs are
# log_softmax of the very logits the verifier recomputes, so torch's tolerances hold (measured ≤ 2e-6 per token).
LLAMA_TOLERANCES: dict[str, BackendTolerance] = {
    f"llama-{p}": BackendTolerance(mean_tol=0.05, max_tol=1.0, choice_tol=CHOICE_TOL_LLAMA) for p in GGUF_PRECISIONS
}

# torch clients computing in bf16 (class "torch-bf16"), recomputed by the verifier in bf16 replaying the client's
# generations (coordinator.engine.torch_replay: prefill together, then one token at a time, same rows). Source:
# bench/choice_calibration.py --classes torch-bf16 --verifier own and tests/integration/test_torch_replay.py
# (docs/benchmarks.md, "torch clients computing in bf16"): on the same kind of CPU the replay has the client's logits
# bit for bit — margins 0, |Δ logprob| 0 over 1,800 results. What the replay cannot make equal is other hardware (a
# CUDA or MPS bf16 client against a CPU verifier: unmeasured, docs/security.md §4); on one CPU, bf16 arithmetic in
# another schedule (one teacher-forced pass) moved honest tokens by up to 0.047 logit and 0.11 nats, so the class gets
# the llama.cpp classes' 0.1 (about twice that), not torch's 0.02. Judged by the float32 pass instead, honest bf16
# results had margins up to 0.53 logit and about half were refused at torch's 0.02: a bf16 result must be recomputed
# in bf16.
CHOICE_TOL_TORCH_BF16 = 0.1
TORCH_TOLERANCES: dict[str, BackendTolerance] = {
    "torch-bf16": BackendTolerance(mean_tol=0.05, max_tol=1.0, choice_tol=CHOICE_TOL_TORCH_BF16),
}


def _cuda_device(device: str) -> bool:
    """'cuda' or 'cuda:K'."""
    kind, _, index = device.partition(":")
    return kind == "cuda" and (not index or index.isdigit())


class VerificationConfig(_Strict):
    """Checks of reported behaviour logprobs against the verifier's recompute, and the verifier itself."""

    logprob_mean_tol: float = Field(0.05, gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    logprob_max_tol: float = Field(1.0, gt=0, description="Max |Δ logprob| of any single token (nats).")
    # Source: bench/sampling_calibration.py (docs/benchmarks.md, "Sampling test calibration"): 0 of 5,136 honest torch
    # and 5,012 llama.cpp (f16, q8_0) results refused at these defaults; honest |z| ≤ 4.08, |z_top| ≤ 3.39 seen.
    sampling_check: bool = Field(True, description="Refuse results whose tokens are far more or less surprising "
                                 "under the policy than sampling at the job's temperature makes them "
                                 "(reason sampling_mismatch; coordinator.core.verify.check_sampling).")
    sampling_z_low: float = Field(-6.0, lt=0, description="Lowest accepted z of a result's summed surprisal minus "
                                  "summed entropy (in standard deviations). Below it: greedy or cherry-picked.")
    sampling_z_high: float = Field(8.0, gt=0, description="Highest accepted z. Above it: tokens the policy would "
                                   "rarely sample (forced or junk). Higher than |z_low| because the surprisal of "
                                   "a sampled token has a long upper tail.")
    sampling_top_z: float = Field(6.0, gt=0, description="Largest accepted |z| of how often a result's tokens are "
                                  "the policy's likeliest, against how often sampling picks them. Above: greedy "
                                  "or cherry-picked; below minus it: forced tokens.")
    sampling_min_tokens: int = Field(64, ge=1, description="Results with fewer completion tokens are not judged by "
                                     "the sampling test (z is only near-normal over many tokens).")
    sampling_var_floor: float = Field(0.02, ge=0, description="Per-token variance added to the denominators of "
                                      "both z-scores (nats² for surprisal), so near-deterministic positions and "
                                      "float rounding across backends cannot produce a large z from nothing.")
    choice_check: bool = Field(True, description="Refuse results with a token that is not the job's keyed sampler's "
                               "choice from the verifier's logits (reason choice_mismatch; shared.sampler, "
                               "coordinator.core.verify.check_choices). Every token of every backend is checked.")
    choice_tol: float = Field(CHOICE_TOL_TORCH, gt=0, description="Largest accepted keyed-sampler margin of any "
                              "token for torch clients, in logit units: its noised score may lie this much ÷ the "
                              "job's temperature below the best one at its position. llama.cpp classes: "
                              "backend_tolerances.")
    request_window_s: float = Field(300.0, gt=0, description="Accepted clock skew of signed requests (seconds).")
    device: str = Field("auto", description="Device of the verifier's model replica ('cpu', 'cuda:1', ...); "
                        "'auto' uses model.device. Put it on another GPU than the learner's to keep the learner's "
                        "device for training only.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of each verifier process (default: "
                                "learner.threads, else torch's choice). On a CPU-only host the learner and the "
                                "verifiers share the cores: keep their sum near the core count.")
    workers: int = Field(1, ge=1, le=16, description="Verifier processes `echo-swarm coordinator` starts (the "
                         "process layout). Each holds its own model replicas on `device`; results are shared "
                         "among them through the store.")
    claim_s: float = Field(60.0, gt=0, le=3600, description="Seconds a verifier's claim on a request lasts without "
                           "renewal; a request claimed by a verifier that died is taken by another after this.")
    wait_s: float = Field(600.0, gt=0, le=7200, description="Longest wait of the API for a verifier's answer; "
                          "past it the client is told to resend (HTTP 503) and nothing is recorded.")
    cached_versions: int = Field(1, ge=1, le=8, description="Policy versions the verifier keeps loaded at once "
                                 "(each a full model replica). 1 reloads a version's weights whenever results of "
                                 "another version arrive; 2 suits async push-pull with results of two versions.")
    placement: Literal["replicas", "fsdp"] = Field("replicas", description="How each verifier worker holds the "
                                                   "model: 'replicas' (one process, a whole replica on `device`) or "
                                                   "'fsdp' (a group of `world_size` ranks sharding each version "
                                                   "with FSDP2 and splitting each recompute batch among them; rank 0 "
                                                   "talks to the store, coordinator.engine.fsdp).")
    world_size: int = Field(1, ge=1, le=64, description="Ranks of each verifier worker with placement 'fsdp' (one "
                            "GPU each on CUDA, rank r on cuda:K+r for device 'cuda:K'; gloo processes on CPU).")
    mixed_precision: Literal["off", "bf16"] = Field("off", description="With placement 'fsdp': gather parameters "
                                                    "and compute in bf16 (as learner.mixed_precision does); the "
                                                    "tolerances above are unchanged.")
    backend_tolerances: dict[str, BackendTolerance] = Field(
        default_factory=lambda: LLAMA_TOLERANCES | TORCH_TOLERANCES,
        description="Per recompute class ('llama-f16', 'llama-q4_K_M', ...: 'llama-' and a published GGUF "
        "precision; 'torch-bf16'): tolerances that replace the ones above for results recomputed that way — "
        "llama.cpp clients' results, recomputed with llama.cpp on the very GGUF file their lease named, and torch "
        "clients' computed in bf16, whose generations the verifier replays in bf16. The class follows from the "
        "identity's pinned backend and the lease's precision, which must be one the run offers.")

    @model_validator(mode="after")
    def _ranks_need_fsdp_placement(self) -> VerificationConfig:
        if self.world_size > 1 and self.placement != "fsdp":
            raise ValueError(f"verification.world_size = {self.world_size} shards each verifier over ranks: set "
                             f"verification.placement = 'fsdp', or world_size = 1 (more single-device verifiers: "
                             f"verification.workers)")
        if self.mixed_precision != "off" and self.placement != "fsdp":
            raise ValueError("verification.mixed_precision needs verification.placement = 'fsdp'; for bf16 "
                             "replicas set model.dtype = 'bfloat16' instead")
        if self.placement == "fsdp" and self.device not in ("auto", "cpu") and not _cuda_device(self.device):
            raise ValueError(f"verification.placement = 'fsdp' puts rank r on cuda:(K + r) for device 'cuda:K' "
                             f"(or runs gloo ranks on the CPU), so verification.device must be 'auto', 'cpu', "
                             f"'cuda' or 'cuda:K', not {self.device!r}")
        return self

    def tolerances(self, rclass: str) -> tuple[float, float]:
        """(mean, max) |Δ logprob| allowed for a result recomputed as ``rclass`` (core.trust.recompute_class:
        "torch", "llama-q4_K_M", ... — from the identity's pinned class and the precision its lease named, never
        from the result's own claim)."""
        tol = self.backend_tolerances.get(rclass)
        return (tol.mean_tol, tol.max_tol) if tol is not None else (self.logprob_mean_tol, self.logprob_max_tol)

    def choice_tolerance(self, rclass: str) -> float:
        """The largest keyed-sampler margin accepted from a result recomputed as ``rclass`` (as :meth:`tolerances`)."""
        tol = self.backend_tolerances.get(rclass)
        return tol.choice_tol if tol is not None and tol.choice_tol is not None else self.choice_tol


#: What an old config may still name from the spot-check era, and why it is refused rather than ignored: a key
#: that no longer does anything must not look like it still protects the run.
RETIRED_TRUST_KEYS = ("trusted_after", "min_replication_rate", "spot_checks", "hold_s", "active_window_s",
                      "replica_min_agreement", "replicator_min_valid", "registration_burst_s")
RETIRED_MESSAGE = ("spot-checks were retired: every token is now checked by the keyed sampler (docs/security.md); "
                   "delete this key from the config")


class TrustConfig(_Strict):
    """Trust and quarantine per identity (coordinator.core.trust), and the reporting rule
    (coordinator.core.reporting) for what the keyed sampler cannot see."""

    quarantine_after: int = Field(3, ge=1, le=1000, description="Invalid results in a row that quarantine a client.")
    quarantine_s: float = Field(600.0, ge=0, description="Seconds of the first quarantine; the n-th lasts n times "
                                "as long.")
    reporting_min_leases: int = Field(40, ge=1, le=1_000_000, description="Leases an identity must have been "
                                      "granted before its reporting is judged (coordinator.core.reporting).")
    reporting_max_unreturned: float = Field(0.25, ge=0.0, lt=1.0, description="Share of an identity's leases that "
                                            "may end without a result (released, or run out) before the rewards "
                                            "of what it returns are compared with the expectation.")
    reporting_min_results: int = Field(20, ge=1, le=1_000_000, description="Results of its own, at versions where "
                                       "others returned results too, before that comparison counts.")
    reporting_reward_z: float = Field(4.0, gt=0, description="Standard errors above the other volunteers' rewards "
                                      "at the same versions that, with the unreturned share past its threshold, "
                                      "flag the identity (selective reporting): its trust resets, and every "
                                      "quarantine_after-th flag quarantines it.")
    reporting_cooldown_s: float = Field(600.0, ge=0, description="Seconds between two such lowerings of one "
                                        "identity's trust (the same evidence is counted once per period).")

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            named = [k for k in RETIRED_TRUST_KEYS if k in data]
            if named:
                raise ValueError(f"trust.{', trust.'.join(named)}: {RETIRED_MESSAGE}")
        return data


class LimitsConfig(_Strict):
    """Request rate limits (token buckets). A rate of 0 turns that limit off."""

    per_identity_rps: float = Field(20.0, ge=0, description="Signed requests per second per client identity.")
    per_identity_burst: float = Field(60.0, ge=1, description="Requests one identity may send at once.")
    per_address_rps: float = Field(200.0, ge=0, description="Requests per second per remote address (all "
                                   "identities behind one address together; raise it for NATed labs).")
    per_address_burst: float = Field(400.0, ge=1, description="Requests one address may send at once.")
    registrations_per_address_per_min: float = Field(30.0, ge=0, description="New registrations per minute per "
                                                     "remote address (stops identity floods).")
    registration_burst: float = Field(20.0, ge=1, description="Registrations one address may make at once.")
    new_identities_per_min: float = Field(120.0, ge=0, description="New identities per minute, all addresses "
                                          "together (a global sign-up rate: a flood from many addresses is bounded "
                                          "by it). 0: unlimited.")
    new_identity_burst: float = Field(60.0, ge=1, description="New identities the whole swarm may register at "
                                      "once.")
    max_leases_per_client: int = Field(2, ge=1, le=1024, description="Live leases one identity may hold at once; "
                                       "beyond it a lease request gets no job, so "
                                       "nobody can hoard the queue.")


class RegistrationConfig(_Strict):
    """Who may join: anyone (open), or holders of an invite token (private swarms)."""

    mode: Literal["open", "invite"] = Field("open", description="'invite': registering needs a token whose "
                                            "sha256 is listed in invite_sha256.")
    max_idle_identities: int = Field(10_000, ge=1, le=10_000_000, description="Identities that never had a "
                                     "result accepted the store keeps; past it the longest-idle ones are removed "
                                     "(they re-register if they come back), so sign-ups cannot grow the store "
                                     "without bound. Banned, quarantined and lease-holding ones are kept.")
    invite_sha256: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        default_factory=list, description="sha256 (hex) of each valid invite token; only hashes are stored. "
        "Make one with: python -c \"import secrets,hashlib;t=secrets.token_urlsafe(32);print(t, "
        "hashlib.sha256(t.encode()).hexdigest())\"")

    @model_validator(mode="after")
    def _invites_exist(self) -> RegistrationConfig:
        if self.mode == "invite" and not self.invite_sha256:
            raise ValueError("registration.mode is 'invite' but registration.invite_sha256 is empty; add the "
                             "sha256 of at least one token, or set mode = 'open'")
        return self


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Listen address. Use 0.0.0.0 to accept volunteers from the network.")
    port: int = Field(8470, ge=0, le=65535, description="Listen port (0: pick a free one).")
    # Bounded connections (coordinator.core.connections, coordinator.api.netguard; docs/operations.md)
    max_connections: int = Field(0, ge=0, le=1_000_000, description="Open connections at most, all clients "
                                 "together. 0: derived from the file limit (raised to its hard limit at start): "
                                 "(limit - reserved_fds - 512 for accepts in flight) / 2. When full, an idle or stalled connection gives up its "
                                 "place to a newcomer; if none can, the newcomer is answered 503.")
    reserved_fds: int = Field(256, ge=32, le=100_000, description="File descriptors kept free of connections for "
                              "the database, snapshots, checkpoints and the learner.")
    max_connections_per_address: int = Field(64, ge=1, le=1_000_000, description="Open connections per remote IPv4 "
                                             "address or IPv6 /64 (raise it when many volunteers share one NAT). "
                                             "Over it, that address's own idle or stalled connection makes room, "
                                             "else the newcomer is answered 429.")
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="Seconds a connection has from connecting (or "
                                    "from the first byte of a request) to deliver the request's headers.")
    body_timeout_s: float = Field(120.0, gt=0, le=3600, description="Seconds a request body may take to arrive in "
                                  "full (8 MiB, the largest result, at 70 KB/s).")
    keepalive_timeout_s: float = Field(30.0, gt=0, le=3600, description="Seconds an idle keep-alive connection is "
                                       "kept open between requests (above the clients' own 15 s).")
    send_timeout_s: float = Field(60.0, gt=0, le=3600, description="Seconds a reply may wait on a client that does "
                                  "not read it before the connection is closed.")
    public_reads_per_address_rps: float = Field(10.0, ge=0, description="GET /v1/status and /metrics per second per "
                                                "address (0: unlimited); over it: 429.")
    public_reads_burst: float = Field(30.0, ge=1, description="Status/metrics reads one address may make at once.")
    public_cache_s: float = Field(1.0, ge=0, le=60, description="Seconds a built /v1/status or /metrics reply is "
                                  "reused for every reader (rebuilt sooner when the policy version changes).")

    @model_validator(mode="after")
    def _address_cap_within_total(self) -> ServerConfig:
        if self.max_connections and self.max_connections_per_address > self.max_connections:
            raise ValueError(f"server.max_connections_per_address ({self.max_connections_per_address}) exceeds "
                             f"server.max_connections ({self.max_connections}); lower it, or raise max_connections "
                             f"(0 derives it from the file limit)")
        return self


class SnapshotConfig(_Strict):
    keep_last: int = Field(4, ge=1, description="Published versions kept on disk (older ones are pruned).")
    dtype: Literal["training", "float32", "bfloat16", "float16"] = Field(
        "training", description="Precision of the published safetensors weights: 'training' is model.dtype. "
        "bfloat16 halves the bytes every client downloads and the coordinator writes per version; clients and "
        "the verifier then compute with the rounded weights, which differ from the learner's float32 ones "
        "(docs/benchmarks.md, 'Real model size', measures the logprob gap). Recommended at real model size.")
    keep_exports: int = Field(3, ge=1, description="Operator exports (`echo-swarm admin checkpoint`, exports/) "
                              "kept; older ones are deleted when a version is published.")
    gguf: Literal["off", "f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"] = Field(
        "f16", description="Also publish every version as GGUF for llama.cpp clients, at this precision "
        "(off: safetensors only, torch clients). f32 and f16 are written by the coordinator; q8_0, q6_K, q5_K_M, "
        "q4_K_M and q4_0 by llama.cpp's own quantiser from the f16 file (coordinator.publish.quantise; needs "
        "llama-cpp-python on the coordinator). Every precision is checked equally tightly: a llama.cpp result "
        "is recomputed by llama.cpp on the very file the client ran (coordinator.engine.llama_verifier). q4_K_M "
        "is ~0.31x the bytes of f16: a 7 B policy in ~4.4 GB, for 8 GB GPUs and 16 GB Macs (README).")
    gguf_also: list[Literal["f32", "f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"]] = Field(
        default_factory=list, max_length=6, description="More precisions offered beside snapshots.gguf, each "
        "published per version as model.<precision>.gguf (with its own patches), e.g. ['q4_K_M'] so that 8 GB "
        "volunteers can join a 7 B run that others run at f16. A llama.cpp client takes the best offered "
        "precision that fits its memory (`join --precision auto`) and names it in its lease; its result is "
        "recomputed on that very file. Full-weight runs only (a LoRA run publishes one base GGUF).")
    deltas: bool = Field(True, description="Also publish each full-weight version's model.safetensors and model.gguf "
                         "as a patch against the previous version (changed elements only, zstd; docs/protocol.md §6), "
                         "so a client holding that version downloads a few per cent of the file instead of all of it. "
                         "A client that cannot use a patch fetches the full file, which is always published.")
    anchor_every: int = Field(50, ge=1, description="Every this many versions is a full anchor, published without "
                              "patches: no client rebuilds a version through a chain of more than anchor_every - 1 "
                              "patches (1: never publish patches).")
    lag_tolerance: float = Field(0.5, description="Lazy publication between anchors (with deltas, 16-bit "
                                 "snapshots; coordinator/publish/lazy.py): an element of a bfloat16/float16 snapshot is "
                                 "republished only when its rounding of the learner's float32 weight moved more than "
                                 "lag_tolerance x eps x the tensor's RMS away from the published value (eps: 2^-7 for "
                                 "bfloat16). 0 publishes every rounding (every element that crossed a rounding "
                                 "boundary: 5-6x the patch bytes at lr 1e-5); anchors always publish the exact rounding. "
                                 "The learner keeps every update; its importance ratio corrects for the lag "
                                 "(docs/benchmarks.md, 'Delta snapshots', measures bytes, policy gap and learning).")
    lag_steps: float = Field(8.0, gt=0, le=1000, description="Caps lazy publication's threshold at lag_steps x "
                             "learner.lr, so that a published weight is never held back by more than about that many "
                             "steps of its movement (a held weight lags along its update: the policy gap grows with "
                             "it; docs/benchmarks.md, 'Lazy publication').")
    piece_kib: int = Field(16384, ge=64, le=262144, description="Piece size of the per-piece hashes in manifests "
                           "(KiB, a power of two): a client fetching from peers checks each piece as it arrives, so a "
                           "bad peer costs at most one piece.")

    @model_validator(mode="after")
    def _offered_once(self) -> SnapshotConfig:
        if self.gguf_also and self.gguf == "off":
            raise ValueError(f"snapshots.gguf_also = {self.gguf_also} offers precisions beside snapshots.gguf, which "
                             f"is 'off': set snapshots.gguf to the default precision (e.g. 'f16'), or gguf_also = []")
        repeated = sorted({p for p in self.gguf_also if p == self.gguf or self.gguf_also.count(p) > 1})
        if repeated:
            raise ValueError(f"snapshots.gguf_also names {', '.join(repeated)} twice (snapshots.gguf is "
                             f"{self.gguf!r}, published anyway): list each further precision once")
        return self

    def offered(self) -> tuple[str, ...]:
        """Every GGUF precision a version is published in, the default (snapshots.gguf, ``model.gguf``) first;
        () when the run publishes no GGUF."""
        return () if self.gguf == "off" else (self.gguf, *self.gguf_also)

    @field_validator("lag_tolerance")
    @classmethod
    def _tolerance(cls, v: float) -> float:
        if not 0 <= v <= 16:
            raise ValueError(f"lag_tolerance must be between 0 (publish every rounding) and 16 (a published weight "
                             f"may lag its master by 16 x eps x the tensor's RMS), not {v}; the default 0.5 holds "
                             f"elements back by about the rounding error of the tensor's typical element")
        return v

    @field_validator("piece_kib")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"piece_kib must be a power of two (e.g. 16384 for 16 MiB), not {v}")
        return v


class P2PConfig(_Strict):
    """Snapshots between volunteers over libp2p (the optional ``p2p`` extra: hivemind 1.1.12; docs/protocol.md §6a).
    The coordinator runs a DHT node, publishes its newest version there and seeds each blob to a few peers, who
    then serve each other; HTTP stays available to every client."""

    enabled: bool = Field(False, description="Run the libp2p peer (needs `pip install 'echo-swarm[p2p]'`).")
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], min_length=1, max_length=8,
                                   description="libp2p listen addresses, e.g. '/ip4/0.0.0.0/tcp/8471' for remote "
                                   "volunteers (default: loopback only).")
    announce_maddrs: list[str] = Field(default_factory=list, max_length=8, description="Addresses volunteers "
                                       "should dial, e.g. '/ip4/203.0.113.7/tcp/8471' (default: the listen ones).")
    seed_peers: int = Field(2, ge=1, le=1000, description="Peers the coordinator serves each blob to over libp2p "
                            "before leaving it to them (k).")
    record_ttl_s: float = Field(300.0, ge=30, le=86_400, description="Lifetime of the signed 'latest version' DHT "
                                "record; it is republished every fifth of this.")
    # the signed calls over libp2p (coordinator.roles.p2p_relay; docs/protocol.md §6b)
    calls: bool = Field(True, description="Also serve the signed calls (register, lease, release, results) on the "
                        "libp2p peer, relayed to the API over loopback HTTP (`join --p2p-jobs`).")
    calls_at_once: int = Field(32, ge=1, le=4096, description="Signed calls relayed at once, all peers together "
                               "(each holds one loopback connection to the API, so server.max_connections_per_address "
                               "caps it too). Over it: 503 rate_limited.")
    calls_per_peer: int = Field(4, ge=1, le=1024, description="Signed calls one libp2p peer may have in flight at "
                                "once. Over it: 429 rate_limited.")
    peers_per_address: int = Field(16, ge=1, le=100_000, description="libp2p peer ids one IP address (its "
                                   "connection's observed address; a relay circuit's relay) may call from within "
                                   "peer_window_s. A peer id costs nothing to make, so over it a new id's call is "
                                   "refused (429 rate_limited); every call is charged to the IP anyway.")
    peer_window_s: float = Field(600.0, gt=0, le=86_400, description="How long a peer id counts towards its "
                                 "address's peers_per_address after its last call.")
    call_timeout_s: float = Field(60.0, ge=30, le=7200, description="Longest wait of the relay for the API's reply "
                                  "to one call (above jobs.long_poll_s); past it the caller gets 503 unavailable "
                                  "and resends.")

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, v: list[str]) -> list[str]:
        for m in v:
            if not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", m):
                raise ValueError(f"{m!r} is not a multiaddr; write e.g. '/ip4/0.0.0.0/tcp/8471'")
        return v


class StoreConfig(_Strict):
    url: str | None = Field(None, description="The run's database. Unset: SQLite, run_dir/coordinator.sqlite (one "
                            "host). postgresql://USER[:PASSWORD]@HOST[:PORT]/DB: a PostgreSQL database that roles on "
                            "several hosts share (API processes on a small VM, learner and verifiers on a GPU "
                            "server; docs/operations.md). Needs pip install 'echo-swarm[postgres]'.")

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"store.url must be a postgresql://USER@HOST:PORT/DATABASE URL (got {v[:40]!r}); "
                             f"leave it unset for the run directory's SQLite database")
        return v


class CoordinatorConfig(_Strict):
    """A whole run. `echo-swarm coordinator --config run.toml` reads this; flags override single keys."""

    run_dir: Path = Field(Path("runs/default"), description="Database, keys, snapshots and checkpoints live here.")
    sync_mode: Literal["sequential-pull", "async-push-pull", "colocated"] = Field(
        "sequential-pull",
        description="sequential-pull: every rollout is generated by the current policy (staleness 0, minimal "
        "bias; the learner waits for clients and clients wait for the learner). async-push-pull: clients keep "
        "generating with the version they hold while the learner trains, within max_staleness versions and with "
        "importance-sampling correction (maximal hardware use). colocated: the learner generates its own "
        "rollouts in-process, no clients (a baseline for comparison).",
    )
    max_staleness: int = Field(2, ge=1, le=64, description="S, in policy versions (async-push-pull only): no rollout "
                               "older than S versions is trained on, and work is issued so none is produced.")
    layout: Literal["processes", "one-process"] = Field(
        "processes", description="processes: the API, the learner and verification.workers verifiers run as "
        "separate processes around the run's database, each restarted if it dies (the API never loads torch). "
        "one-process: all roles in one process (smaller, for the tiny demo and tests). The colocated baseline "
        "always runs in one process.")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = ArithmeticTaskConfig()
    learner: LearnerConfig = LearnerConfig()
    sampling: SamplingConfig = SamplingConfig()
    jobs: JobsConfig = JobsConfig()
    verification: VerificationConfig = VerificationConfig()
    server: ServerConfig = ServerConfig()
    snapshots: SnapshotConfig = SnapshotConfig()
    trust: TrustConfig = TrustConfig()
    limits: LimitsConfig = LimitsConfig()
    registration: RegistrationConfig = RegistrationConfig()
    store: StoreConfig = StoreConfig()
    p2p: P2PConfig = P2PConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_task_type(cls, data: Any) -> Any:
        """A [task] table without 'type' means the default arithmetic task."""
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "type" not in data["task"]:
            data = dict(data) | {"task": {"type": "arithmetic"} | data["task"]}
        return data

    @field_validator("run_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @property
    def completions_per_job(self) -> int:
        return self.jobs.prompts_per_job * self.learner.group_size

    def result_cap(self, n_completions: int) -> int:
        """limits.result_size_cap for this run's jobs (episodes: the task's turns and observation tokens)."""
        task = self.task
        if isinstance(task, EnvironmentTaskConfig):
            return result_size_cap(n_completions, self.sampling.max_tokens, task.max_turns,
                                   task.max_observation_tokens)
        return result_size_cap(n_completions, self.sampling.max_tokens)

    def body_cap(self, path: str) -> int:
        """Largest request body the API (and the p2p role's relay) accepts on ``path`` in this run (limits.body_cap
        with this run's largest job)."""
        return body_cap(path, self.result_cap(self.completions_per_job))

    @model_validator(mode="after")
    def _fits_the_protocol(self) -> CoordinatorConfig:
        per_job = self.completions_per_job
        if per_job > MAX_COMPLETIONS:
            raise ValueError(f"jobs.prompts_per_job × learner.group_size = {per_job} completions per job; the "
                             f"protocol allows {MAX_COMPLETIONS}. Lower prompts_per_job")
        size = result_size_cap(per_job, self.sampling.max_tokens)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"a job of {per_job} completions × {self.sampling.max_tokens} tokens could need "
                             f"{size / 2**20:.1f} MiB per result; the limit is {MAX_MESSAGE_BYTES // 2**20} MiB. "
                             f"Lower jobs.prompts_per_job or sampling.max_tokens")
        return self

    @model_validator(mode="after")
    def _chat_template_has_a_tokenizer(self) -> CoordinatorConfig:
        task = self.task
        if isinstance(task, DatasetTaskConfig | ReasoningGymTaskConfig) and task.chat_template \
                and task.tokenizer_path is None \
                and self.model.path == "tiny":
            raise ValueError("task.chat_template needs a model folder with a chat template; the built-in 'tiny' "
                             "model has none: set model.path (or task.tokenizer_path), or chat_template = false")
        return self

    @model_validator(mode="after")
    def _episodes_need_clients(self) -> CoordinatorConfig:
        if isinstance(self.task, EnvironmentTaskConfig) and self.sync_mode == "colocated":
            raise ValueError("the colocated baseline does not play multi-turn episodes; use sync_mode = "
                             "'sequential-pull' or 'async-push-pull' with task.type = 'environment'")
        if isinstance(self.task, EnvironmentTaskConfig):
            per_job = self.completions_per_job
            t = self.task
            size = self.result_cap(per_job)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"a job of {per_job} episodes × {t.max_turns} turns could need {size / 2**20:.1f} MiB "
                                 f"per result; the limit is {MAX_MESSAGE_BYTES // 2**20} MiB. Lower "
                                 f"jobs.prompts_per_job, task.max_turns, "
                                 f"sampling.max_tokens or task.max_observation_tokens")
        return self

    @model_validator(mode="after")
    def _one_base_gguf_for_lora(self) -> CoordinatorConfig:
        if self.learner.lora_rank > 0 and self.snapshots.gguf_also:
            raise ValueError(f"snapshots.gguf_also = {self.snapshots.gguf_also} is for full-weight runs: a LoRA run "
                             f"publishes one base GGUF (snapshots.gguf) and per-version adapters; set gguf_also = [] "
                             f"or learner.lora_rank = 0")
        return self

    @model_validator(mode="after")
    def _keep_what_staleness_needs(self) -> CoordinatorConfig:
        if self.sync_mode == "async-push-pull" and self.snapshots.keep_last < self.max_staleness + 2:
            raise ValueError(f"snapshots.keep_last ({self.snapshots.keep_last}) must be at least max_staleness + 2 "
                             f"({self.max_staleness + 2}) so that stale results can still be verified")
        return self

    @model_validator(mode="after")
    def _sharded_learner_in_its_own_process(self) -> CoordinatorConfig:
        if not self.learner.sharded:
            return self
        if self.sync_mode == "colocated" or self.layout == "one-process":
            raise ValueError("the learner on FSDP ranks (learner.world_size > 1 or learner.fsdp) runs in its own "
                             "process: use layout = 'processes' and sync_mode sequential-pull or async-push-pull")
        if self.learner.mixed_precision != "off" and self.model.dtype != "float32":
            raise ValueError("learner.mixed_precision = 'bf16' keeps float32 master weights; set model.dtype = "
                             "'float32' (or mixed_precision = 'off' to train in bfloat16 throughout)")
        return self

    @model_validator(mode="after")
    def _verifier_groups_in_their_own_processes(self) -> CoordinatorConfig:
        vcfg = self.verification
        if vcfg.placement != "fsdp":
            return self
        if self.sync_mode == "colocated" or self.layout == "one-process":
            raise ValueError("verification.placement = 'fsdp' runs each verifier as a group of processes: use "
                             "layout = 'processes' and sync_mode sequential-pull or async-push-pull")
        device = self.model.device if vcfg.device == "auto" else vcfg.device
        if device not in ("auto", "cpu") and not _cuda_device(device):
            raise ValueError(f"verification.placement = 'fsdp' needs cuda or cpu ranks, not {device!r}: set "
                             f"verification.device = 'cuda' or 'cpu'")
        if _cuda_device(device):  # the GPUs each group takes must not be another group's or the learner's
            first = int(device.partition(":")[2] or 0)
            if vcfg.workers > 1:
                raise ValueError(f"verification.workers = {vcfg.workers} groups of {vcfg.world_size} ranks would all "
                                 f"take cuda:{first}…: start one group per verifier instead (`echo-swarm coordinator "
                                 f"--role verifier --index i`, each with its own verification.device = 'cuda:K'), "
                                 f"or set verification.workers = 1")
            learner = self.learner.world_size if self.learner.sharded else 1
            if self.model.device == "cuda" and first < learner:
                raise ValueError(f"the learner's ranks use cuda:0…cuda:{learner - 1}; start the verifier group "
                                 f"after them: verification.device = 'cuda:{learner}'")
        if vcfg.mixed_precision != "off" and self.model.dtype != "float32":
            raise ValueError("verification.mixed_precision = 'bf16' casts float32 weights for compute; set "
                             "model.dtype = 'float32' (or mixed_precision = 'off' to verify in model.dtype)")
        return self

    @model_validator(mode="after")
    def _jobs_divide_step(self) -> CoordinatorConfig:
        if self.learner.prompts_per_step % self.jobs.prompts_per_job:
            raise ValueError(
                f"learner.prompts_per_step ({self.learner.prompts_per_step}) must be a multiple of "
                f"jobs.prompts_per_job ({self.jobs.prompts_per_job}); change one of them"
            )
        return self

    @property
    def jobs_per_step(self) -> int:
        return self.learner.prompts_per_step // self.jobs.prompts_per_job

    @property
    def sync_policy(self) -> SyncPolicy:
        return SyncPolicy(self.sync_mode, self.max_staleness, self.jobs_per_step)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> CoordinatorConfig:
    """Read a TOML file (optional) and apply dotted-key overrides such as {'learner.max_steps': 50}."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {where}: {msg}" if where else f"  {msg}")
        raise ConfigError("invalid coordinator config:\n" + "\n".join(lines)) from None
