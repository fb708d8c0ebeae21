"""The GRPO learner: recomputes behaviour logprobs for verification and takes clipped policy-gradient steps.

Loss per token, token-mean over the batch. Two off-policy corrections (``learner.correction``):

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

π_b is the learner's own recompute at the version that generated the rollout (trusted, unlike the client's
report); π_prox the learner's policy at the start of this step (no gradient); w = ``staleness_decay`` **
staleness; A the group-normalised advantage. For a fresh rollout π_b = π_prox = πθ when the gradient is
taken, both corrections are plain GRPO, and co-located or sequential-pull training is unaffected by the
choice. All torch work of the coordinator happens on one dedicated thread, so the model is never read while
it is being updated.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.evaluation import greedy_accuracy, pad_id
from coordinator.tasks import Task, TaskItem

logger = logging.getLogger(__name__)

MICRO_BATCH = 64


def token_objective(logp: Any, prox: Any, behaviour: Any, adv: Any, weight: Any, mask: Any, eps: float,
                    cap: float, level: str = "token", correction: str = "behaviour-clip") -> tuple[Any, Any, Any]:
    """Per-token loss (module docstring), plus the clipped ratio (πθ/π_b for ``behaviour-clip``, πθ/π_prox
    for ``decoupled``) and log(π_prox/π_b) for metrics.

    All tensors are [sequences, tokens] (``adv`` and ``weight`` broadcast from [sequences, 1]); ``mask`` is 1
    on real completion tokens. ``level`` ("token" or "sequence") applies to the decoupled importance weight,
    which carries no gradient.
    """
    import torch

    log_is = ((prox - behaviour) * mask).detach()
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


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # learner recompute at the behaviour version (π_b)
    behaviour_logprobs: list[float]  # as reported by the client
    advantage: float
    staleness: int = 0
    weight: float = 1.0


class Learner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: LearnerConfig, temperature: float,
                 gguf: str = "off") -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from shared.policy import load_model, load_tokenizer, pick_device, stop_token_ids

        hf_logging.disable_progress_bar()

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.temperature = temperature
        self.device = pick_device(model_cfg.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, self.device, model_cfg.dtype)
        self.gguf = gguf  # precision of the GGUF form published with every version ("off": none)
        self.lora = cfg.lora_rank > 0
        if self.lora:
            from coordinator import lora

            self.model = lora.wrap(self.model, cfg)
        self.model.train()
        self.pad_id = pad_id(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        if not self.stop_ids:
            raise ValueError(f"the tokenizer in {model_dir} defines no end-of-sequence token; set eos_token in its "
                             f"tokenizer_config.json so completions can stop")
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.model_version = 0
        self._behaviour: Any = None  # a second model holding an older version's weights, for stale results
        self._behaviour_version: int | None = None

    # -- prompts ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- verification -------------------------------------------------------------------------------------
    def _model_at(self, version: int, folder: Path | None) -> Any:
        """The current model, or a second instance loaded with an older published version's weights."""
        if version == self.model_version:
            return self.model
        if folder is None:
            raise ValueError(f"version {version} is not the learner's current version ({self.model_version})")
        if self._behaviour_version != version:
            import copy

            from safetensors.torch import load_file

            if self.lora:  # a LoRA run publishes merged weights under plain names: verify with a plain model
                from shared.policy import load_model

                if not any(Path(folder).glob("*.safetensors")):
                    raise FileNotFoundError(f"no weights for version {version} in {folder}")
                self._behaviour_version = None
                self._behaviour = load_model(Path(folder), self.device).eval()
                self._behaviour_version = version
                return self._behaviour
            if self._behaviour is None:
                self._behaviour = copy.deepcopy(self.model).eval()
            shards = sorted(Path(folder).glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"no weights for version {version} in {folder}")
            state: dict[str, Any] = {}
            for shard in shards:
                state.update(load_file(str(shard), device=str(self.device)))
            self._behaviour_version = None  # until the load below has fully succeeded
            self._behaviour.load_state_dict(state, strict=False)
            self._behaviour_version = version
        return self._behaviour

    def recompute(self, prompts: list[list[int]], completions: list[list[int]], version: int | None = None,
                  folder: Path | None = None) -> list[list[float]]:
        """Logprobs of each completion token under policy ``version`` (default: current), no gradient.
        ``folder`` is that version's snapshot, needed when it is not the current version."""
        import torch

        from shared.policy import completion_logprobs

        model = self._model_at(self.model_version if version is None else version, folder)
        out: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(completions), MICRO_BATCH):
                lp, _ = completion_logprobs(model, prompts[s : s + MICRO_BATCH], completions[s : s + MICRO_BATCH],
                                            temperature=self.temperature, pad_id=self.pad_id)
                rows = lp.tolist()
                out.extend(row[: len(c)] for row, c in zip(rows, completions[s : s + MICRO_BATCH], strict=True))
        return out

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        import torch

        from shared.policy import completion_logprobs

        t0 = time.monotonic()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(s.completion_ids) for s in samples)
        eps, cap = self.cfg.clip_eps, self.cfg.is_cap
        loss_sum = ratio_sum = clipped = is_sum = is_truncated = prox_kl = 0.0
        ratio_max = is_max = 0.0
        for s in range(0, len(samples), MICRO_BATCH):
            chunk = samples[s : s + MICRO_BATCH]
            prompts, comps = [c.prompt_ids for c in chunk], [c.completion_ids for c in chunk]
            logp, mask = completion_logprobs(self.model, prompts, comps, temperature=self.temperature,
                                             pad_id=self.pad_id)
            behaviour = torch.zeros_like(logp)
            for i, c in enumerate(chunk):
                behaviour[i, : len(c.old_logprobs)] = torch.tensor(c.old_logprobs, dtype=logp.dtype)
            # π_prox is this step's starting policy: the weights ``logp`` was just computed with (the
            # optimiser steps only after every micro-batch), so its values need no second forward pass
            prox = logp.detach() if any(c.staleness > 0 for c in chunk) else behaviour
            adv = torch.tensor([c.advantage for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            weight = torch.tensor([c.weight for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            per_token, ratio, log_is = token_objective(logp, prox, behaviour, adv, weight, mask, eps, cap,
                                                       self.cfg.is_level, self.cfg.correction)
            loss = per_token.sum() / max(1, total_tokens)
            loss.backward()
            with torch.no_grad():
                loss_sum += float(loss)
                ratio_sum += float((ratio * mask).sum())
                ratio_max = max(ratio_max, float((ratio * mask).max()))
                clipped += float((((ratio < 1 - eps) | (ratio > 1 + eps)).to(mask.dtype) * mask).sum())
                raw_is = torch.exp(log_is)
                is_sum += float((raw_is * mask).sum())
                is_max = max(is_max, float((raw_is * mask).max()))
                is_truncated += float(((raw_is > cap).to(mask.dtype) * mask).sum())
                # k3 estimate of KL(π_b ‖ π_prox) from tokens sampled by π_b: r − log r − 1, r = π_prox/π_b
                prox_kl += float(((raw_is - log_is - 1) * mask).sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        self.optimizer.step()
        self.model_version += 1
        mismatch = [
            (b - o) for smp in samples for b, o in zip(smp.behaviour_logprobs, smp.old_logprobs, strict=True)
        ]
        # k3 estimator of KL(behaviour || learner) from log r = old - behaviour: r - log r - 1
        kl = sum(math.exp(-d) + d - 1 for d in mismatch) / max(1, len(mismatch))
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "ratio_mean": ratio_sum / max(1, total_tokens),
            "ratio_max": ratio_max,
            "clipped_fraction": clipped / max(1, total_tokens),
            "is_ratio_mean": is_sum / max(1, total_tokens),
            "is_ratio_max": is_max,
            "is_truncated_fraction": is_truncated / max(1, total_tokens),
            "behaviour_prox_kl": prox_kl / max(1, total_tokens),
            "staleness_mean": sum(smp.staleness for smp in samples) / max(1, len(samples)),
            "staleness_max": float(max((smp.staleness for smp in samples), default=0)),
            "mismatch_kl": kl,
            "tokens": float(total_tokens),
            "samples": float(len(samples)),
            "train_s": time.monotonic() - t0,
        }

    # -- persistence --------------------------------------------------------------------------------------
    def save_model(self, folder: Path) -> None:
        """Write a version: the Hugging Face folder, plus its GGUF form(s) when ``gguf`` is not "off"."""
        if self.lora:
            from coordinator import lora
            from coordinator.gguf_export import write_lora_gguf, write_model_gguf

            lora.save_merged(self.model, self.tokenizer, folder)
            if self.gguf != "off":
                write_model_gguf(folder / "base.gguf", folder, lora.base_state(self.model), self.gguf)
                pairs, alpha = lora.adapter_pairs(self.model)
                write_lora_gguf(folder / "adapter.gguf", folder, pairs, alpha, "f32" if self.gguf == "f32" else "f16")
            return
        self.model.save_pretrained(str(folder), safe_serialization=True)
        self.tokenizer.save_pretrained(str(folder))
        if self.gguf != "off":
            from coordinator.gguf_export import write_model_gguf

            write_model_gguf(folder / "model.gguf", folder, self.model.state_dict(), self.gguf)

    def save_optimizer(self, path: Path) -> None:
        import torch

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.optimizer.state_dict(), tmp)
        with open(tmp, "rb") as fh:
            import os

            os.fsync(fh.fileno())
        tmp.replace(path)

    def load_optimizer(self, path: Path) -> bool:
        import torch

        if not path.exists():
            return False
        self.optimizer.load_state_dict(torch.load(path, weights_only=True, map_location=self.device))
        return True

    def evaluate(self, task: Task, items: list[TaskItem], max_tokens: int) -> float:
        return greedy_accuracy(self.model, self.tokenizer, task, items, max_tokens)

    def describe(self) -> dict[str, Any]:
        n = sum(p.numel() for p in self.model.parameters())
        return {"parameters": n, "device": self.device, "vocab_size": self.vocab_size}
