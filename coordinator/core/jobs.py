"""Planning rollout jobs: which prompts and sampling seed each job carries.

Jobs form one numbered stream per run; job ``k``'s prompts and seed are derived from the run's plan key and
``k`` alone, never chosen by a client, so a client cannot pick easy prompts. The key is ``learner.seed`` joined
with a secret of the run (``jobs.secret_plans``): the job's seed is its keyed sampler's key (shared.sampler), and
without the secret anyone who knows the run's seed could compute any job's sampling noise before holding its
lease (docs/security.md, § Keyed sampling).
The policy version a job is generated with is bound later, when it is leased (see core.scheduling).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class JobPlan:
    job_id: str
    seq: int
    prompt_ids: tuple[int, ...]
    seed: int


def derived_seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def plan_key(run_seed: int, secret: str | None) -> int | str:
    """What plans are derived from: the run seed, joined with the run's secret when plans are secret."""
    return run_seed if secret is None else f"{run_seed}:{secret}"


def plan_job(run_seed: int | str, seq: int, n_train: int, prompts_per_job: int) -> JobPlan:
    """Job number ``seq``: ``prompts_per_job`` distinct training prompts and a sampling seed (``run_seed``: the
    run seed, or a :func:`plan_key`)."""
    if n_train < 1 or prompts_per_job < 1:
        raise ValueError("need at least one training prompt and one prompt per job")
    rng = random.Random(derived_seed("prompts", run_seed, seq))
    prompt_ids = tuple(rng.sample(range(n_train), min(prompts_per_job, n_train)))
    return JobPlan(f"j{seq}", seq, prompt_ids, derived_seed("sampling", run_seed, seq))
