"""The GRPO learner: recomputes behaviour logprobs for verification and takes clipped policy-gradient steps.

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
and FlashRL for a quantised sampler — PPO around π_prox, weighted by min(c, π_prox/π_b). The learner's model is
touched only by the learner's thread; verification, publication and evaluation read published snapshots or copies
handed over after a step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine import fsdp, lora
from coordinator.engine.bf16_adamw import StochasticBf16AdamW
from coordinator.engine.evaluation import greedy_accuracy, pad_id
from coordinator.engine.fsdp import single_rank
from coordinator.engine.head import contiguous_input, streamed_logprobs
from coordinator.engine.step_tally import StepTally
from coordinator.engine.tied import TiedEmbeddingGradient
from coordinator.memory import release_free_heap
from coordinator.publish.checkpoints import CheckpointState, ShardedCheckpoint
from coordinator.publish.gguf_export import write_model_ggufs
from coordinator.publish.snapshots import SnapshotFiles
from coordinator.publish.weights_file import StoredWeights
from coordinator.tasks.base import Task, TaskItem
from shared.policy import (
    completion_logprobs,
    load_model,
    load_tokenizer,
    pick_device,
    plain_head,
    stop_token_ids,
)

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks
    from coordinator.publish.snapshots import SnapshotFiles

logger = logging.getLogger(__name__)

MICRO_BATCH = 64


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


#: The sampling class whose fresh rollouts are this step's policy's own (π_b = πθ): a torch float32 client's.
OWN_CLASS = "torch"


def on_policy(sample: Sample) -> bool:
    """Whether π_b is πθ at the start of the step: a fresh rollout of the learner's own class. Any other — stale,
    or sampled in another precision however fresh — needs π_prox, this step's policy, beside π_b."""
    return sample.staleness == 0 and sample.source == OWN_CLASS


class LearnerDescription(TypedDict):
    """What the learner role's report says of its model (coordinator.roles.learner)."""

    parameters: int
    device: str
    vocab_size: int


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # the verifier's recompute at the behaviour version (π_b)
    behaviour_logprobs: list[float]  # as reported by the client
    advantage: float
    staleness: int = 0
    weight: float = 1.0
    loss_mask: list[int] | None = None  # 1 on the model's tokens, 0 on an episode's observation tokens (not trained)
    source: str = "torch"  # the class that sampled it ("torch", "llama-q4_K_M", ...): π_b's precision, for metrics


def _load_policy(model_dir: Path, adapter_dir: Path | None, lora_on: bool, device: str, dtype: str) -> Any:
    """The policy to train: the model folder's, or a LoRA version's base (its adapter is loaded once wrapped), or
    — LoRA switched off mid-run — that base with the adapter merged."""
    if adapter_dir is not None and not lora_on:
        return lora.load_version_model(model_dir, adapter_dir, device, dtype)
    if adapter_dir is not None:
        return lora.load_base_model(model_dir, device, dtype)
    return load_model(model_dir, device, dtype)


def _optimizer(trainable: list[Any], cfg: LearnerConfig, *, fused: bool) -> Any:
    """bf16 weights and moments, stochastically rounded (LearnerConfig.precision), or AdamW — ``fused`` on one CPU or
    CUDA device: one kernel per tensor with no temporaries (the for-loop form allocates two of each parameter's
    size, 1 GB at a 0.5 B model's embedding) and ~10x faster on a CPU."""
    import torch

    if cfg.precision == "bf16":
        return StochasticBf16AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    return torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


