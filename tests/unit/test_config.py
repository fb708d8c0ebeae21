from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import (
    ArithmeticTaskConfig,
    ConfigError,
    CoordinatorConfig,
    JsonlTaskConfig,
    load_config,
)
from coordinator.core.scheduling import SyncPolicy


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg == CoordinatorConfig()
    assert cfg.run_dir == Path("runs/default")
    assert cfg.model.path == "tiny"
    assert isinstance(cfg.task, ArithmeticTaskConfig) and cfg.task.max_operand == 99
    assert cfg.learner.prompts_per_step == 16 and cfg.jobs.prompts_per_job == 8
    assert cfg.jobs_per_step == 2
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8470
    assert cfg.verification.request_window_s == 300.0
    assert cfg.sync_mode == "sequential-pull" and cfg.max_staleness == 2
    assert cfg.learner.is_cap == 2.0 and cfg.learner.staleness_decay == 1.0
    assert cfg.learner.correction == "behaviour-clip" and cfg.learner.is_level == "token"
    assert cfg.snapshots.keep_last == 4


def test_toml_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
run_dir = "runs/exp1"

[learner]
lr = 0.001
prompts_per_step = 32
max_steps = 7

[jobs]
prompts_per_job = 4

[task]
type = "arithmetic"
max_operand = 20
""")
    cfg = load_config(path)
    assert cfg.run_dir == Path("runs/exp1")
    assert cfg.learner.lr == 0.001 and cfg.learner.max_steps == 7
    assert cfg.jobs_per_step == 8
    assert isinstance(cfg.task, ArithmeticTaskConfig) and cfg.task.max_operand == 20
    assert cfg.learner.group_size == 8  # untouched keys keep defaults


def test_jsonl_task_from_toml(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[task]\ntype = "jsonl"\ntrain_path = "data/train.jsonl"\n'))
    assert isinstance(cfg.task, JsonlTaskConfig)
    assert cfg.task.train_path == Path("data/train.jsonl")


def test_dotted_overrides_win_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[learner]\nmax_steps = 7\nlr = 0.001\n[server]\nport = 9000\n")
    cfg = load_config(path, {"learner.max_steps": 50, "server.host": "0.0.0.0", "run_dir": "elsewhere"})
    assert cfg.learner.max_steps == 50
    assert cfg.learner.lr == 0.001  # sibling key from the file is kept
    assert cfg.server.host == "0.0.0.0" and cfg.server.port == 9000
    assert cfg.run_dir == Path("elsewhere")


def test_none_overrides_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "[learner]\nmax_steps = 7\n")
    cfg = load_config(path, {"learner.max_steps": None, "server.port": None})
    assert cfg.learner.max_steps == 7 and cfg.server.port == 8470


def test_overrides_without_file() -> None:
    assert load_config(None, {"jobs.lease_timeout_s": 5.0}).jobs.lease_timeout_s == 5.0


@pytest.mark.parametrize(("text", "key"), [
    ("[learner]\nlearning_rate = 0.1\n", "learner.learning_rate"),
    ("typo_top = 1\n", "typo_top"),
    ("[serverr]\nport = 1\n", "serverr"),
    ('[task]\ntype = "arithmetic"\nmax_operands = 5\n', "max_operands"),
])
def test_unknown_key_in_file_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert key in str(info.value)


def test_unknown_override_key_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"jobs.lease_timeout": 5})
    assert "jobs.lease_timeout" in str(info.value)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"learner.lr": 2.0}, "learner.lr"),
    ({"server.port": 70000}, "server.port"),
    ({"learner.group_size": 1}, "learner.group_size"),
    ({"model.device": "tpu"}, "model.device"),
    ({"learner.max_steps": "many"}, "learner.max_steps"),
])
def test_invalid_values_name_the_key(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert key in str(info.value)


@pytest.mark.parametrize("key", ["hold_s", "spot_checks", "trusted_after", "min_replication_rate",
                                 "active_window_s", "replica_min_agreement", "replicator_min_valid",
                                 "registration_burst_s"])
def test_a_retired_spot_check_key_is_refused_with_what_replaced_it(tmp_path: Path, key: str) -> None:
    """An old run.toml that still tunes replication must not load as if it were still protected by it."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f"[trust]\nquarantine_after = 3\n{key} = 1\n"))
    msg = str(info.value)
    assert f"trust.{key}" in msg
    assert "spot-checks were retired: every token is now checked by the keyed sampler (docs/security.md)" in msg


def test_the_trust_config_keeps_quarantine_and_the_plan_secret() -> None:
    cfg = load_config(None, {"trust.quarantine_after": 5, "trust.quarantine_s": 60.0})
    assert (cfg.trust.quarantine_after, cfg.trust.quarantine_s) == (5, 60.0)
    assert cfg.jobs.secret_plans is True  # the job seed is the keyed sampler's secret key


