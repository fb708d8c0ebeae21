"""README's "Train your own model" examples stay valid: every TOML block there is a valid run config (the partial
ones completed with the first block's keys), and the ten-line plug-in reward scores completions through the same
RewardSet the coordinator uses."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig, DatasetTaskConfig, ReasoningGymTaskConfig
from coordinator.tasks.rewards import RewardSet, RewardTerm, load_plugin

README = Path(__file__).resolve().parents[2] / "README.md"


def section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Train your own model")
    return text[start:text.index("\n## ", start + 1)]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), re.S)


def test_every_config_block_is_a_valid_run_config() -> None:
    tomls = [tomllib.loads(b) for b in blocks("toml")]
    assert len(tomls) >= 3
    base = tomls[0]
    kinds = []
    for data in tomls:
        merged: dict[str, Any] = {**base, **data}
        kinds.append(type(CoordinatorConfig.model_validate(merged).task))
    assert DatasetTaskConfig in kinds and ReasoningGymTaskConfig in kinds
    gsm = next(t for t in tomls if t.get("task", {}).get("type") == "dataset")
    assert gsm["task"]["chat_template"] is True and not gsm["model"]["path"].startswith("tiny")


def test_the_plugin_reward_runs_as_the_coordinator_runs_it(tmp_path: Path) -> None:
    code = next(b for b in blocks("python") if "def brevity" in b)
    assert len(code.strip().splitlines()) <= 10
    (tmp_path / "brevity.py").write_text(code)
    fn = load_plugin(f"{tmp_path / 'brevity.py'}:brevity")
    scored = RewardSet([RewardTerm("brevity", fn, 0.1)]).score(["q"] * 3, ["short", "x" * 500, "x" * 900],
                                                               {"answer": ["1"] * 3})
    assert scored.per_reward_means["brevity"] == (1.0 + 0.5 + 0.0) / 3
    assert scored.rewards == [0.1, 0.05, 0.0]
