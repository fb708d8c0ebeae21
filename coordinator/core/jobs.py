"""Planning rollout jobs: which prompts and seeds a policy version's jobs carry.

Prompts and sampling seeds are derived from the run seed and the version, never chosen by a client, so a
client cannot pick easy prompts and any job's sampling can be replayed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    version: int
    prompt_ids: tuple[int, ...]
    seed: int


def derived_seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def plan_jobs(run_seed: int, version: int, n_train: int, prompts_per_step: int, prompts_per_job: int) -> list[JobPlan]:
    """The jobs of one policy version: ``prompts_per_step`` distinct training prompts in chunks."""
    if prompts_per_step % prompts_per_job:
        raise ValueError("prompts_per_step must be a multiple of prompts_per_job")
    rng = random.Random(derived_seed("prompts", run_seed, version))
    prompt_ids = rng.sample(range(n_train), min(prompts_per_step, n_train))
    plans = []
    for k, start in enumerate(range(0, len(prompt_ids), prompts_per_job)):
        chunk = tuple(prompt_ids[start : start + prompts_per_job])
        plans.append(JobPlan(f"v{version}-j{k}", version, chunk, derived_seed("sampling", run_seed, version, k)))
    return plans