def test_prompts_per_step_not_multiple_of_prompts_per_job() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"learner.prompts_per_step": 10, "jobs.prompts_per_job": 4})
    message = str(info.value)
    assert "learner.prompts_per_step (10)" in message
    assert "jobs.prompts_per_job (4)" in message
    assert "multiple" in message and "change one of them" in message


def test_prompts_per_step_multiple_is_fine() -> None:
    assert load_config(None, {"learner.prompts_per_step": 12, "jobs.prompts_per_job": 4}).jobs_per_step == 3


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize("text", ["[learner\nlr = 1", "lr = ", "a = 1\na = 2\n", "x = 'unterminated"])
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, text))


def test_unreadable_config_path_is_a_config_error(tmp_path: Path) -> None:
    # `--config runs/` (a directory) must be reported as a ConfigError, not an IsADirectoryError traceback
    with pytest.raises(ConfigError):
        load_config(tmp_path)


def test_validate_assignment_forbids_bad_values() -> None:
    cfg = load_config(None)
    with pytest.raises(ValueError):
        cfg.learner.lr = -1.0


# ---- synchronisation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sequential-pull", "async-push-pull", "colocated"])
def test_sync_modes_accepted(mode: str) -> None:
    assert load_config(None, {"sync_mode": mode}).sync_mode == mode


def test_unknown_sync_mode_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"sync_mode": "async"})
    assert "sync_mode" in str(info.value)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"max_staleness": 0}, "max_staleness"),
    ({"max_staleness": 65}, "max_staleness"),
    ({"learner.is_cap": 0.99}, "learner.is_cap"),
    ({"learner.staleness_decay": 0.0}, "learner.staleness_decay"),
    ({"learner.staleness_decay": 1.01}, "learner.staleness_decay"),
])
def test_invalid_staleness_settings_name_the_key(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert key in str(info.value)


def test_sequence_level_weight_needs_the_decoupled_correction() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"learner.is_level": "sequence"})
    assert "learner.correction = 'decoupled'" in str(info.value)  # the message says how to fix it
    cfg = load_config(None, {"learner.is_level": "sequence", "learner.correction": "decoupled"})
    assert cfg.learner.is_level == "sequence"
    with pytest.raises(ConfigError) as info:
        load_config(None, {"learner.correction": "vtrace"})
    assert "learner.correction" in str(info.value)


def test_staleness_bounds_inclusive() -> None:
    assert load_config(None, {"max_staleness": 1}).max_staleness == 1
    cfg = load_config(None, {"max_staleness": 64, "snapshots.keep_last": 66, "sync_mode": "async-push-pull"})
    assert cfg.max_staleness == 64
    assert load_config(None, {"learner.is_cap": 1.0}).learner.is_cap == 1.0
    assert load_config(None, {"learner.staleness_decay": 1.0}).learner.staleness_decay == 1.0
    assert load_config(None, {"learner.staleness_decay": 1e-6}).learner.staleness_decay == 1e-6


def test_async_needs_snapshots_for_stale_results() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"sync_mode": "async-push-pull", "max_staleness": 3, "snapshots.keep_last": 4})
    message = str(info.value)
    assert "snapshots.keep_last (4) must be at least max_staleness + 2 (5)" in message
    assert "stale results can still be verified" in message


def test_async_keep_last_boundary() -> None:
    cfg = load_config(None, {"sync_mode": "async-push-pull", "max_staleness": 3, "snapshots.keep_last": 5})
    assert cfg.snapshots.keep_last == 5
    assert load_config(None, {"sync_mode": "async-push-pull"}).snapshots.keep_last == 4  # defaults fit (S = 2)
    with pytest.raises(ConfigError, match=r"keep_last \(3\)"):
        load_config(None, {"sync_mode": "async-push-pull", "snapshots.keep_last": 3})


@pytest.mark.parametrize("mode", ["sequential-pull", "colocated"])
def test_keep_last_unconstrained_outside_async(mode: str) -> None:
    cfg = load_config(None, {"sync_mode": mode, "max_staleness": 10, "snapshots.keep_last": 1})
    assert cfg.snapshots.keep_last == 1


def test_keep_last_validator_on_assignment() -> None:
    cfg = load_config(None, {"sync_mode": "async-push-pull"})
    with pytest.raises(ValueError, match="max_staleness"):
        cfg.max_staleness = 5


