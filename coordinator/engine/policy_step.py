"""One GRPO optimiser step: the objective's backward pass over every micro-batch, the gradient clipped, the
update taken once the publisher has released the live tensors it was lent, and the step's metrics.

Split from coordinator/engine/learner.py (issue 33): the step owns the optimizer; the passes that make the token
logprobs are coordinator.engine.passes', the loss coordinator.engine.objective's, the figures counted along the way
coordinator.engine.step_tally's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from coordinator.config import LearnerConfig
from coordinator.engine.bf16_adamw import StochasticBf16AdamW
from coordinator.engine.live_gates import LiveGates
from coordinator.engine.objective import Sample, on_policy, second_moment_keep, token_objective
from coordinator.engine.passes import MicroBatch, TokenPasses
from coordinator.engine.step_tally import StepTally
from coordinator.memory import release_free_heap

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks


def make_optimizer(trainable: list[Any], cfg: LearnerConfig, *, fused: bool) -> Any:
    """bf16 weights and moments, stochastically rounded (LearnerConfig.precision), or AdamW — ``fused`` on one CPU or
    CUDA device: one kernel per tensor with no temporaries (the for-loop form allocates two of each parameter's
    size, 1 GB at a 0.5 B model's embedding) and ~10x faster on a CPU."""
    import torch

    if cfg.precision == "bf16":
        return StochasticBf16AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    return torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


class PolicyStep:
    """Steps of ``model`` by ``optimizer`` on batches of samples, passed through the model by ``passes``, on
    ``ranks`` (None: one device; several: each rank steps on its share and FSDP sums the gradients)."""

    def __init__(self, model: Any, optimizer: Any, passes: TokenPasses, cfg: LearnerConfig, *, ranks: Ranks | None,
                 device: str, gates: LiveGates) -> None:
        self.model = model
        self.optimizer = optimizer
        self.passes = passes
        self.cfg = cfg
        self.ranks = ranks
        self.device = device
        self.gates = gates

    def run(self, samples: list[Sample]) -> dict[str, float | dict[str, float]]:
        """One step on ``samples``; its metrics (coordinator.engine.step_tally's, the gradient norm before clipping,
        the seconds it took and those of it spent waiting for the publisher)."""
        t0 = time.monotonic()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples)
        tally = self._backward(samples, total_tokens)
        grad_norm, gate_s, publish_gate_s = self._update()
        return {
            **tally.metrics(samples, total_tokens),
            "grad_norm": grad_norm,
            "tokens": float(total_tokens),
            "samples": float(len(samples)),
            "train_s": time.monotonic() - t0,
            "checkpoint_gate_s": gate_s,  # part of train_s spent waiting for a checkpoint write to finish
            "publish_gate_s": publish_gate_s,  # part of train_s spent waiting for the live weights to be written
        }

    def _backward(self, samples: list[Sample], total_tokens: int) -> StepTally:
        """The objective's gradients, summed over this rank's micro-batches; the step's figures counted."""
        import torch

        eps, cap = self.cfg.clip_eps, self.cfg.is_cap
        tally = StepTally(eps, cap)
        world = self.ranks.world_size if self.ranks is not None else 1
        chunks = self.passes.micro_batches(samples)
        keeps = self._keeps(chunks)
        for n, (chunk, real) in enumerate(chunks):
            logp, mask, behaviour = self.passes.token_tensors(chunk, real)
            # π_prox is this step's starting policy: the weights ``logp`` was just computed with (the
            # optimiser steps only after every micro-batch), so its values need no second forward pass
            prox = logp.detach() if any(not on_policy(c) for c in chunk) else behaviour
            adv = torch.tensor([c.advantage for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            weight = torch.tensor([c.weight for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            keep = None
            if self.cfg.correction == "m2po":
                keep = keeps[n] if keeps is not None else second_moment_keep(logp - behaviour, mask,
                                                                             self.cfg.m2_threshold)
            per_token, ratio, log_is = token_objective(logp, prox, behaviour, adv, weight, mask, eps, cap,
                                                       self.cfg.is_level, self.cfg.correction, keep)
            loss = per_token.sum() / max(1, total_tokens)
            (loss * world).backward()  # FSDP averages gradients over the ranks; the loss is already the batch's
            with torch.no_grad():
                tally.add(chunk, loss, ratio, log_is, logp, behaviour, mask, keep)
        tally.reduce(self.ranks)
        return tally

    def _keeps(self, chunks: list[MicroBatch]) -> list[Tensor] | None:
        """M2PO's mask is chosen over the whole batch: with more than one micro-batch (or rank) it needs every
        token's ratio before the first backward pass, so a pass without gradients comes first. None where the
        micro-batch's own tokens are the batch (or the correction is not m2po)."""
        if self.cfg.correction != "m2po" or (len(chunks) <= 1 and self.ranks is None):
            return None
        return self.passes.second_moment_keeps(chunks, self.cfg.m2_threshold, self.device)

    def _update(self) -> tuple[float, float, float]:
        """The gradient clipped and the update taken; (gradient norm, seconds waited for the checkpoint's tensors,
        for the version's weights)."""
        import torch

        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        gate_s, publish_gate_s = self.gates.wait()
        self.optimizer.step()
        # the gradients are not read again before the next backward pass: freed now, the hand-over copy and the
        # publication that follow a step do not stack on them (docs/benchmarks.md, the learner's memory)
        self.optimizer.zero_grad(set_to_none=True)
        release_free_heap()  # the step's small blocks: not left resident under the publication that follows
        return grad_norm, gate_s, publish_gate_s
