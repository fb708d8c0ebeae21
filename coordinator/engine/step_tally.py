"""What one learner step reports about its tokens: the figures summed over its micro-batches (and FSDP ranks) while
the step runs, turned into the step's metrics once it is done.

Split from coordinator/engine/learner.py (issue 33): the step's arithmetic — the objective and its backward pass —
is coordinator.engine.policy_step's; this only counts, without gradients, what the step did to each token (ratios
clipped, importance weights truncated, tokens masked, how far each sampling class's π_b lies from πθ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.engine import fsdp

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks


@dataclass
class StepTally:
    eps: float  # the PPO clip range (learner.clip_eps)
    cap: float  # the truncated importance weight's cap (learner.is_cap)
    loss: float = 0.0
    ratio: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0
    is_sum: float = 0.0
    is_max: float = 0.0
    is_truncated: float = 0.0
    prox_kl: float = 0.0
    squares: float = 0.0
    masked: float = 0.0
    # per sampling class: Σ k3 estimate of KL(π_b ‖ πθ) over its tokens, and their count (policy_mismatch_kl)
    by_source: dict[str, list[float]] = field(default_factory=dict)

    def add(self, chunk: list[Any], loss: Tensor, ratio: Tensor, log_is: Tensor, logp: Tensor, behaviour: Tensor,
            mask: Tensor, keep: Tensor | None) -> None:
        """One micro-batch's share (call under ``torch.no_grad()``)."""
        import torch

        eps, cap = self.eps, self.cap
        self.loss += float(loss)
        self.ratio += float((ratio * mask).sum())
        self.ratio_max = max(self.ratio_max, float((ratio * mask).max()))
        self.clipped += float((((ratio < 1 - eps) | (ratio > 1 + eps)).to(mask.dtype) * mask).sum())
        raw_is = torch.exp(log_is)
        self.is_sum += float((raw_is * mask).sum())
        self.is_max = max(self.is_max, float((raw_is * mask).max()))
        self.is_truncated += float(((raw_is > cap).to(mask.dtype) * mask).sum())
        # k3 estimate of KL(π_b ‖ π_prox) from tokens sampled by π_b: r − log r − 1, r = π_prox/π_b
        self.prox_kl += float(((raw_is - log_is - 1) * mask).sum())
        self.squares += float((((logp.detach() - behaviour) * mask) ** 2).sum())
        if keep is not None:
            self.masked += float((mask * (1 - keep)).sum())
        # the same between π_b and the policy being trained, per class: a quantised client's π_b is the quantised
        # model's, and this is how far it lies from πθ (0 for a fresh torch rollout of a float32 snapshot)
        d = (logp.detach() - behaviour) * mask
        k3 = (torch.exp(d) - d - 1) * mask
        for c, kl_sum, n in zip(chunk, k3.sum(-1).tolist(), mask.sum(-1).tolist(), strict=False):
            acc = self.by_source.setdefault(c.source, [0.0, 0.0])
            acc[0] += kl_sum
            acc[1] += n

    def reduce(self, ranks: Ranks | None) -> None:
        """Each FSDP rank saw its share of the batch: the sums and maxima over all of them (one device: as is)."""
        if ranks is None:
            return
        (self.loss, self.ratio, self.clipped, self.is_sum, self.is_truncated, self.prox_kl, self.squares,
         self.masked) = fsdp.all_reduce(ranks, [self.loss, self.ratio, self.clipped, self.is_sum, self.is_truncated,
                                                self.prox_kl, self.squares, self.masked], "sum")
        self.ratio_max, self.is_max = fsdp.all_reduce(ranks, [self.ratio_max, self.is_max], "max")

    def metrics(self, samples: list[Any], total_tokens: int) -> dict[str, float | dict[str, float]]:
        """The step's metrics about its tokens (per token of the batch, and per sampling class)."""
        per = max(1, total_tokens)
        mismatch = [(b - o) for smp in samples for b, o in zip(smp.behaviour_logprobs, smp.old_logprobs, strict=True)]
        # k3 estimator of KL(behaviour || learner) from log r = old - behaviour: r - log r - 1
        kl = sum(math.exp(-d) + d - 1 for d in mismatch) / max(1, len(mismatch))
        return {
            "loss": self.loss,
            "ratio_mean": self.ratio / per,
            "ratio_max": self.ratio_max,
            "clipped_fraction": self.clipped / per,
            "is_ratio_mean": self.is_sum / per,
            "is_ratio_max": self.is_max,
            "is_truncated_fraction": self.is_truncated / per,
            "behaviour_prox_kl": self.prox_kl / per,
            # mean of (log πθ/π_b)² over the batch at the start of the step (M2PO's second moment, whatever the
            # correction), and the share of tokens the m2po correction masked to bring it within m2_threshold
            "second_moment": self.squares / per,
            "m2po_masked_fraction": self.masked / per,
            "staleness_mean": sum(smp.staleness for smp in samples) / max(1, len(samples)),
            "staleness_max": float(max((smp.staleness for smp in samples), default=0)),
            "mismatch_kl": kl,
            # this rank's samples (each FSDP rank reports its own share; one device: the batch)
            "policy_mismatch_kl": {k: v[0] / max(1.0, v[1]) for k, v in sorted(self.by_source.items()) if v[1] > 0},
        }
