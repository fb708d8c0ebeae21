"""Coordinator configuration: one pydantic model per concern, loaded from TOML, overridable by CLI flags.

Every model forbids unknown keys, so a typo in a config file is an error that names the key rather than
a silently ignored setting.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coordinator.core.scheduling import SyncPolicy
from shared.errors import EchoSwarmError


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
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Learner parameter dtype.")


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


TaskConfig = Annotated[ArithmeticTaskConfig | JsonlTaskConfig, Field(discriminator="type")]


class LearnerConfig(_Strict):
    """GRPO with a PPO-style clipped ratio; one optimiser step per policy version."""

    lr: float = Field(1e-4, gt=0, lt=1, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip: ratios outside 1±clip_eps stop the gradient.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="GRPO groups per optimiser step.")
    group_size: int = Field(8, ge=2, le=64, description="Samples per prompt; advantages are normalised within a group.")
    max_steps: int = Field(200, ge=0, description="Optimiser steps (= policy versions) before the run finishes.")
    correction: Literal["behaviour-clip", "decoupled"] = Field(
        "behaviour-clip", description="Off-policy correction of stale rollouts (async mode; fresh ones train as "
        "plain GRPO either way). behaviour-clip: PPO's clipped ratio πθ/π_b anchored at the version that "
        "generated the rollout, so tokens earlier steps already moved past 1±clip_eps get no further push. "
        "decoupled (AReaL): the clip around this step's policy, times the truncated weight min(is_cap, π_prox/π_b).")
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
                           "(peft) on lora_targets with the base frozen; llama.cpp clients then fetch the base GGUF "
                           "once and a small adapter per version. 4 is a sensible start (adapter ≈ 0.7 % of the "
                           "tiny model, far less for larger ones).")
    lora_alpha: float = Field(8.0, gt=0, description="LoRA scale numerator: the update is alpha/r · B·A.")
    lora_targets: list[str] = Field(["q_proj", "v_proj"], min_length=1, max_length=16,
                                    description="Linear modules that get adapters (Qwen2/Llama names).")

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


class BackendTolerance(_Strict):
    mean_tol: float = Field(gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    max_tol: float = Field(gt=0, description="Max |Δ logprob| of any single token (nats).")


# Source: bench/llama_parity.py (docs/benchmarks.md, "llama.cpp parity with the learner"), llama-cpp-python
# 0.3.36 on x86_64 CPU, llama.cpp's default f16 KV cache, the tiny model at version 0 and after 183 RL steps
# (512 prompts × 8 samples). Worst per-result mean |Δ| / worst single token |Δ| measured:
#   f32 8.2e-4 / 2.6e-2,   f16 1.0e-3 / 2.8e-2 (one token of 0.113 seen in a 200-step demo),   q8_0 1.1e-2 / 0.67.
# The per-token maximum is heavy-tailed and grows as training sharpens the policy; the tolerances leave
# ≥ 4x headroom over everything measured (more on the mean, the statistic that catches a wrong policy).
LLAMA_TOLERANCES: dict[str, BackendTolerance] = {
    "llama-f32": BackendTolerance(mean_tol=0.01, max_tol=0.5),
    "llama-f16": BackendTolerance(mean_tol=0.01, max_tol=0.5),
    "llama-q8_0": BackendTolerance(mean_tol=0.05, max_tol=2.0),
}


class VerificationConfig(_Strict):
    """Tolerances for reported behaviour logprobs against the learner's recompute (torch backend)."""

    logprob_mean_tol: float = Field(0.05, gt=0, description="Max mean |Δ logprob| per token over a result (nats).")
    logprob_max_tol: float = Field(1.0, gt=0, description="Max |Δ logprob| of any single token (nats).")
    request_window_s: float = Field(300.0, gt=0, description="Accepted clock skew of signed requests (seconds).")
    backend_tolerances: dict[str, BackendTolerance] = Field(
        default_factory=lambda: dict(LLAMA_TOLERANCES),
        description="Per backend class ('llama-f32', 'llama-f16', 'llama-q8_0'): tolerances that replace the two "
        "above for results from llama.cpp clients. The class is derived from snapshots.gguf, which the "
        "coordinator controls, never from the client's word.")

    def tolerances(self, backend: str, gguf: str) -> tuple[float, float]:
        """(mean, max) |Δ logprob| allowed for a result from ``backend`` when GGUFs are published at ``gguf``."""
        if backend == "llama":
            tol = self.backend_tolerances.get(f"llama-{gguf}")
            if tol is not None:
                return tol.mean_tol, tol.max_tol
        return self.logprob_mean_tol, self.logprob_max_tol


