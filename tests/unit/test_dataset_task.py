"""The 'dataset' task type: local JSONL / Parquet / datasets folders, column mapping, train/held-out split by file
or fraction and seed, plain templates, rewards from the config (built-ins and plug-ins), and typed errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import ConfigError, DatasetTaskConfig, load_config
from coordinator.errors import MissingDependency, TaskError
from coordinator.tasks.base import TaskItem
from coordinator.tasks.builtin import ArithmeticTask, DatasetTask, JsonlQATask, RewardFailed
from coordinator.tasks.factory import make_task

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "level": i % 3}
        for i in range(40)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(path: Path, **kw: Any) -> DatasetTaskConfig:
    return DatasetTaskConfig.model_validate({"train_path": str(path), "prompt_column": "question", **kw})


def test_jsonl_with_column_mapping_and_template(tmp_path: Path) -> None:
    task = DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), heldout_size=10,
                           prompt_template="Question: {prompt}\nAnswer:"))
    assert len(task.train) == 30 and len(task.heldout) == 10
    item = next(it for it in task.train + task.heldout if it.source == "What is 3 + 3?")
    assert item.prompt == "Question: What is 3 + 3?\nAnswer:"
    assert task.score([item, item], ["so 6", "#### 7"]).rewards == [1.0, 0.0]  # default reward: last_number
    assert task.reward(item, "6") == 1.0


def test_fraction_split_is_seeded_and_disjoint(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = DatasetTask(cfg(path, heldout_fraction=0.25, split_seed=1))
    b = DatasetTask(cfg(path, heldout_fraction=0.25, split_seed=1))
    c = DatasetTask(cfg(path, heldout_fraction=0.25, split_seed=2))
    assert len(a.heldout) == 10 and len(a.train) == 30
    assert [i.prompt for i in a.heldout] == [i.prompt for i in b.heldout]
    assert {i.prompt for i in a.heldout} != {i.prompt for i in c.heldout}
    assert not {i.prompt for i in a.heldout} & {i.prompt for i in a.train}


def test_split_by_file(tmp_path: Path) -> None:
    task = DatasetTask(cfg(write_jsonl(tmp_path / "t.jsonl", ROWS[:30]),
                           heldout_path=str(write_jsonl(tmp_path / "h.jsonl", ROWS[30:]))))
    assert [i.source for i in task.train] == [r["question"] for r in ROWS[:30]]
    assert [i.source for i in task.heldout] == [r["question"] for r in ROWS[30:]]


def test_extra_columns_reach_a_plugin_and_the_template(tmp_path: Path) -> None:
    plugin = tmp_path / "levels.py"
    plugin.write_text("def by_level(prompts, completions, answer, level, **kw):\n"
                      "    return [float(lv) for lv in level]\n")
    task = DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), heldout_size=5, extra_columns=["level"],
                           prompt_template="[level {level}] {prompt}",
                           rewards=[{"name": "last_number"}, {"function": f"{plugin}:by_level", "weight": 0.5}]))
    item = next(it for it in task.train if it.source == "What is 5 + 5?")
    assert item.prompt == "[level 2] What is 5 + 5?" and item.columns == {"level": 2}
    scored = task.score([item], ["10"])
    assert scored.rewards == [2.0]
    assert scored.per_reward_means == {"last_number": 1.0, f"{plugin}:by_level": 2.0}


def test_a_raising_plugin_fails_score_but_not_evaluation(tmp_path: Path) -> None:
    plugin = tmp_path / "bad.py"
    plugin.write_text("def f(prompts, completions, **kw):\n    raise ValueError('cannot parse')\n")
    task = DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), heldout_size=5,
                           rewards=[{"function": f"{plugin}:f"}]))
    with pytest.raises(RewardFailed, match="ValueError: cannot parse"):
        task.score(task.train[:2], ["a", "b"])
    assert task.reward(task.heldout[0], "a") == 0.0  # evaluation counts a failure as 0, and goes on


def test_missing_column_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"row 0 has no column 'prompt'.*prompt_column"):
        DatasetTask(DatasetTaskConfig(train_path=write_jsonl(tmp_path / "d.jsonl", ROWS)))


def test_conversation_prompt_needs_the_chat_template(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}] * 4
    with pytest.raises(TaskError, match="set chat_template = true"):
        DatasetTask(DatasetTaskConfig(train_path=write_jsonl(tmp_path / "d.jsonl", rows), heldout_size=1))


def test_too_large_heldout_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="must leave some to train on"):
        DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS[:5]), heldout_size=5))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TaskError, match="holds no rows"):
        DatasetTask(cfg(tmp_path / "e.jsonl"))


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="does not exist"):
        DatasetTask(cfg(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(TaskError, match="set task.format"):
        DatasetTask(cfg(tmp_path / "d.csv"))


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    task = DatasetTask(cfg(tmp_path / "d.parquet", heldout_size=4))
    assert len(task.train) == 36 and task.score(task.train[:1], ["nothing"]).rewards == [0.0]


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingDependency, match="pip install pyarrow"):
        DatasetTask(cfg(tmp_path / "d.parquet"))


def test_datasets_folder_without_datasets_says_what_to_install(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDependency, match="pip install datasets"):
        DatasetTask(cfg(folder))


def test_datasets_folder(tmp_path: Path) -> None:
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "test": datasets.Dataset.from_list(ROWS[30:])}).save_to_disk(str(tmp_path / "ds"))
    task = DatasetTask(cfg(tmp_path / "ds", heldout_path=str(tmp_path / "ds")))
    assert len(task.train) == 30 and len(task.heldout) == 10
    with pytest.raises(TaskError, match="splits"):
        DatasetTask(cfg(tmp_path / "ds", train_split="validation", heldout_size=3))


def test_math_reward_needs_its_extra_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(MissingDependency, match=r"echo-swarm\[math\]"):
        DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), rewards=[{"name": "math"}]))


def test_a_plugin_that_cannot_load_stops_the_task(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no_such_mod_q"):
        DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS), rewards=[{"function": "no_such_mod_q:f"}]))


# ---- configuration ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("task", "match"), [
    ({"heldout_size": 5, "heldout_fraction": 0.1}, "not both"),
    ({"heldout_path": "h.jsonl", "heldout_fraction": 0.1}, "replaces the split"),
    ({"heldout_fraction": 1.5}, "heldout_fraction"),
    ({"system_prompt": "Be brief."}, "system_prompt needs chat_template"),
    ({"prompt_template": "Q: {question}"}, r"must contain '\{prompt\}'"),
    ({"prompt_template": "{prompt} {level}"}, "not in extra_columns"),
    ({"prompt_template": "{prompt"}, "not a format string"),
    ({"extra_columns": ["answer"]}, "extra_columns may not name"),
    ({"rewards": []}, "rewards"),
    ({"rewards": [{"name": "regex"}]}, "needs a pattern"),
    ({"rewards": [{"name": "regex", "pattern": "("}]}, "not a regular expression"),
    ({"rewards": [{"name": "format", "pattern": "x"}]}, "belongs to a 'regex' reward"),
    ({"rewards": [{"name": "math", "function": "m:f"}]}, "exactly one of"),
    ({"rewards": [{"function": "not a module"}]}, "must be 'package.module:function'"),
    ({"rewards": [{"name": "bleu"}]}, "rewards"),
    ({"rewards": [{"name": "math", "weight": "nan"}]}, "weight"),
    ({"chat_template": True}, "the built-in 'tiny' model has none"),
])
def test_config_errors_name_the_fix(task: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, {"task": {"type": "dataset", "train_path": "d.jsonl", **task}})


def test_load_config_and_make_task(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[task]\ntype = "dataset"\ntrain_path = "{path}"\nprompt_column = "question"\n'
                    f'heldout_fraction = 0.1\n\n[[task.rewards]]\nname = "last_number"\n\n'
                    f'[[task.rewards]]\nname = "regex"\npattern = "####"\nweight = 0.1\n')
    config = load_config(toml)
    task = make_task(config.task, config.model.path)
    assert isinstance(task, DatasetTask) and task.name == "dataset" and len(task.heldout) == 4
    assert task.score(task.train[:1], ["#### 0"]).per_reward_means.keys() == {"last_number", "regex"}


def test_existing_task_types_score_unchanged(tmp_path: Path) -> None:
    from coordinator.config import ArithmeticTaskConfig, JsonlTaskConfig

    arith = ArithmeticTask(ArithmeticTaskConfig(max_operand=9, heldout_size=20))
    scored = arith.score([TaskItem("Q: 2+2= A:", "4")] * 2, [" 4", " 5"])
    assert scored.rewards == [1.0, 0.0] and scored.per_reward_means == {"first_integer": 0.5}
    jsonl = JsonlQATask(JsonlTaskConfig(train_path=write_jsonl(tmp_path / "d.jsonl", ROWS), heldout_size=5))
    assert jsonl.score(jsonl.train[:1], ["nope"]).per_reward_means == {"last_number": 0.0}
