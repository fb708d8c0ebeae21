"""`echo-swarm demo --task NAME`: every row of the demo's task table writes a run config the coordinator accepts and
whose task builds (prompts that fit the tiny model's 64 positions), and an unknown name is refused with the list;
likewise an unknown --model-family."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.config import load_config
from coordinator.tasks.factory import make_task
from echo_swarm.cli import app
from echo_swarm.demo import DemoConfig, _write_config
from echo_swarm.demo_tasks import DEMO_TASKS


@pytest.mark.parametrize("name", sorted(DEMO_TASKS))
def test_each_demo_task_writes_a_valid_config_whose_task_builds(name: str, tmp_path: Path) -> None:
    cfg = DemoConfig(out=tmp_path, task=name)
    config = load_config(_write_config(cfg, tmp_path / "run"))
    assert config.learner.lr == DEMO_TASKS[name].lr
    task = make_task(config.task, config.model.path)
    # enough held-out items for the demo's gain to mean something (the 3×3 gridworld has 72 starts, a third held out)
    assert len(task.train) > 0 and len(task.heldout) >= 24
    longest = max(len(it.prompt.encode()) for it in [*task.train, *task.heldout])  # the tiny model: 1 byte, 1 token
    assert longest + config.sampling.max_tokens <= 64, name


def test_an_unknown_demo_task_is_refused_with_the_known_ones() -> None:
    result = CliRunner().invoke(app, ["demo", "--task", "sokoban"])
    assert result.exit_code == 2
    assert "--task 'sokoban' is not a demo task" in result.output and all(n in result.output for n in DEMO_TASKS)


def test_an_unknown_model_family_is_refused_in_one_line_with_the_known_ones(tmp_path: Path) -> None:
    from coordinator.engine.family_models import BY_NAME
    from echo_swarm.demo import run

    result = CliRunner().invoke(app, ["demo", "--model-family", "falcon", "--out", str(tmp_path / "cli")])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "--model-family 'falcon' is not a model family" in line
    assert all(name in line for name in BY_NAME)
    # the demo itself refuses it before building or starting anything (DemoConfig used without the CLI)
    assert run(DemoConfig(out=tmp_path / "api", model_family="falcon")) == 2
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_readme_names_every_model_family_the_demo_takes() -> None:
    from coordinator.engine.family_models import BY_NAME

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(p for p in readme.split("\n\n") if "`echo-swarm demo --model-family NAME`" in p)
    assert all(f"`{name}`" in line for name in BY_NAME), line


def test_the_demo_lr_flag_overrides_the_task_s_own(tmp_path: Path) -> None:
    config = load_config(_write_config(DemoConfig(out=tmp_path, lr=3e-4), tmp_path / "run"))
    assert config.learner.lr == 3e-4 != DEMO_TASKS["addition"].lr


def test_the_bench_s_correction_and_m2po_bound_reach_the_learner(tmp_path: Path) -> None:
    """bench/sync_modes.py's m2po rows set learner.correction and m2_threshold through DemoConfig."""
    config = load_config(_write_config(DemoConfig(out=tmp_path, correction="m2po", m2_threshold=0.01),
                                       tmp_path / "run"))
    assert (config.learner.correction, config.learner.m2_threshold) == ("m2po", 0.01)
    default = load_config(_write_config(DemoConfig(out=tmp_path), tmp_path / "run2")).learner
    assert default.m2_threshold != 0.01 and default.correction == "behaviour-clip"
