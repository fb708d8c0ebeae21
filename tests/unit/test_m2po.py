"""The m2po correction (coordinator.engine.learner): the second-moment mask is the minimal one meeting the bound,
chosen over the whole batch (one micro-batch or several); the step metric is the share it masked; the loss is the
unclipped importance-weighted policy gradient on the tokens kept; and with the default correction nothing of it
takes part."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine.learner import MICRO_BATCH, Learner, Sample, second_moment_keep, token_objective


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float64)


def fewest_to_mask(values: list[float], threshold: float) -> int:
    """By brute force over every subset: the fewest tokens whose removal leaves a mean square ≤ threshold."""
    for k in range(len(values) + 1):
        for masked in itertools.combinations(range(len(values)), k):
            left = [v * v for i, v in enumerate(values) if i not in masked]
            if not left or sum(left) / len(left) <= threshold:
                return k
    raise AssertionError("unreachable: removing every token meets any bound")


# ---- the mask ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_the_mask_is_the_minimal_one_meeting_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    values = [rng.gauss(0.0, rng.choice([0.05, 0.3, 1.0])) for _ in range(n)]
    threshold = rng.choice([0.01, 0.04, 0.2])
    keep = second_moment_keep(torch.tensor(values, dtype=torch.float64), torch.ones(n, dtype=torch.float64),
                              threshold)
    kept = [v for v, k in zip(values, keep.tolist(), strict=True) if k == 1.0]
    masked = [v for v, k in zip(values, keep.tolist(), strict=True) if k == 0.0]
    assert len(masked) == fewest_to_mask(values, threshold)  # minimal
    assert not kept or sum(v * v for v in kept) / len(kept) <= threshold  # meets the bound
    assert not masked or not kept or min(v * v for v in masked) >= max(v * v for v in kept)  # the largest go


def test_within_the_bound_nothing_is_masked_and_padding_never_counts() -> None:
    log_ratio = t([0.1, -0.1, 5.0], [0.0, 0.15, 9.0])
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 0.0])  # the 5.0 and 9.0 sit on padding: not tokens
    assert second_moment_keep(log_ratio, mask, 0.04).tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]


def test_the_bound_is_over_the_tokens_left_and_ties_keep_the_earlier() -> None:
    # squares 0.01, 0.25, 0.25, 0.0: mean 0.1275 > 0.04; without one 0.25 the mean of three is 0.0867 > 0.04;
    # without both 0.005 ≤ 0.04. The two equal squares (identical completions) both go
    keep = second_moment_keep(t([0.1, 0.5, -0.5, 0.0]), t([1.0, 1.0, 1.0, 1.0]), 0.04)
    assert keep.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    # a bound that needs only one of two equal squares removed keeps the one that comes first
    keep = second_moment_keep(t([0.3, 0.3, 0.0, 0.0]), t([1.0, 1.0, 1.0, 1.0]), 0.03)
    assert keep.tolist() == [[1.0, 0.0, 1.0, 1.0]]  # 0.09/3 = 0.03 ≤ 0.03


# ---- the loss ------------------------------------------------------------------------------------------------
def test_m2po_is_the_unclipped_importance_weighted_gradient_on_the_tokens_kept() -> None:
    # r = e^0.5 on a kept token (PPO would clip it at 1.2), a masked token with an extreme ratio e^200, padding
    logp = torch.tensor([[-0.5, 199.0, 0.0]], dtype=torch.float64, requires_grad=True)
    behaviour = t([-1.0, -1.0, 0.0])
    mask, keep = t([1.0, 1.0, 0.0]), t([1.0, 0.0, 0.0])
    per_token, ratio, _ = token_objective(logp, logp.detach(), behaviour, t([2.0]), t([0.5]), mask, 0.2, 2.0,
                                          correction="m2po", keep=keep)
    assert per_token.detach().tolist()[0] == pytest.approx([-math.exp(0.5) * 2.0 * 0.5, 0.0, 0.0])
    assert float(ratio[0, 0]) == pytest.approx(math.exp(0.5))  # the metric's ratio is the true one
    per_token.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(0.5), 0.0, 0.0])  # masked: no gradient, no NaN
    with pytest.raises(ValueError, match="second-moment mask"):
        token_objective(logp, logp, behaviour, t([1.0]), t([1.0]), mask, 0.2, 2.0, correction="m2po")


# ---- in the learner ------------------------------------------------------------------------------------------
def _samples(learner: Learner, count: int, spread: float, seed: int = 0) -> list[Sample]:
    """``count`` completions whose π_b lies off the learner's current policy by N(0, spread) per token, as a
    rollout many versions old would."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = learner.encode(f"Q: {i % 50}+{(3 * i) % 50}= A:")
        completion = [rng.randrange(48, 58) for _ in range(rng.randint(1, 5))]
        out.append((prompt, completion))
    now = learner.recompute([p for p, _ in out], [c for _, c in out])
    samples = []
    for (prompt, completion), lps in zip(out, now, strict=True):
        behaviour = [lp + rng.gauss(0.0, spread) for lp in lps]
        samples.append(Sample(prompt, completion, behaviour, behaviour, advantage=rng.choice([-1.0, 1.0]),
                              staleness=8))
    return samples


def _expected_masked_share(learner: Learner, samples: list[Sample], threshold: float) -> float:
    """The share of the batch's tokens the minimal mask removes, from the learner's logprobs before the step:
    drop the largest (log r)² one at a time until the mean of those left is within the bound."""
    now = learner.recompute([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    squares = sorted(((a - b) ** 2 for s, row in zip(samples, now, strict=True)
                      for a, b in zip(row, s.old_logprobs, strict=True)), reverse=True)
    total, dropped = len(squares), 0
    while squares and sum(squares) / len(squares) > threshold:
        squares.pop(0)
        dropped += 1
    return dropped / total


def _learner(folder: Path, **cfg: object) -> Learner:
    torch.manual_seed(0)
    return Learner(folder, ModelConfig(device="cpu"), LearnerConfig(lr=1e-3, threads=1, **cfg),  # type: ignore[arg-type]
                   temperature=1.0)


@pytest.mark.parametrize("count", [12, MICRO_BATCH + 6])  # one micro-batch, and several (a pass before the step)
def test_the_step_metric_is_the_share_masked_over_the_whole_batch(tiny_model_dir: Path, count: int) -> None:
    learner = _learner(tiny_model_dir, correction="m2po", m2_threshold=0.04)
    samples = _samples(learner, count, spread=0.4)
    expected = _expected_masked_share(learner, samples, 0.04)
    metrics = learner.train_step(samples)
    assert 0.05 < expected < 0.95  # the batch is off-policy enough that the bound bites, and not everywhere
    assert metrics["m2po_masked_fraction"] == pytest.approx(expected, abs=1e-9)
    assert metrics["second_moment"] > 0.04
    assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))


def test_the_correction_is_off_by_default_and_the_threshold_then_changes_nothing(tiny_model_dir: Path) -> None:
    assert LearnerConfig().correction == "behaviour-clip"
    weights = []
    for cfg in ({}, {"m2_threshold": 1e-6}):
        learner = _learner(tiny_model_dir, **cfg)
        metrics = learner.train_step(_samples(learner, 12, spread=0.4))
        assert metrics["m2po_masked_fraction"] == 0.0
        weights.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # and the default is the behaviour clip: an m2po learner on the same batch ends elsewhere
    learner = _learner(tiny_model_dir, correction="m2po")
    learner.train_step(_samples(learner, 12, spread=0.4))
    assert any(not torch.equal(weights[0][k], v) for k, v in learner.model.state_dict().items())