class Learner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: LearnerConfig, temperature: float,
                 gguf: str | Sequence[str] = "off", ranks: Ranks | None = None) -> None:
        """``gguf``: the precisions of the GGUF forms published with every version (snapshots.offered(), the
        default first; one name, or "off" / () for none). ``ranks``: this process's place among the learner's FSDP ranks (coordinator.engine.fsdp), None on one
        device without FSDP. On rank 0 of several, the other ranks build the same learner from ``model_dir``."""
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        fsdp.lead(ranks, "init", str(model_dir), cfg.model_dump(mode="json"))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.temperature = temperature
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else pick_device(model_cfg.device)
        self.gguf: tuple[str, ...] = ((gguf,) if gguf != "off" else ()) if isinstance(gguf, str) else tuple(gguf)
        self.lora = cfg.lora_rank > 0
        # a LoRA version folder (resuming a run) holds an adapter: the model is its base plus that adapter
        adapter_dir = Path(model_dir) if lora.is_adapter_folder(Path(model_dir)) else None
        if adapter_dir is not None:
            model_dir = lora.base_folder_for(adapter_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self._model_dir = Path(model_dir)
        dtype = "bfloat16" if cfg.precision == "bf16" else model_cfg.dtype
        self.model = _load_policy(Path(model_dir), adapter_dir, self.lora, self.device, dtype)
        # each GRPO group's prompt runs once per micro-batch, its KV cache copied to the group's completions (a
        # group repeats its prompt group_size times). Not where the cache is not a plain one: activation
        # checkpointing turns it off, peft's wrapper hides its name, FSDP ranks must all run the same passes
        self.share_prompts = not (cfg.activation_checkpointing or self.lora or ranks is not None)
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            self.model = lora.wrap(self.model, cfg)
            if adapter_dir is not None:
                lora.load_adapter(self.model, adapter_dir)
        if ranks is not None:  # every rank holds the whole model until here; now each keeps its shards
            if self.lora and adapter_dir is None:  # fresh adapters are random: every rank takes rank 0's
                fsdp.from_leader(ranks, [p for p in self.model.parameters() if p.requires_grad])
            fsdp.shard(self.model, ranks, cfg.mixed_precision)
        self.model.train()
        self._plan_output_layer()
        self.pad_id = pad_id(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        if not self.stop_ids:
            raise ValueError(f"the tokenizer in {model_dir} defines no end-of-sequence token; set eos_token in its "
                             f"tokenizer_config.json so completions can stop")
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.optimizer: Any = _optimizer([p for p in self.model.parameters() if p.requires_grad], cfg,
                                         fused=ranks is None and torch.device(self.device).type in ("cpu", "cuda"))
        self.model_version = 0
        # set while a checkpoint is being written from the live tensors: the next optimizer step waits for it
        self._checkpoint_gate: threading.Event | None = None
        # set while a version's files are being written from the live weights (snapshot_files): the same
        self._publish_gate: threading.Event | None = None
        self._static_files: dict[str, bytes] | None = None  # config and tokenizer files of every snapshot
        self._lora_base: dict[str, Tensor] | None = None  # FSDP + LoRA: the frozen base, gathered once (rank 0)

    def _plan_output_layer(self) -> None:
        """How the training pass meets the output layer. A tied embedding's gradients are summed in place in one
        tensor, not in more [vocab, hidden] ones (engine.tied); the layer is applied a vocabulary slice at a time
        (engine.head), never holding the [tokens × vocabulary] logits — neither through peft's wrapper or FSDP's
        shards, nor for a head that is not plain; and it is handed a contiguous input, so autograd's products make
        no per-sequence copies of its weight."""
        output = self.model.get_output_embeddings()
        alone = self.ranks is None and not self.lora
        self._tied = (TiedEmbeddingGradient(self.model.get_input_embeddings(), output) if alone
                      and output is not None and output.weight is self.model.get_input_embeddings().weight else None)
        self.stream_head = alone and plain_head(self.model)
        if output is not None and self.ranks is None:
            contiguous_input(output)

    # -- prompts ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- the current policy's logprobs (benches and tests; results are verified by coordinator.engine.verifier) ------
    def recompute(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Logprobs of each completion token under the learner's current weights, no gradient."""
        import torch

        single_rank(self.ranks, "Learner.recompute")
        out: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(completions), MICRO_BATCH):
                lp, _ = completion_logprobs(self.model, prompts[s : s + MICRO_BATCH],
                                            completions[s : s + MICRO_BATCH], temperature=self.temperature,
                                            pad_id=self.pad_id)
                rows = lp.tolist()
                out.extend(row[: len(c)] for row, c in zip(rows, completions[s : s + MICRO_BATCH], strict=True))
        return out

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float | dict[str, float]]:
        import torch

        fsdp.lead(self.ranks, "train_step", samples)
        t0 = time.monotonic()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples)
        eps, cap = self.cfg.clip_eps, self.cfg.is_cap
        tally = StepTally(eps, cap)
        world = self.ranks.world_size if self.ranks is not None else 1
        chunks = self._micro_batches(samples)
        m2po = self.cfg.correction == "m2po"
        # M2PO's mask is chosen over the whole batch: with more than one micro-batch (or rank) it needs every
        # token's ratio before the first backward pass, so a pass without gradients comes first
        keeps = self._second_moment_keeps(chunks) if m2po and (len(chunks) > 1 or self.ranks is not None) else None
        for n, (chunk, real) in enumerate(chunks):
            logp, mask, behaviour = self._token_tensors(chunk, real)
            # π_prox is this step's starting policy: the weights ``logp`` was just computed with (the
            # optimiser steps only after every micro-batch), so its values need no second forward pass
            prox = logp.detach() if any(not on_policy(c) for c in chunk) else behaviour
            adv = torch.tensor([c.advantage for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            weight = torch.tensor([c.weight for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            keep = None
            if m2po:
                keep = keeps[n] if keeps is not None else second_moment_keep(logp - behaviour, mask,
                                                                             self.cfg.m2_threshold)
            per_token, ratio, log_is = token_objective(logp, prox, behaviour, adv, weight, mask, eps, cap,
                                                       self.cfg.is_level, self.cfg.correction, keep)
            loss = per_token.sum() / max(1, total_tokens)
            (loss * world).backward()  # FSDP averages gradients over the ranks; the loss is already the batch's
            with torch.no_grad():
                tally.add(chunk, loss, ratio, log_is, logp, behaviour, mask, keep)
        tally.reduce(self.ranks)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        gate_s, publish_gate_s = self._await_gates()
        self._checkpoint_gate = self._publish_gate = None
        self.optimizer.step()
        # the gradients are not read again before the next backward pass: freed now, the hand-over copy and the
        # publication that follow a step do not stack on them (docs/benchmarks.md, the learner's memory)
        self.optimizer.zero_grad(set_to_none=True)
        release_free_heap()  # the step's small blocks: not left resident under the publication that follows
        self.model_version += 1
        return {
            **tally.metrics(samples, total_tokens),
            "grad_norm": grad_norm,
            "tokens": float(total_tokens),
            "samples": float(len(samples)),
            "train_s": time.monotonic() - t0,
            "checkpoint_gate_s": gate_s,  # part of train_s spent waiting for a checkpoint write to finish
            "publish_gate_s": publish_gate_s,  # part of train_s spent waiting for the live weights to be written
        }

    def _token_tensors(self, chunk: list[Sample], real: bool) -> tuple[Tensor, Tensor, Tensor]:
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

    def _second_moment_keeps(self, chunks: list[tuple[list[Sample], bool]]) -> list[Tensor]:
        """M2PO's mask for each of this rank's micro-batches, chosen over the tokens of the whole batch (every
        rank's, in rank order): a forward pass without gradients for log πθ/π_b at the start of the step."""
        import torch

        ratios: list[Tensor] = []
        masks: list[Tensor] = []
        with torch.no_grad():
            for chunk, real in chunks:
                logp, mask, behaviour = self._token_tensors(chunk, real)
                ratios.append((logp - behaviour).cpu())
                masks.append(mask.cpu())
        mine = torch.cat([r[m > 0] for r, m in zip(ratios, masks, strict=True)]).to(torch.float64)
        threshold = self.cfg.m2_threshold
        if self.ranks is None:
            flat = second_moment_keep(mine, torch.ones_like(mine), threshold)
        else:  # rank 0 chooses over every rank's tokens and hands each rank its part
            every = fsdp.gather(self.ranks, mine.tolist())
            parts: list[list[float]] | None = None
            if every is not None:
                values = torch.tensor([v for part in every for v in part], dtype=torch.float64)
                chosen = second_moment_keep(values, torch.ones_like(values), threshold).tolist()
                bounds = [0]
                for part in every:
                    bounds.append(bounds[-1] + len(part))
                parts = [chosen[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
            flat = torch.tensor(fsdp.broadcast(self.ranks, parts)[self.ranks.rank], dtype=torch.float64)
        keeps: list[Tensor] = []
        offset = 0
        for mask in masks:
            keep = torch.zeros(mask.shape, dtype=mask.dtype)
            count = int((mask > 0).sum())
            keep[mask > 0] = flat[offset : offset + count].to(mask.dtype)
            offset += count
            keeps.append(keep.to(self.device))
        return keeps

    def _micro_batches(self, samples: list[Sample]) -> list[tuple[list[Sample], bool]]:
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

    # -- persistence --------------------------------------------------------------------------------------
    def save_model(self, folder: Path) -> None:
        """Write a version: the Hugging Face folder, plus its GGUF forms (one per offered precision)."""

        single_rank(self.ranks, "Learner.save_model (the publisher's snapshot_files gathers the shards)")
        if self.lora:  # a self-contained LoRA version: the base files and this version's adapter in one folder
            files = self._lora_snapshot_files("training")
            for name, write_shared in files.shared.items():
                write_shared(folder / name)
            files.write(folder)
            return
        self.model.save_pretrained(str(folder), safe_serialization=True)
        self.tokenizer.save_pretrained(str(folder))
        if self.gguf:
            write_model_ggufs(folder, self.model.state_dict(), self.gguf)

    # -- publication (coordinator.publish.publisher) -----------------------------------------------------------
    def publish_dtype(self, configured: str) -> str:
        """The dtype snapshots are written in: ``snapshots.dtype``, where "training" means the model's own."""
        if configured != "training":
            return configured
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def snapshot_files(self, dtype: str = "training") -> SnapshotFiles:
        """On the learner thread, right after a step: what the publisher needs to write this version while the
        learner goes on training. Full weights: the state dict in the publish dtype on the CPU, as
        ``SnapshotFiles.weights`` (the store writes ``model.safetensors`` from it, then ``write`` adds the config and
        tokenizer files and the GGUF form, read back from that file).

        Where the live weights already are that (a bf16 learner on the CPU publishing bf16, not FSDP, not LoRA)
        they are handed over themselves, not copied (2 B/param less at the learner's peak): the next optimizer
        update waits until the publisher has written them (:meth:`_await_gates`), as for a checkpoint; that
        step's forward and backward passes run meanwhile. Otherwise one CPU copy (the copy is the dtype conversion
        or the transfer off the accelerator), freed once written."""
        import torch

        fsdp.lead(self.ranks, "snapshot_files", dtype)
        if self.lora:
            return self._lora_snapshot_files(dtype)
        target = getattr(torch, self.publish_dtype(dtype))
        live = False
        if self.ranks is not None:  # gathered from the shards, one tensor at a time; only rank 0 keeps them
            state = fsdp.full_tensors(self.model.state_dict().items(), self.ranks.leader, target)
            if not self.ranks.leader:
                return SnapshotFiles(lambda folder: None)
        else:
            current = self.model.state_dict()
            live = all(v.device.type == "cpu" and v.is_contiguous()
                       and (v.dtype == target or not v.is_floating_point()) for v in current.values())
            if live:
                state = {k: v.detach() for k, v in current.items()}
            else:
                state = {k: v.detach().to("cpu", dtype=target if v.is_floating_point() else v.dtype, copy=True)
                         for k, v in current.items()}
            del current
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embeddings, stored once (as save_pretrained does)
        static = self._snapshot_static_files(self.publish_dtype(dtype))
        gguf = self.gguf
        order = list(state)

        def write(folder: Path) -> None:
            for name, data in static.items():
                (folder / name).write_bytes(data)
            if gguf:  # from the published (settled) values, a block of rows at a time
                write_model_ggufs(folder, StoredWeights(folder / "model.safetensors", order), gguf)

        files = SnapshotFiles(write, weights=state)
        if live:
            self._publish_gate = files.written
        return files

    def _lora_snapshot_files(self, dtype: str) -> SnapshotFiles:
        """A LoRA version (coordinator.engine.lora has the layout): its own files are the adapter, copied here (a few
        MB at most); the frozen base (HF files and base.gguf) is a run-level shared file set, written once."""
        import torch

        if self.ranks is not None:  # the adapter gathered every version, the frozen base once per process
            keep = self.ranks.leader
            trainable = fsdp.full_tensors(((n, p) for n, p in self.model.named_parameters() if p.requires_grad),
                                          keep, torch.float32)
            if self._lora_base is None:
                self._lora_base = lora.plain_names(fsdp.full_tensors(
                    ((n, v) for n, v in self.model.state_dict().items() if ".lora_" not in n), keep))
            if not keep:
                return SnapshotFiles(lambda folder: None)
            snap = lora.adapter_snapshot(self.model, trainable)
        else:
            snap = lora.adapter_snapshot(self.model)
        publish = self.publish_dtype(dtype)
        static = self._snapshot_static_files(publish)
        gguf = self.gguf[0] if self.gguf else "off"  # a LoRA run offers one precision (config)
        shared = lora.base_writers(self.model, static, getattr(torch, publish), gguf, self._lora_base)

        def write(folder: Path) -> None:
            lora.write_adapter(folder, snap, static, gguf)

        return SnapshotFiles(write, shared)

    def _snapshot_static_files(self, dtype: str) -> dict[str, bytes]:
        """config.json (its dtype set to the publish dtype), generation config and tokenizer files, once."""
        if self._static_files is None:
            import json
            import tempfile

            with tempfile.TemporaryDirectory(prefix="echo-swarm-static-") as tmp:
                self.model.config.save_pretrained(tmp)
                if getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
            spm = self._model_dir / "tokenizer.model"  # transformers 5 saves no SentencePiece model; llama.cpp's
            if spm.is_file() and spm.name not in files:  # Gemma converter reads its vocabulary from it
                files[spm.name] = spm.read_bytes()
            config = json.loads(files["config.json"])
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = dtype
            files["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
            self._static_files = files
        return self._static_files

    # -- checkpoints (coordinator.publish.checkpoints) ----------------------------------------------------------
    def checkpoint_state(self, staging: Path | None = None) -> CheckpointState:
        """References to the trainable weights and the optimizer state at this version, for the publisher to
        write while the next step's forward and backward passes run; that step's optimizer update waits until
        the publisher calls ``release`` (:meth:`_await_gates`), so nothing is copied.

        On FSDP ranks every rank writes its shards into ``staging`` now (torch.distributed.checkpoint); the
        publisher then only completes the checkpoint (coordinator.publish.checkpoints)."""
        if self.ranks is not None:
            if staging is None:
                raise ValueError("a sharded checkpoint needs a staging folder")
            fsdp.lead(self.ranks, "checkpoint_state", staging)
            with_optimizer = fsdp.save_checkpoint(self.model, self.optimizer, staging)
            return CheckpointState(self.model_version, {}, {}, lambda: None,
                                   sharded=ShardedCheckpoint(str(staging), self.ranks.world_size, with_optimizer))
        gate = threading.Event()
        self._checkpoint_gate = gate
        weights = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        return CheckpointState(self.model_version, weights, self.optimizer.state_dict(), gate.set)

    def _await_gates(self) -> tuple[float, float]:
        """Before an optimizer update: wait until the publisher has released the live tensors it was handed, the
        checkpoint's (written first) and the version's weights (:meth:`snapshot_files`); seconds waited for each.
        The publisher never waits for the learner, so these waits end (a failed write releases too)."""
        return self._wait(self._checkpoint_gate), self._wait(self._publish_gate)

    def _wait(self, gate: threading.Event | None) -> float:
        if gate is None or gate.is_set():
            return 0.0
        t0 = time.monotonic()
        gate.wait()
        return time.monotonic() - t0

    def load_sharded_checkpoint(self, folder: Path, version: int, world_size: int, with_optimizer: bool) -> None:
        """Restore a sharded checkpoint (written on ``world_size`` ranks) on every rank; then at ``version``."""

        mine = self.ranks.world_size if self.ranks is not None else 1
        if self.ranks is None or world_size != mine:
            raise ValueError(f"the checkpoint of version {version} was written by a learner on {world_size} FSDP "
                             f"ranks and this learner has {mine if self.ranks is not None else 'no FSDP ranks'}; "
                             f"resume with learner.world_size = {world_size} (the run's own setting)")
        fsdp.lead(self.ranks, "load_sharded_checkpoint", folder, version, world_size, with_optimizer)
        fsdp.load_checkpoint(self.model, self.optimizer, Path(folder), with_optimizer)
        self.model_version = version

    def load_checkpoint(self, weights: dict[str, Tensor], optimizer: dict[str, Any], version: int) -> None:
        """Restore a checkpoint's trainable weights and optimizer state; the learner is then at ``version``."""
        import torch

        if self.ranks is not None:
            raise ValueError(f"the checkpoint of version {version} was written by a learner on one device without "
                             f"FSDP; resume with learner.world_size = 1 and learner.fsdp unset")
        params = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise ValueError(f"the checkpoint of version {version} has weights this model lacks: {unknown[:3]}")
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
        self.optimizer.load_state_dict(optimizer)
        self.model_version = version

    def load_optimizer(self, path: Path) -> bool:
        import torch

        if not path.exists():
            return False
        if self.ranks is not None:
            raise ValueError(f"{path} is a single-device optimizer state; resume this run with learner.world_size "
                             f"= 1 and learner.fsdp unset")
        self.optimizer.load_state_dict(torch.load(path, weights_only=True, map_location=self.device))
        return True

    def evaluate(self, task: Task, items: list[TaskItem], max_tokens: int) -> float:
        single_rank(self.ranks, "Learner.evaluate (the verifiers evaluate published versions)")
        return greedy_accuracy(self.model, self.tokenizer, task, items, max_tokens)

    def describe(self) -> LearnerDescription:
        n = sum(p.numel() for p in self.model.parameters())
        return {"parameters": n, "device": self.device, "vocab_size": self.vocab_size}
