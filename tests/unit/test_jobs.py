from __future__ import annotations

import pytest

from coordinator.core.jobs import JobPlan, derived_seed, plan_job


def test_plan_is_deterministic() -> None:
    assert plan_job(7, 3, 1000, 4) == plan_job(7, 3, 1000, 4)


def test_plan_shape() -> None:
    plan = plan_job(0, 5, 1000, 4)
    assert isinstance(plan, JobPlan)
    assert plan.job_id == "j5" and plan.seq == 5
    assert len(plan.prompt_ids) == 4
    assert isinstance(plan.prompt_ids, tuple)


def test_job_ids_follow_the_sequence() -> None:
    assert [plan_job(0, k, 100, 2).job_id for k in range(4)] == ["j0", "j1", "j2", "j3"]
    assert [plan_job(0, k, 100, 2).seq for k in range(4)] == [0, 1, 2, 3]


def test_plan_carries_no_version() -> None:
    # the policy version is bound when the job is leased, not when it is planned
    assert not hasattr(plan_job(0, 0, 100, 2), "version")


def test_single_prompt_job() -> None:
    plan = plan_job(0, 0, 100, 1)
    assert len(plan.prompt_ids) == 1 and 0 <= plan.prompt_ids[0] < 100


def test_prompt_ids_distinct_and_in_range() -> None:
    n_train = 50
    for seq in range(50):
        ids = plan_job(1, seq, n_train, 32).prompt_ids
        assert len(ids) == 32
        assert len(set(ids)) == 32
        assert all(0 <= i < n_train for i in ids)


def test_small_training_set_uses_every_prompt_once() -> None:
    plan = plan_job(0, 0, 10, 16)
    assert sorted(plan.prompt_ids) == list(range(10))


def test_prompts_change_with_seq_and_run_seed() -> None:
    base = plan_job(0, 0, 10_000, 16).prompt_ids
    assert base != plan_job(0, 1, 10_000, 16).prompt_ids
    assert base != plan_job(1, 0, 10_000, 16).prompt_ids


def test_prompts_depend_only_on_run_seed_and_seq() -> None:
    # job k is the same whatever was planned before it (replayable, and no client can steer it)
    plan_job(0, 0, 1000, 8)
    again = plan_job(0, 7, 1000, 8)
    assert again == plan_job(0, 7, 1000, 8)


def test_seeds_differ_across_jobs_and_runs() -> None:
    seeds = [plan_job(0, k, 1000, 4).seed for k in range(80)]
    assert len(seeds) == 80
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    # and across runs
    assert plan_job(0, 0, 1000, 4).seed != plan_job(1, 0, 1000, 4).seed


def test_seed_does_not_depend_on_training_set_or_job_size() -> None:
    assert plan_job(3, 9, 1000, 4).seed == plan_job(3, 9, 50, 8).seed


@pytest.mark.parametrize(("n_train", "per_job"), [(0, 4), (100, 0), (-1, 4), (100, -2)])
def test_empty_training_set_or_job_raises(n_train: int, per_job: int) -> None:
    with pytest.raises(ValueError, match="at least one"):
        plan_job(0, 0, n_train, per_job)


def test_derived_seed_stable_and_bounded() -> None:
    assert derived_seed("x", 1, 2) == derived_seed("x", 1, 2)
    assert derived_seed("x", 1, 2) != derived_seed("x", 2, 1)
    assert 0 <= derived_seed("anything") < 2**63


def test_a_secret_plan_key_changes_every_plan_and_is_stable_within_a_run() -> None:
    """With jobs.secret_plans a client that knows learner.seed cannot compute job n's prompts and seed (and so
    not its keyed sampler's noise before it holds the lease); the run's own key
    still gives the same plan for the same number every time (replays, restarts)."""
    from coordinator.core.jobs import plan_key

    public = [plan_job(plan_key(0, None), k, 10_000, 4) for k in range(20)]
    assert public == [plan_job(0, k, 10_000, 4) for k in range(20)]  # off: the seed alone, as before
    secret = [plan_job(plan_key(0, "a" * 32), k, 10_000, 4) for k in range(20)]
    assert all(s.seed != p.seed and s.prompt_ids != p.prompt_ids for s, p in zip(secret, public, strict=True))
    assert secret == [plan_job(plan_key(0, "a" * 32), k, 10_000, 4) for k in range(20)]
    other_run = [plan_job(plan_key(0, "b" * 32), k, 10_000, 4) for k in range(20)]
    assert all(s.seed != o.seed for s, o in zip(secret, other_run, strict=True))
    assert [s.job_id for s in secret] == [p.job_id for p in public]  # the numbering is public either way
