from __future__ import annotations

import pytest

from coordinator.core.jobs import JobPlan, derived_seed, plan_jobs


def test_plan_is_deterministic() -> None:
    assert plan_jobs(7, 3, 1000, 16, 4) == plan_jobs(7, 3, 1000, 16, 4)


def test_plan_shape_and_chunking() -> None:
    plans = plan_jobs(0, 5, 1000, 16, 4)
    assert len(plans) == 4
    assert [p.job_id for p in plans] == ["v5-j0", "v5-j1", "v5-j2", "v5-j3"]
    assert all(isinstance(p, JobPlan) and p.version == 5 and len(p.prompt_ids) == 4 for p in plans)


def test_single_job_when_job_size_equals_step() -> None:
    plans = plan_jobs(0, 0, 100, 8, 8)
    assert len(plans) == 1 and len(plans[0].prompt_ids) == 8


def test_prompt_ids_distinct_and_in_range() -> None:
    n_train = 50
    for version in range(20):
        ids = [i for p in plan_jobs(1, version, n_train, 32, 8) for i in p.prompt_ids]
        assert len(ids) == 32
        assert len(set(ids)) == 32
        assert all(0 <= i < n_train for i in ids)


def test_small_training_set_uses_every_prompt_once() -> None:
    plans = plan_jobs(0, 0, 10, 16, 4)
    ids = [i for p in plans for i in p.prompt_ids]
    assert sorted(ids) == list(range(10))
    assert [len(p.prompt_ids) for p in plans] == [4, 4, 2]


def test_prompts_change_with_version_and_run_seed() -> None:
    base = [p.prompt_ids for p in plan_jobs(0, 0, 10_000, 16, 4)]
    assert base != [p.prompt_ids for p in plan_jobs(0, 1, 10_000, 16, 4)]
    assert base != [p.prompt_ids for p in plan_jobs(1, 0, 10_000, 16, 4)]


def test_seeds_differ_across_jobs_and_versions() -> None:
    seeds = [p.seed for v in range(10) for p in plan_jobs(0, v, 1000, 32, 4)]
    assert len(seeds) == 80
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    # and across runs
    assert plan_jobs(0, 0, 1000, 8, 4)[0].seed != plan_jobs(1, 0, 1000, 8, 4)[0].seed


def test_not_a_multiple_raises() -> None:
    with pytest.raises(ValueError, match="multiple"):
        plan_jobs(0, 0, 100, 10, 4)


def test_derived_seed_stable_and_bounded() -> None:
    assert derived_seed("x", 1, 2) == derived_seed("x", 1, 2)
    assert derived_seed("x", 1, 2) != derived_seed("x", 2, 1)
    assert 0 <= derived_seed("anything") < 2**63
