"""The ``[learner]`` section: the learner role's optimiser, off-policy correction, checkpoints and ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from coordinator.config.base import StrictModel


class LearnerConfig(StrictModel):
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