class TrustConfig(_Strict):
    """Adaptive trust and spot-check replication (coordinator.core.trust), per client and backend class."""

    trusted_after: int = Field(10, ge=0, le=10_000, description="Consecutive valid results before a client's "
                               "results stop being spot-checked every time (then: probability 1/consecutive).")
    min_replication_rate: float = Field(0.05, ge=0.0, le=1.0, description="Floor of the spot-check probability "
                                        "for fully trusted clients (0: trusted clients are never checked).")
    quarantine_after: int = Field(3, ge=1, le=1000, description="Invalid results in a row that quarantine a client.")
    quarantine_s: float = Field(600.0, ge=0, description="Seconds of the first quarantine; the n-th lasts n times "
                                "as long.")
    spot_checks: bool = Field(True, description="Re-issue sampled jobs (same seed and version) to another client "
                              "and compare the outcomes.")
    hold_s: float = Field(60.0, ge=0, description="Seconds a result awaiting its spot-check replay is kept out of "
                          "training; if no other client replays it by then it is trained on unverified (results "
                          "are not held at all while no other client is active).")
    active_window_s: float = Field(30.0, gt=0, description="A client counts as active (able to replay another's "
                                   "job) for this many seconds after its last request.")
    replica_min_agreement: float = Field(0.95, gt=0.0, le=1.0, description="Fraction of sampled tokens two "
                                         "same-class replays of one seeded job must share to agree.")


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
    max_leases_per_client: int = Field(2, ge=1, le=1024, description="Live leases one identity may hold at once "
                                       "(jobs and spot-check replays); beyond it a lease request gets no job, so "
                                       "nobody can hoard the queue.")


class RegistrationConfig(_Strict):
    """Who may join: anyone (open), or holders of an invite token (private swarms)."""

    mode: Literal["open", "invite"] = Field("open", description="'invite': registering needs a token whose "
                                            "sha256 is listed in invite_sha256.")
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


class SnapshotConfig(_Strict):
    keep_last: int = Field(4, ge=1, description="Published versions kept on disk (older ones are pruned).")
    gguf: Literal["off", "f32", "f16", "q8_0"] = Field(
        "f16", description="Also publish every version as GGUF for llama.cpp clients, at this precision "
        "(off: safetensors only, torch clients). f16 halves the bytes of f32 at ~1e-2 nats of logprob drift; "
        "q8_0 quarters them (docs/benchmarks.md, 'llama.cpp parity').")


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

    @model_validator(mode="after")
    def _fits_the_protocol(self) -> CoordinatorConfig:
        from shared.messages import MAX_COMPLETIONS

        per_job = self.jobs.prompts_per_job * self.learner.group_size
        if per_job > MAX_COMPLETIONS:
            raise ValueError(f"jobs.prompts_per_job × learner.group_size = {per_job} completions per job; the "
                             f"protocol allows {MAX_COMPLETIONS}. Lower prompts_per_job")
        size = 4096 + per_job * (64 + self.sampling.max_tokens * 14)
        if size > 8 * 1024 * 1024:
            raise ValueError(f"a job of {per_job} completions × {self.sampling.max_tokens} tokens could need "
                             f"{size / 2**20:.1f} MiB per result; the limit is 8 MiB. Lower jobs.prompts_per_job "
                             f"or sampling.max_tokens")
        return self

    @model_validator(mode="after")
    def _keep_what_staleness_needs(self) -> CoordinatorConfig:
        if self.sync_mode == "async-push-pull" and self.snapshots.keep_last < self.max_staleness + 2:
            raise ValueError(f"snapshots.keep_last ({self.snapshots.keep_last}) must be at least max_staleness + 2 "
                             f"({self.max_staleness + 2}) so that stale results can still be verified")
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
