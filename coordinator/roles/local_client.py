"""The co-located baseline's own volunteer: the learner generating its rollouts in-process, leasing and handing
them in exactly as a client would, so the baseline and a swarm go through the same intake.

Split from coordinator/roles/learner.py (issue 33): the loop that decides *when* to generate stays with the learner
role; this is *how* — which jobs, generated how, submitted how.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.leases import deadline_for
from coordinator.run.names import LOCAL_CLIENT
from coordinator.store.job_rows import JobRow
from coordinator.store.store import Store
from coordinator.tasks.text import PromptTokens
from shared import wire
from shared.hashing import prompt_hash, sha256_bytes
from shared.messages import ResultSubmission
from shared.policy import generate

# (client id, submission, size, content sha) → the intake's verdict; the co-located baseline submits its own rollouts
LocalIntake = Callable[[str, Any, int, str], Awaitable[Any]]


class LocalClient:
    """Jobs for the co-located learner (``next_jobs``), their rollouts from its model in memory (``rollouts``, on the
    learner thread through ``run``), and their submission to the intake (``submit``)."""

    def __init__(self, config: CoordinatorConfig, store: Store, prompt_tokens: PromptTokens, *,
                 intake: LocalIntake, plan_job: Callable[[], JobRow],
                 run: Callable[..., Awaitable[Any]], clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.prompt_tokens = prompt_tokens
        self.intake = intake
        self.plan_job = plan_job
        self.run = run  # runs a function on the learner's thread (the model is the learner's)
        self.clock = clock

    def register(self, device: str) -> None:
        self.store.clients.register(LOCAL_CLIENT, b"", {"name": "co-located learner", "backend": "torch",
                                                        "device": device}, self.clock())

    def next_jobs(self, count: int) -> list[JobRow]:
        """The co-located learner's next ``count`` jobs (at least one): the oldest unfinished jobs (one it
        leased before a restart included; one whose reward failed for it is skipped), then new ones."""
        count = max(1, count)
        active = self.store.jobs.active()
        refused = self.store.results.refused_jobs(LOCAL_CLIENT, [r.view.job_id for r in active])
        rows = [r for r in active if r.view.job_id not in refused][:count]
        while len(rows) < count:
            rows.append(self.plan_job())
        return rows

    async def rollouts(self, rows: list[JobRow], model: Any) -> list[list[Any]]:
        """Generate the completions of ``rows`` with ``model`` as it is in memory, on the learner thread, each job
        in its own batch exactly as a volunteer's torch backend generates it (its prompts × group, padded to its own
        longest prompt, keyed as that job: shared.sampler).

        Why not one batch for the whole step: a row's logits depend in their last bits on the batch around it (the
        padding width, and the matrix kernels torch picks for the batch's size), and a keyed choice whose two best
        noised scores nearly tie follows those bits. Generated job by job, a client with the same device and thread
        count returns the very tokens of this loop, so sequential pull reproduces the co-located run seed by seed
        (bench/sync_modes.py); batched, the two parted after 30–88 identical steps."""
        codec, sampling = self.prompt_tokens.codec, self.config.sampling
        out = []
        for row in rows:
            prompts = [self.prompt_tokens(i) for i in row.prompt_ids]
            out.append(await self.run(lambda prompts=prompts, row=row: generate(
                model, prompts, group_size=row.group_size, temperature=sampling.temperature,
                max_tokens=sampling.max_tokens, stop_ids=codec.stop_ids, seed=row.seed, pad_id=codec.pad_id)))
        return out

    async def submit(self, rows: list[JobRow], rollouts: list[list[Any]], version: int) -> None:
        """Lease each job to the co-located learner at ``version`` (published) and hand its rollouts to intake."""
        for row, samples in zip(rows, rollouts, strict=True):
            prompts = [self.prompt_tokens(i) for i in row.prompt_ids]
            now = self.clock()
            lease_id = secrets.token_hex(8)
            deadline = deadline_for(now, 3600.0)
            if not self.store.jobs.lease(row.view.job_id, lease_id, LOCAL_CLIENT, deadline, version, now):
                # a lease left by a crash that has not expired yet: take it over (only this process leases here)
                self.store.jobs.release(row.view.job_id, row.view.lease_id or "", LOCAL_CLIENT)
                self.store.jobs.lease(row.view.job_id, lease_id, LOCAL_CLIENT, deadline, version, now)
            completions = [smp.to_completion() for smp in samples]
            sub = ResultSubmission(job_id=row.view.job_id, lease_id=lease_id, version=version,
                                   prompt_hash=prompt_hash(prompts), seed=row.seed, group_size=row.group_size,
                                   backend="torch", generation_s=0.0, completions=completions)
            await self.intake(LOCAL_CLIENT, sub, 0, sha256_bytes(wire.encode(sub)))
