"""A fresh rollout sampled in another precision (a llama.cpp or bf16 client) is off-policy however fresh: π_b is
the quantised model's, not πθ. The learner's ``decoupled`` correction then weights it by Yao et al.'s truncated
importance weight min(is_cap, π_prox/π_b), ``none`` trains it as if πθ had sampled it, and a fresh torch float32
rollout stays plain GRPO under every correction (co-located and sequential-pull runs unchanged)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine.learner import Learner, Sample, on_policy, token_objective


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float64)


def test_only_a_fresh_rollout_of_the_learners_own_class_is_on_policy() -> None:
    fresh = Sample([1], [2], [-1.0], [-1.0], advantage=1.0)
    assert on_policy(fresh)
    assert not on_policy(Sample([1], [2], [-1.0], [-1.0], advantage=1.0, staleness=1))
    for source in ("llama-q8_0", "llama-q4_K_M", "llama-f16", "torch-bf16"):
        assert not on_policy(Sample([1], [2], [-1.0], [-1.0], advantage=1.0, source=source)), source


def test_none_is_the_plain_policy_gradient_whatever_pi_b_says() -> None:
    logp = t([-0.5, -2.0]).requires_grad_(True)
    behaviour = t([-3.0, -0.1])  # far from πθ both ways: none ignores it
    mask = t([1.0, 1.0])
    per_token, ratio, log_is = token_objective(logp, logp.detach(), behaviour, t([0.5]), t([1.0]), mask, 0.2, 2.0,
                                               correction="none")
    assert ratio.tolist() == [[1.0, 1.0]]
    per_token.sum().backward()
    assert logp.grad is not None and logp.grad.tolist() == [[-0.5, -0.5]]  # −A ∇log πθ on every token
    assert log_is.tolist()[0] == pytest.approx([2.5, -1.9])  # the metrics still see the real π_b


def _batch(learner: Learner, source: str, offset: float, count: int = 12) -> list[Sample]:
    """``count`` fresh completions whose π_b lies ``offset`` nats below the learner's policy on every token, as a
    quantised model that gives the sampled tokens less mass would."""
    rng = random.Random(0)
    pairs = [(learner.encode(f"Q: {i}+{2 * i}= A:"), [rng.randrange(48, 58) for _ in range(rng.randint(2, 5))])
             for i in range(count)]
    now = learner.recompute([p for p, _ in pairs], [c for _, c in pairs])
    return [Sample(p, c, [lp - offset for lp in lps], [lp - offset for lp in lps], advantage=(-1.0) ** i,
                   source=source) for i, ((p, c), lps) in enumerate(zip(pairs, now, strict=True))]


def _learner(folder: Path, correction: str) -> Learner:
    torch.manual_seed(0)
    return Learner(folder, ModelConfig(device="cpu"), LearnerConfig(lr=1e-3, threads=1, correction=correction),  # type: ignore[arg-type]
                   temperature=1.0)


def test_decoupled_weights_a_fresh_quantised_rollout_by_the_truncated_ratio(tiny_model_dir: Path) -> None:
    offset = 0.3  # π_prox/π_b = e^0.3 = 1.35 on every token: below the cap, used as is
    learner = _learner(tiny_model_dir, "decoupled")
    quantised = learner.train_step(_batch(learner, "llama-q8_0", offset))
    assert quantised["is_ratio_mean"] == pytest.approx(math.exp(offset), rel=1e-4)
    assert quantised["is_truncated_fraction"] == 0.0
    assert quantised["ratio_mean"] == pytest.approx(1.0)  # PPO's ratio around π_prox: 1 at the gradient
    # the same numbers labelled a torch float32 rollout: π_b is taken as πθ's own, no weight, PPO's ratio around it
    learner = _learner(tiny_model_dir, "decoupled")
    own = learner.train_step(_batch(learner, "torch", offset))
    assert own["is_ratio_mean"] == 1.0
    assert own["ratio_mean"] == pytest.approx(math.exp(offset), rel=1e-4)


def test_a_large_mismatch_is_truncated_at_is_cap(tiny_model_dir: Path) -> None:
    learner = _learner(tiny_model_dir, "decoupled")
    metrics = learner.train_step(_batch(learner, "llama-q4_K_M", math.log(5.0)))  # π_prox/π_b = 5 > cap 2
    assert metrics["is_truncated_fraction"] == 1.0
    assert metrics["is_ratio_max"] == pytest.approx(5.0, rel=1e-4)


def test_the_corrections_train_a_quantised_batch_differently_and_a_fresh_torch_batch_alike(
        tiny_model_dir: Path) -> None:
    def step(correction: str, source: str, offset: float) -> tuple[float, float]:
        learner = _learner(tiny_model_dir, correction)
        metrics = learner.train_step(_batch(learner, source, offset))
        loss, norm = metrics["loss"], metrics["grad_norm"]
        assert isinstance(loss, float) and isinstance(norm, float)
        return loss, norm  # (AdamW's first step is sign-like: compare
        # the gradient, not the weights, which amplify last-bit differences of near-zero gradients)

    # a fresh torch float32 batch (π_b is πθ's recompute): every correction is plain GRPO
    own = {c: step(c, "torch", 0.0) for c in ("none", "behaviour-clip", "decoupled")}
    assert own["behaviour-clip"] == pytest.approx(own["none"], rel=1e-5)
    assert own["decoupled"] == pytest.approx(own["none"], rel=1e-5)
    # a quantised batch: decoupled's weight e^0.3 scales every token's gradient, none ignores it
    quantised = {c: step(c, "llama-q8_0", 0.3) for c in ("none", "decoupled")}
    assert quantised["decoupled"][1] == pytest.approx(math.exp(0.3) * quantised["none"][1], rel=1e-4)
