"""The TRL peer row's hyper-parameter mapping (bench/trl_peer.py): it must follow the learner's config and keep
the objective echo-swarm trains with. Pure: TRL itself is not needed (it is in the optional 'bench' extra)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import LearnerConfig, SamplingConfig


@pytest.fixture(scope="module")
def trl_peer() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import trl_peer

    return trl_peer


def test_mapping_follows_the_learner_and_sampling_config(trl_peer: Any, tmp_path: Path) -> None:
    learner = LearnerConfig(lr=3e-4, weight_decay=0.01, max_grad_norm=0.5, clip_eps=0.3, prompts_per_step=4,
                            group_size=4)
    args = trl_peer.trl_args(7, 12, tmp_path, learner, SamplingConfig(temperature=0.7, max_tokens=5))
    assert (args["learning_rate"], args["weight_decay"], args["max_grad_norm"], args["epsilon"]) == (3e-4, 0.01, 0.5, 0.3)
    assert args["num_generations"] == 4 and args["per_device_train_batch_size"] == 16  # 4 groups of 4, one step
    assert (args["temperature"], args["max_completion_length"]) == (0.7, 5)
    assert (args["seed"], args["max_steps"]) == (7, 12)
    assert args["output_dir"].startswith(str(tmp_path))


def test_objective_and_sampling_match_echo_swarm(trl_peer: Any, tmp_path: Path) -> None:
    args = trl_peer.trl_args(0, 10, tmp_path)
    # full softmax: no top-k / top-p / min-p truncation, no repetition penalty
    assert (args["top_k"], args["top_p"], args["min_p"], args["repetition_penalty"]) == (0, 1.0, None, 1.0)
    # no KL, one update per batch with no accumulation, token-mean over the batch, group-normalised advantages
    assert (args["beta"], args["num_iterations"], args["gradient_accumulation_steps"]) == (0.0, 1, 1)
    assert (args["loss_type"], args["scale_rewards"]) == ("dapo", "group")
    # constant lr without warm-up; float32 on CPU (TRL's defaults are bf16 and lr 1e-6)
    assert (args["lr_scheduler_type"], args["warmup_steps"], args["learning_rate"]) == ("constant", 0, 1e-4)
    assert (args["bf16"], args["fp16"], args["use_cpu"]) == (False, False, True)
