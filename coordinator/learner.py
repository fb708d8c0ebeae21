"""The GRPO learner: recomputes behaviour logprobs for verification and takes clipped policy-gradient steps.

Loss (token-mean over the batch): ``-min(ρ·A, clip(ρ, 1-ε, 1+ε)·A)`` with ``ρ = exp(logπθ - logπ_old)``,
where ``logπ_old`` is the learner's own recompute of the behaviour policy at the version that generated the
rollout (trusted, unlike the client's report) and ``A`` the group-normalised advantage. In sequential-pull
mode πθ equals π_old at the start of the step, so ρ = 1 up to rounding; the clip matters once rollouts are
off-policy. All torch work of the coordinator happens on one dedicated thread, so the model is never read
while it is being updated.
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


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # learner recompute at the behaviour version
    behaviour_logprobs: list[float]  # as reported by the client
    advantage: float


class Learner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: LearnerConfig, temperature: float) -> None:
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
        self.model.train()
        self.pad_id = pad_id(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        if not self.stop_ids:
            raise ValueError(f"the tokenizer in {model_dir} defines no end-of-sequence token; set eos_token in its "
                             f"tokenizer_config.json so completions can stop")
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    # -- prompts ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- verification -------------------------------------------------------------------------------------
    def recompute(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """The current policy's logprobs of each completion token (no gradient)."""
        import torch

        from shared.policy import completion_logprobs

        out: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(completions), MICRO_BATCH):
                lp, _ = completion_logprobs(self.model, prompts[s : s + MICRO_BATCH], completions[s : s + MICRO_BATCH],
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
        eps = self.cfg.clip_eps
        loss_sum = ratio_sum = clipped = 0.0
        ratio_max = 0.0
        for s in range(0, len(samples), MICRO_BATCH):
            chunk = samples[s : s + MICRO_BATCH]
            logp, mask = completion_logprobs(self.model, [c.prompt_ids for c in chunk],
                                             [c.completion_ids for c in chunk], temperature=self.temperature,
                                             pad_id=self.pad_id)
            old = torch.zeros_like(logp)
            for i, c in enumerate(chunk):
                old[i, : len(c.old_logprobs)] = torch.tensor(c.old_logprobs, dtype=logp.dtype)
            adv = torch.tensor([c.advantage for c in chunk], dtype=logp.dtype, device=logp.device)[:, None]
            ratio = torch.exp((logp - old) * mask)
            unclipped = ratio * adv
            clipped_obj = torch.clamp(ratio, 1 - eps, 1 + eps) * adv
            per_token = -torch.minimum(unclipped, clipped_obj) * mask
            loss = per_token.sum() / max(1, total_tokens)
            loss.backward()
            with torch.no_grad():
                loss_sum += float(loss)
                ratio_sum += float((ratio * mask).sum())
                ratio_max = max(ratio_max, float((ratio * mask).max()))
                clipped += float((((ratio < 1 - eps) | (ratio > 1 + eps)).to(mask.dtype) * mask).sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        self.optimizer.step()
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
            "mismatch_kl": kl,
            "tokens": float(total_tokens),
            "samples": float(len(samples)),
            "train_s": time.monotonic() - t0,
        }

    # -- persistence --------------------------------------------------------------------------------------
    def save_model(self, folder: Path) -> None:
        self.model.save_pretrained(str(folder), safe_serialization=True)
        self.tokenizer.save_pretrained(str(folder))

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
