"""A training batch from accepted results: what the learner role trains on, and replays after a restart.

Split from coordinator/roles/learner.py (issue 33): turning stored results into samples — advantages per group,
staleness and its weight, the class whose recompute was the result's π_b, episode loss masks — is the same
reading whether a step trains for the first time or is replayed from a checkpoint, and needs nothing of the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.advantages import group_advantages
from coordinator.core.scheduling import staleness_weight
from coordinator.core.trust import recompute_class
from coordinator.engine.learner import Sample
from coordinator.run.records import AcceptedResult
from coordinator.store.store import Store
from coordinator.tasks.text import PromptTokens


@dataclass(frozen=True)
class Batch:
    samples: list[Any]  # coordinator.engine.learner.Sample
    rewards: list[float]
    staleness_histogram: dict[str, int]  # staleness (as a string) → results
    rows: list[Any]  # coordinator.store.results.ResultRow
    reward_means: dict[str, float]  # each reward's own mean, when the task combines several


class Batches:
    """Reads batches from the store, encoding prompts as the API signed them into jobs (``prompt_tokens``)."""

    def __init__(self, config: CoordinatorConfig, store: Store, prompt_tokens: PromptTokens) -> None:
        self.config = config
        self.store = store
        self.prompt_tokens = prompt_tokens

    def of(self, version: int, job_ids: list[str]) -> Batch:
        """The training samples of a batch of accepted results, for a step that updates ``version`` (also used
        to replay recorded steps after a restart), with what the step's metrics report about them."""
        rows = self.store.results.rows(job_ids)
        samples: list[Sample] = []
        rewards_all: list[float] = []
        staleness_hist: dict[str, int] = {}
        reward_parts: dict[str, list[float]] = {}
        sources: dict[str, str] = {}
        for r in rows:
            job = self.store.jobs.get(r.job_id)
            assert job is not None
            result = AcceptedResult.decode(r.payload)
            if result.source is None and r.client_id not in sources:
                sources[r.client_id] = self._source(r.client_id)
            source = result.source or sources[r.client_id]
            for name, mean in result.reward_means.items():  # each reward's own mean (task.rewards)
                reward_parts.setdefault(name, []).append(mean)
            advs = group_advantages(r.rewards, job.group_size)
            stale = version - r.version
            assert 0 <= stale <= self.config.sync_policy.bound, f"staleness {stale} outside the bound"
            staleness_hist[str(stale)] = staleness_hist.get(str(stale), 0) + 1
            weight = staleness_weight(stale, self.config.learner.staleness_decay)
            prompts = [self.prompt_tokens(i) for i in job.prompt_ids for _ in range(job.group_size)]
            # episodes: observation tokens masked out
            masks: list[list[int] | None] = list(result.loss_mask) if result.loss_mask else [None] * len(prompts)
            for k, (p, c) in enumerate(zip(prompts, result.completions, strict=True)):
                samples.append(Sample(p, c, result.recomputed_logprobs[k], result.behaviour_logprobs[k], advs[k],
                                      stale, weight, masks[k], source))
            rewards_all.extend(r.rewards)
        return Batch(samples, rewards_all, staleness_hist, rows,
                     {k: sum(v) / len(v) for k, v in sorted(reward_parts.items())})

    def recorded_after(self, checkpoint: int, current: int) -> list[tuple[int, list[str]]]:
        """The steps recorded after ``checkpoint`` up to ``current``, in order: (the version each updated, its
        job ids in training order) — what a resume replays on top of the checkpoint's weights."""
        by_step: dict[int, list[str]] = {}
        for r in self.store.results.summary():
            if r.ingested_step is not None and r.ingested_step > checkpoint:
                by_step.setdefault(int(r.ingested_step), []).append(r.job_id)
        trained_from = {int(s.step): int(s.trained_version) for s in self.store.steps.all() if s.step > checkpoint}
        return [(trained_from[step], sorted(by_step[step])) for step in range(checkpoint + 1, current + 1)]

    def _source(self, client_id: str) -> str:
        """For a result accepted before the intake recorded its class (AcceptedResult.source): the class whose
        recompute was its π_b, "llama-<snapshots.gguf>" for an identity pinned as llama.cpp, "torch" otherwise."""
        client = self.store.clients.get(client_id)
        pinned = str(client["backend_class"] or "") if client is not None else ""
        return recompute_class(pinned, self.config.snapshots.gguf if self.config.snapshots.gguf != "off" else None)
