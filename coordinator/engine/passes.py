"""How a learner step's batch goes through the model: micro-batches (split across FSDP ranks), each one's token
logprobs with its mask of trained tokens and π_b beside them, and the output layer's plan for those passes.

Split from coordinator/engine/learner.py (issue 33): the step (coordinator.engine.policy_step) decides what to do
with the logprobs; this only makes them, the same way for the gradient pass, M2PO's pass without gradients and the
learner's plain recompute, so that all three see the same tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from coordinator.engine import fsdp
from coordinator.engine.head import contiguous_input, streamed_logprobs
from coordinator.engine.objective import Sample, second_moment_keep
from coordinator.engine.tied import TiedEmbeddingGradient, lookup_scale
from shared.policy import completion_logprobs, plain_head

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks

MICRO_BATCH = 64

#: A micro-batch of samples, and whether it is real (False: a stand-in on a rank whose share ran out).
MicroBatch = tuple[list[Sample], bool]


class TokenPasses:
    """The learner's passes over its model. ``model`` is the policy as trained (after LoRA wrapping and FSDP
    sharding, in train mode); ``ranks`` its FSDP group (None on one device); ``lora``: peft wraps it;
    ``share_prompts``: each GRPO group's prompt runs once per micro-batch (coordinator.engine.learner says when)."""

    def __init__(self, model: Any, *, ranks: Ranks | None, lora: bool, temperature: float, pad_id: int,
                 share_prompts: bool) -> None:
        self.model = model
        self.ranks = ranks
        self.temperature = temperature
        self.pad_id = pad_id
        self.share_prompts = share_prompts
        self._plan_output_layer(lora)

    def _plan_output_layer(self, lora: bool) -> None:
        """How the training pass meets the output layer. A tied embedding's gradients are summed in place in one
        tensor, not in more [vocab, hidden] ones (engine.tied); the layer is applied a vocabulary slice at a time
        (engine.head), never holding the [tokens × vocabulary] logits — neither through peft's wrapper or FSDP's
        shards, nor for a head that is not plain; and it is handed a contiguous input, so autograd's products make
        no per-sequence copies of its weight."""
        output = self.model.get_output_embeddings()
        lookup = self.model.get_input_embeddings()
        alone = self.ranks is None and not lora
        # only where the hook can recompute the lookup as the module does (a plain or a scaled one, e.g. Gemma's)
        scale = (lookup_scale(lookup) if alone and output is not None and output.weight is lookup.weight
                 else None)
        self.tied = TiedEmbeddingGradient(lookup, output, scale) if scale is not None else None
        self.stream_head = alone and plain_head(self.model)
        if output is not None and self.ranks is None:
            contiguous_input(output)

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """This rank's micro-batches, each flagged real or not. On N ranks each takes every N-th sample and all
        take the same number of micro-batches (FSDP gathers every block once per forward on every rank): a rank
        whose share ran out gets a one-token stand-in whose loss is masked to zero."""
        if self.ranks is None:
            return [(samples[s : s + MICRO_BATCH], True) for s in range(0, len(samples), MICRO_BATCH)]
        world = self.ranks.world_size
        mine = samples[self.ranks.rank :: world]
        count = max(1, math.ceil(math.ceil(len(samples) / world) / MICRO_BATCH))
        filler = [Sample([self.pad_id], [self.pad_id], [0.0], [0.0], 0.0, 0, 0.0)]
        chunks = [mine[i * MICRO_BATCH : (i + 1) * MICRO_BATCH] for i in range(count)]
        return [(chunk, True) if chunk else (filler, False) for chunk in chunks]

    def token_tensors(self, chunk: list[Sample], real: bool) -> tuple[Tensor, Tensor, Tensor]:
        """A micro-batch's logprobs under the current weights (with gradients where enabled), its mask of the
        tokens trained on (none for a stand-in, no observation tokens) and π_b's logprobs, all [sequences, tokens]."""
        import torch

        prompts, comps = [c.prompt_ids for c in chunk], [c.completion_ids for c in chunk]
        logprobs = streamed_logprobs if self.stream_head else completion_logprobs
        logp, mask = logprobs(self.model, prompts, comps, temperature=self.temperature, pad_id=self.pad_id,
                              share_prompts=self.share_prompts)
        if not real:  # a rank with no samples left still joins FSDP's collectives, contributing nothing
            mask = mask * 0
        if any(c.loss_mask is not None for c in chunk):  # observation tokens: context, never trained on
            mask = mask.clone()
            for i, c in enumerate(chunk):
                if c.loss_mask is not None:
                    mask[i, : len(c.loss_mask)] *= torch.tensor(c.loss_mask, dtype=mask.dtype, device=mask.device)
        behaviour = torch.zeros_like(logp)
        for i, c in enumerate(chunk):
            behaviour[i, : len(c.old_logprobs)] = torch.tensor(c.old_logprobs, dtype=logp.dtype)
        return logp, mask, behaviour

    def second_moment_keeps(self, chunks: list[MicroBatch], threshold: float, device: str) -> list[Tensor]:
        """M2PO's mask for each of this rank's micro-batches, chosen over the tokens of the whole batch (every
        rank's, in rank order): a forward pass without gradients for log πθ/π_b at the start of the step."""
        import torch

        ratios: list[Tensor] = []
        masks: list[Tensor] = []
        with torch.no_grad():
            for chunk, real in chunks:
                logp, mask, behaviour = self.token_tensors(chunk, real)
                ratios.append((logp - behaviour).cpu())
                masks.append(mask.cpu())
        mine = torch.cat([r[m > 0] for r, m in zip(ratios, masks, strict=True)]).to(torch.float64)
        flat = self._batch_keep(mine, threshold)
        keeps: list[Tensor] = []
        offset = 0
        for mask in masks:
            keep = torch.zeros(mask.shape, dtype=mask.dtype)
            count = int((mask > 0).sum())
            keep[mask > 0] = flat[offset : offset + count].to(mask.dtype)
            offset += count
            keeps.append(keep.to(device))
        return keeps

    def _batch_keep(self, mine: Tensor, threshold: float) -> Tensor:
        """M2PO's keep flags of this rank's tokens (``mine``: their log ratios, flat), chosen over every rank's."""
        import torch

        if self.ranks is None:
            return second_moment_keep(mine, torch.ones_like(mine), threshold)
        # rank 0 chooses over every rank's tokens and hands each rank its part
        every = fsdp.gather(self.ranks, mine.tolist())
        parts: list[list[float]] | None = None
        if every is not None:
            values = torch.tensor([v for part in every for v in part], dtype=torch.float64)
            chosen = second_moment_keep(values, torch.ones_like(values), threshold).tolist()
            bounds = [0]
            for part in every:
                bounds.append(bounds[-1] + len(part))
            parts = [chosen[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return torch.tensor(fsdp.broadcast(self.ranks, parts)[self.ranks.rank], dtype=torch.float64)

    def recompute(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Logprobs of each completion token under the current weights, no gradient (the plain pass)."""
        import torch

        out: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(completions), MICRO_BATCH):
                lp, _ = completion_logprobs(self.model, prompts[s : s + MICRO_BATCH],
                                            completions[s : s + MICRO_BATCH], temperature=self.temperature,
                                            pad_id=self.pad_id)
                rows = lp.tolist()
                out.extend(row[: len(c)] for row, c in zip(rows, completions[s : s + MICRO_BATCH], strict=True))
        return out