def test_sync_policy_property() -> None:
    cfg = load_config(None)
    assert cfg.sync_policy == SyncPolicy("sequential-pull", 2, 2, max_held_lag=2)
    assert cfg.sync_policy.bound == 0
    cfg = load_config(None, {"sync_mode": "async-push-pull", "max_staleness": 3, "snapshots.keep_last": 5,
                             "learner.prompts_per_step": 32, "jobs.prompts_per_job": 4})
    assert cfg.sync_policy == SyncPolicy("async-push-pull", 3, 8, max_held_lag=2)
    assert cfg.sync_policy.bound == 3 and cfg.sync_policy.jobs_per_step == cfg.jobs_per_step
    cfg = load_config(None, {"sync_mode": "colocated", "max_staleness": 7})
    assert cfg.sync_policy == SyncPolicy("colocated", 7, 2, max_held_lag=2)
    assert cfg.sync_policy.bound == 0
    # staleness per result (issue 32): how far behind a held version may be, beside S
    cfg = load_config(None, {"sync_mode": "async-push-pull", "max_staleness": 16, "snapshots.keep_last": 18,
                             "jobs.max_held_lag": 5})
    assert cfg.sync_policy == SyncPolicy("async-push-pull", 16, 2, max_held_lag=5)


def test_sync_policy_from_toml(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
sync_mode = "async-push-pull"
max_staleness = 1

[learner]
prompts_per_step = 12
is_cap = 1.5
staleness_decay = 0.9

[jobs]
prompts_per_job = 4
"""))
    assert cfg.sync_policy == SyncPolicy("async-push-pull", 1, 3, max_held_lag=2)
    assert cfg.learner.is_cap == 1.5 and cfg.learner.staleness_decay == 0.9


def test_learner_on_ranks_defaults_and_fsdp_follows_world_size() -> None:
    cfg = load_config(None)
    assert cfg.learner.world_size == 1 and not cfg.learner.sharded
    assert load_config(None, {"learner.world_size": 4}).learner.sharded
    assert load_config(None, {"learner.fsdp": True}).learner.sharded  # FSDP over one device


@pytest.mark.parametrize(("overrides", "hint"), [
    ({"learner.world_size": 2, "learner.fsdp": False}, "remove learner.fsdp = false"),
    ({"learner.mixed_precision": "bf16"}, "set learner.fsdp = true"),
    ({"learner.fsdp": True, "learner.mixed_precision": "bf16", "model.dtype": "bfloat16"}, "model.dtype = 'float32'"),
    ({"learner.world_size": 2, "layout": "one-process"}, "layout = 'processes'"),
    ({"learner.world_size": 2, "sync_mode": "colocated"}, "layout = 'processes'"),
    ({"learner.world_size": 0}, "learner.world_size"),
])
def test_learner_on_ranks_refuses_what_cannot_run(overrides: dict[str, object], hint: str) -> None:
    with pytest.raises(ConfigError, match=hint.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)


def test_verifier_placement_defaults_to_replicas_and_fsdp_groups_take_ranks() -> None:
    cfg = load_config(None)
    assert (cfg.verification.placement, cfg.verification.world_size) == ("replicas", 1)
    fsdp = load_config(None, {"verification.placement": "fsdp", "verification.world_size": 2,
                              "verification.mixed_precision": "bf16"}).verification
    assert (fsdp.placement, fsdp.world_size, fsdp.mixed_precision) == ("fsdp", 2, "bf16")
    # after the learner's GPUs: ranks on cuda:4 and cuda:5
    on_gpus = load_config(None, {"model.device": "cuda", "learner.world_size": 4, "verification.placement": "fsdp",
                                 "verification.world_size": 2, "verification.device": "cuda:4"})
    assert on_gpus.verification.device == "cuda:4"


@pytest.mark.parametrize(("overrides", "hint"), [
    ({"verification.world_size": 2}, "set verification.placement = 'fsdp'"),
    ({"verification.mixed_precision": "bf16"}, "needs verification.placement = 'fsdp'"),
    ({"verification.placement": "fsdp", "verification.device": "cuda:x"}, "'cuda' or 'cuda:K'"),
    ({"verification.placement": "fsdp", "model.device": "mps"}, "verification.device = 'cuda' or 'cpu'"),
    ({"verification.placement": "fsdp", "verification.device": "cuda:4", "verification.workers": 2},
     "--role verifier --index i"),
    ({"verification.placement": "fsdp", "model.device": "cuda", "learner.world_size": 4,
      "verification.device": "cuda:2"}, "verification.device = 'cuda:4'"),
    ({"verification.placement": "fsdp", "model.device": "cuda"}, "verification.device = 'cuda:1'"),
    ({"verification.placement": "fsdp", "layout": "one-process"}, "layout = 'processes'"),
    ({"verification.placement": "fsdp", "verification.mixed_precision": "bf16", "model.dtype": "bfloat16"},
     "model.dtype = 'float32'"),
    ({"verification.placement": "sharded"}, "verification.placement"),
    ({"verification.placement": "fsdp", "verification.world_size": 0}, "verification.world_size"),
])
def test_verifier_groups_refuse_what_cannot_run(overrides: dict[str, object], hint: str) -> None:
    with pytest.raises(ConfigError, match=hint.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)
