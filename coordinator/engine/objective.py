"""The learner's objective: the GRPO loss per token and its off-policy correction, and the sample it is taken on.

Split from coordinator/engine/learner.py (issue 33): what a step optimises, apart from how the batch is passed
through the model (coordinator.engine.passes) and how the update is taken (coordinator.engine.policy_step).

Loss per token, token-mean over the batch. The off-policy corrections (``learner.correction``):

- ``behaviour-clip`` (default), PPO anchored at the behaviour policy:
      w · −dualclip(min(r·A, clip(r, 1−ε, 1+ε)·A)),   r = πθ/π_b
  The importance ratio r multiplies the gradient, and PPO's trust region is centred on the policy that
  generated the rollout: a token the learner has already moved past 1±ε since that version (by training on
  other batches) gets no further push in the same direction. For a negative advantage the ratio is cut at
  c = ``is_cap`` (dual clip), so one unlikely token cannot dominate the batch.
- ``decoupled`` (as in AReaL), the trust region around this step's policy π_prox, a truncated weight for
  the behaviour gap:
      w · min(c, π_prox/π_b) · −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A),   ρ = πθ/π_prox
  With one optimiser step per batch ρ = 1 when the gradient is taken, so nothing bounds how far earlier steps
  have already moved a stale token. With rollouts 3 versions old (bench/policy_lag.py, 3 seeds) it kept 74 % of
  on-policy GRPO's improvement in held-out accuracy, ``behaviour-clip`` 97 %.
- ``m2po`` (M2PO, Zheng et al. 2025, arXiv 2510.01161; AReaL's ``m2_threshold``), a second-moment trust region
  over the whole batch instead of a per-token clip:
      w · M · −r·A,   r = πθ/π_b,   M = 0 on the fewest tokens whose removal brings the batch's
      mean of (log r)² at the start of the step to at most τ = ``m2_threshold`` (the largest ones), 1 elsewhere
  PPO's clip silences exactly the tokens whose ratio moved most, which at high policy lag are the high-entropy
  ones that carry most of the signal; M2PO keeps every token and drops only the outliers that would make the
  importance-weighted gradient's variance explode, so it stays stable with rollouts many versions old (the paper:
  256). The mask is chosen once per batch (:func:`second_moment_keep`), over every rank's tokens.
- ``none``, the ablation baseline: w · −A · πθ/sg(πθ), every rollout trained as if this step's policy had
  sampled it (what a trainer that ignores who sampled does; biased for stale and quantised rollouts).

π_b is the coordinator's own recompute (coordinator.engine.verifier, from the published snapshot of the version that
generated the rollout; trusted, unlike the client's report) — for a llama.cpp client's rollout, llama.cpp's on the
GGUF file it ran (coordinator.engine.llama_verifier): the quantised policy it actually sampled from, so the
quantisation's gap to πθ is an importance ratio the correction clips, like staleness; π_prox the learner's policy at the start of this
step (no gradient); w = ``staleness_decay`` ** staleness; A the group-normalised advantage. For a fresh
rollout of the learner's own class (torch float32, :data:`OWN_CLASS`) π_b = π_prox = πθ when the gradient is taken,
every correction is plain GRPO, and co-located or sequential-pull training is unaffected by the choice. A fresh
quantised rollout (a llama.cpp or bf16 client's) has π_b ≠ πθ however fresh: ``behaviour-clip`` clips πθ/π_b
around the quantised policy; ``decoupled`` is then exactly the truncated importance sampling of Yao et al. (2025)
and FlashRL for a quantised sampler — PPO around π_prox, weighted by min(c, π_prox/π_b).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One rollout as the learner trains on it: its tokens, π_b's logprobs and its weight in the loss."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # the verifier's recompute at the behaviour version (π_b)
    behaviour_logprobs: list[float]  # as reported by the client
    advantage: float
    staleness: int = 0
    weight: float = 1.0
    loss_mask: list[int] | None = None  # 1 on the model's tokens, 0 on an episode's observation tokens (not trained)
    source: str = "torch"  # the class that sampled it ("torch", "llama-q4_K_M", ...): π_b's precision, for metrics


#: The sampling class whose fresh rollouts are this step's policy's own (π_b = πθ): a torch float32 client's.
OWN_CLASS = "torch"


def on_policy(sample: Sample) -> bool:
    """Whether π_b is πθ at the start of the step: a fresh rollout of the learner's own class. Any other — stale,
    or sampled in another precision however fresh — needs π_prox, this step's policy, beside π_b."""
    return sample.staleness == 0 and sample.source == OWN_CLASS


