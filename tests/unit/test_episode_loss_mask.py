"""The learner trains an episode on the model's tokens only: observation tokens (loss mask 0) are context, never
trained on. An episode masked after its first token trains exactly as that token alone would (causal model)."""

from __future__ import annotations

from pathlib import Path

import torch

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine.learner import Learner, Sample


def _step(folder: Path, sample: Sample) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    learner = Learner(folder, ModelConfig(device="cpu"), LearnerConfig(lr=1e-2, threads=1), temperature=1.0)
    grads: dict[str, torch.Tensor] = {}

    def keep(*_: object) -> None:  # the gradients as the optimizer gets them (the step frees them afterwards)
        grads.update({k: p.grad.detach().clone() for k, p in learner.model.named_parameters() if p.grad is not None})

    learner.optimizer.register_step_pre_hook(keep)
    metrics = learner.train_step([sample])
    return metrics, grads


def test_observation_tokens_are_masked_out_of_the_loss(tiny_model_dir: Path) -> None:
    prompt = [81, 58, 32, 50, 49, 50, 48, 32, 65, 58, 32]  # "Q: 2120 A: "
    action, observation = [51], [10, 81, 58, 32, 49, 49, 50, 48, 32, 65, 58, 32]
    lps = [-1.3] + [-4.0] * len(observation)  # π_b at every position (the observations' never used)
    masked = Sample(prompt, action + observation, lps, lps, advantage=1.0, loss_mask=[1] + [0] * len(observation))
    alone = Sample(prompt, action, lps[:1], lps[:1], advantage=1.0)
    m_masked, g_masked = _step(tiny_model_dir, masked)
    m_alone, g_alone = _step(tiny_model_dir, alone)
    assert m_masked["tokens"] == m_alone["tokens"] == 1.0
    assert abs(m_masked["loss"] - m_alone["loss"]) < 1e-6
    assert g_masked.keys() == g_alone.keys() and g_alone
    for name, grad in g_alone.items():  # the same gradient (up to float rounding of the longer batch)
        assert torch.allclose(g_masked[name], grad, atol=1e-5, rtol=1e-3), name
