"""coordinator/learner.token_objective against values computed by hand: the behaviour-anchored PPO clip with its
dual clip (the default correction), the decoupled correction's truncated importance weight and clip, and the
staleness weight."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.engine.learner import token_objective


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float64)


def run(logp: float, prox: float, behaviour: float, adv: float, weight: float = 1.0, eps: float = 0.2,
        cap: float = 2.0, correction: str = "decoupled") -> tuple[float, float, float]:
    per_token, ratio, log_is = token_objective(t([logp]), t([prox]), t([behaviour]), t([adv]), t([weight]),
                                               t([1.0]), eps, cap, correction=correction)
    return float(per_token[0, 0]), float(ratio[0, 0]), float(log_is[0, 0])


def test_fresh_rollout_is_plain_policy_gradient() -> None:
    loss, ratio, log_is = run(logp=-1.0, prox=-1.0, behaviour=-1.0, adv=0.5)
    assert (loss, ratio, log_is) == pytest.approx((-0.5, 1.0, 0.0))


def test_importance_weight_below_the_cap_is_used_as_is() -> None:
    # π_prox/π_b = e^(-0.9 - -1.2) = e^0.3 = 1.3499 < cap 2
    loss, _, log_is = run(logp=-0.9, prox=-0.9, behaviour=-1.2, adv=1.0)
    assert log_is == pytest.approx(0.3)
    assert loss == pytest.approx(-math.exp(0.3))


def test_importance_weight_is_truncated_at_the_cap() -> None:
    # π_prox/π_b = e^(ln 3) = 3 → min(2, 3) = 2
    loss, _, log_is = run(logp=-0.5, prox=-0.5, behaviour=-0.5 - math.log(3.0), adv=1.0, cap=2.0)
    assert math.exp(log_is) == pytest.approx(3.0)
    assert loss == pytest.approx(-2.0)
    loss, _, _ = run(logp=-0.5, prox=-0.5, behaviour=-0.5 - math.log(3.0), adv=-1.0, cap=2.0)
    assert loss == pytest.approx(2.0)  # the cap bounds negative advantages too


def test_importance_weight_below_one_shrinks_the_token() -> None:
    loss, _, _ = run(logp=-2.0, prox=-2.0, behaviour=-2.0 + math.log(4.0), adv=1.0)  # ratio 1/4
    assert loss == pytest.approx(-0.25)


def test_ppo_clip_with_positive_and_negative_advantage() -> None:
    # ρ = e^(ln 1.5) = 1.5; A = +1: min(1.5, clip 1.2) = 1.2 → loss −1.2
    loss, ratio, _ = run(logp=math.log(1.5) - 1.0, prox=-1.0, behaviour=-1.0, adv=1.0, eps=0.2)
    assert ratio == pytest.approx(1.5)
    assert loss == pytest.approx(-1.2)
    # A = −1: min(−1.5, −1.2) = −1.5 → loss +1.5 (the pessimistic side is not clipped)
    loss, _, _ = run(logp=math.log(1.5) - 1.0, prox=-1.0, behaviour=-1.0, adv=-1.0, eps=0.2)
    assert loss == pytest.approx(1.5)


def test_staleness_weight_and_mask_multiply() -> None:
    loss, _, _ = run(logp=-1.0, prox=-1.0, behaviour=-1.0, adv=2.0, weight=0.25)
    assert loss == pytest.approx(-0.5)
    per_token, _, _ = token_objective(t([-1.0, -1.0]), t([-1.0, -1.0]), t([-1.0, -1.0]), t([1.0]), t([1.0]),
                                      t([1.0, 0.0]), 0.2, 2.0, correction="decoupled")
    assert per_token.tolist() == [[-1.0, 0.0]]  # padding contributes nothing


def test_importance_weight_carries_no_gradient() -> None:
    prox = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    per_token, _, _ = token_objective(logp, prox, t([-1.5]), t([1.0]), t([1.0]), t([1.0]), 0.2, 2.0,
                                      correction="decoupled")
    per_token.sum().backward()
    assert prox.grad is None  # π_prox is a constant of the step: neither ρ nor the weight pass gradient to it
    # d/dlogp of −ρ·w with ρ = e^(logp − prox) at ρ = 1: −w = −e^0.5
    assert float(logp.grad[0, 0]) == pytest.approx(-math.exp(0.5))


def test_sequence_level_weight_is_the_truncated_product_over_the_completion() -> None:
    # two tokens with π_prox/π_b = e^0.3 and e^0.2 (and a padding slot): one weight e^0.5 = 1.6487 on both
    logp = prox = t([-0.9, -0.4, 0.0])
    behaviour = t([-1.2, -0.6, 0.0])
    mask = t([1.0, 1.0, 0.0])
    per_token, _, log_is = token_objective(logp, prox, behaviour, t([1.0]), t([1.0]), mask, 0.2, 2.0, "sequence",
                                             "decoupled")
    assert [float(x) for x in log_is[0]] == pytest.approx([0.3, 0.2, 0.0])
    assert [float(x) for x in per_token[0]] == pytest.approx([-math.exp(0.5), -math.exp(0.5), 0.0])
    # a product past the cap is cut to it on every token: e^(0.3 + 0.8) = 3.0 → 2
    per_token, _, _ = token_objective(logp, prox, t([-1.2, -1.2, 0.0]), t([1.0]), t([1.0]), mask, 0.2, 2.0,
                                      "sequence", "decoupled")
    assert [float(x) for x in per_token[0]] == pytest.approx([-2.0, -2.0, 0.0])
    # per token the same inputs give two different weights
    per_token, _, _ = token_objective(logp, prox, behaviour, t([1.0]), t([1.0]), mask, 0.2, 2.0, "token",
                                      "decoupled")
    assert [float(x) for x in per_token[0]] == pytest.approx([-math.exp(0.3), -math.exp(0.2), 0.0])


# ---- behaviour-clip (the default): r = πθ/π_b, PPO clip around the behaviour policy, dual clip at is_cap ----
def behaviour_clip(logp: float, behaviour: float, adv: float, cap: float = 2.0) -> tuple[float, float]:
    loss, ratio, _ = run(logp=logp, prox=logp, behaviour=behaviour, adv=adv, cap=cap, correction="behaviour-clip")
    return loss, ratio


def test_behaviour_clip_fresh_rollout_is_plain_policy_gradient() -> None:
    assert behaviour_clip(-1.0, -1.0, 0.5) == pytest.approx((-0.5, 1.0))
    assert behaviour_clip(-1.0, -1.0, -0.5) == pytest.approx((0.5, 1.0))


def test_behaviour_clip_ratio_inside_the_trust_region_weights_the_token() -> None:
    # r = e^0.1 = 1.1052 inside [0.8, 1.2]: loss −r·A
    loss, ratio = behaviour_clip(-0.9, -1.0, 1.0)
    assert ratio == pytest.approx(math.exp(0.1)) and loss == pytest.approx(-math.exp(0.1))


def test_behaviour_clip_stops_a_token_already_moved_past_the_region() -> None:
    """The learner already made this token 1.5× likelier than when it was sampled: with A > 0, min(1.5, 1.2)
    = 1.2, a constant — no gradient pushes it further. With A < 0 the pessimistic side is kept (−1.5)."""
    logp = torch.tensor([[math.log(1.5) - 1.0]], dtype=torch.float64, requires_grad=True)
    per_token, ratio, _ = token_objective(logp, logp.detach(), t([-1.0]), t([1.0]), t([1.0]), t([1.0]), 0.2, 2.0)
    assert float(ratio.detach()[0, 0]) == pytest.approx(1.5)
    assert float(per_token.detach()[0, 0]) == pytest.approx(-1.2)
    per_token.sum().backward()
    assert float(logp.grad[0, 0]) == 0.0  # type: ignore[index]
    assert behaviour_clip(math.log(1.5) - 1.0, -1.0, -1.0)[0] == pytest.approx(1.5)
    # already made 2× less likely, A < 0: min(−0.5, clip(0.5)·−1 = −0.8) = −0.8, a constant: loss 0.8
    assert behaviour_clip(math.log(0.5) - 1.0, -1.0, -1.0)[0] == pytest.approx(0.8)


def test_behaviour_clip_dual_clip_caps_negative_advantages_at_is_cap() -> None:
    # r = 3, A = −1: min(−3, −1.2) = −3, dual clip max(−3, 2·−1) = −2 → loss 2; A = +1: clipped to 1.2
    assert behaviour_clip(math.log(3.0) - 1.0, -1.0, -1.0, cap=2.0)[0] == pytest.approx(2.0)
    assert behaviour_clip(math.log(3.0) - 1.0, -1.0, 1.0, cap=2.0)[0] == pytest.approx(-1.2)
    assert behaviour_clip(math.log(3.0) - 1.0, -1.0, -1.0, cap=4.0)[0] == pytest.approx(3.0)  # under the cap


def test_behaviour_clip_gradient_is_the_importance_weighted_policy_gradient() -> None:
    # inside the region d/dlogp of −r·A·w with r = e^(logp − b) is −r·A·w: here −e^0.1 · 2 · 0.5
    logp = torch.tensor([[-0.9]], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    per_token, _, _ = token_objective(logp, logp.detach(), behaviour, t([2.0]), t([0.5]), t([1.0]), 0.2, 2.0)
    per_token.sum().backward()
    assert float(logp.grad[0, 0]) == pytest.approx(-math.exp(0.1))  # type: ignore[index]
    assert behaviour.grad is None  # the behaviour policy is data, never trained