def second_moment_keep(log_ratio: Any, mask: Any, threshold: float) -> Any:
    """M2PO's mask: 1 on the tokens kept, 0 on the fewest tokens (those with the largest (log r)²) whose removal
    brings the mean of (log r)² over the tokens left to at most ``threshold``; 0 where ``mask`` is 0.

    Any shape; ``mask`` is 1 on real tokens. Removing the largest squares first is what makes the set minimal:
    the mean of the m smallest grows with m, so the tokens kept are the longest prefix of the squares in
    ascending order whose mean is within the bound. Equal squares (a group's identical completions) are kept in
    the order they appear, so the choice does not depend on the sort's implementation."""
    import torch

    real = mask.reshape(-1) > 0
    squares = (log_ratio.detach().reshape(-1)[real].to(torch.float64)) ** 2
    keep = (mask > 0).to(mask.dtype)
    if squares.numel() == 0 or float(squares.mean()) <= threshold:
        return keep
    ascending = torch.sort(squares, stable=True).indices
    prefix_mean = torch.cumsum(squares[ascending], 0) / torch.arange(1, squares.numel() + 1, dtype=torch.float64)
    kept = int((prefix_mean <= threshold).sum())
    flat = torch.zeros(squares.numel(), dtype=mask.dtype, device=mask.device)
    flat[ascending[:kept]] = 1
    out = torch.zeros(mask.numel(), dtype=mask.dtype, device=mask.device)
    out[real] = flat
    return out.view_as(mask)


def token_objective(logp: Any, prox: Any, behaviour: Any, adv: Any, weight: Any, mask: Any, eps: float,
                    cap: float, level: str = "token", correction: str = "behaviour-clip",
                    keep: Any = None) -> tuple[Any, Any, Any]:
    """Per-token loss (module docstring), plus the clipped ratio (πθ/π_b for ``behaviour-clip`` and ``m2po``,
    πθ/π_prox for ``decoupled``) and log(π_prox/π_b) for metrics.

    All tensors are [sequences, tokens] (``adv`` and ``weight`` broadcast from [sequences, 1]); ``mask`` is 1
    on real completion tokens. ``level`` ("token" or "sequence") applies to the decoupled importance weight,
    which carries no gradient. ``keep``: M2PO's mask (:func:`second_moment_keep`, chosen over the whole batch),
    for ``m2po`` only.
    """
    import torch

    log_is = ((prox - behaviour) * mask).detach()
    if correction == "none":
        ratio = torch.exp((logp - logp.detach()) * mask)  # 1, with the gradient of log πθ
        return -ratio * adv * weight * mask, ratio, log_is
    if correction == "m2po":
        if keep is None:
            raise ValueError("the m2po correction needs the batch's second-moment mask (second_moment_keep)")
        kept = mask * keep
        # a masked token's ratio is exp(0) = 1 times 0, so an extreme log ratio never reaches exp's gradient
        ratio = torch.exp((logp - behaviour.detach()) * kept)
        return -ratio * adv * weight * kept, torch.exp(((logp - behaviour) * mask).detach()), log_is
    if correction == "behaviour-clip":
        ratio = torch.exp((logp - behaviour.detach()) * mask)
        objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
        objective = torch.where(adv < 0, torch.maximum(objective, cap * adv), objective)  # dual clip
        return -objective * weight * mask, ratio, log_is
    if level == "sequence":  # one weight per rollout: the probability ratio of the whole completion
        is_weight = torch.clamp(torch.exp(log_is.sum(dim=-1, keepdim=True)), max=cap)
    else:
        is_weight = torch.clamp(torch.exp(log_is), max=cap)
    ratio = torch.exp((logp - prox.detach()) * mask)
    unclipped = ratio * adv
    clipped_obj = torch.clamp(ratio, 1 - eps, 1 + eps) * adv
    per_token = -torch.minimum(unclipped, clipped_obj) * is_weight * weight * mask
    return per_token, ratio, log_is
