"""The reasoning-gym task type on the real reasoning-gym package: config validation that says how to fix it,
deterministic generation with a held-out set that repeats no training question, the dataset's own scorer as the
reward, and the chat-template path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import ConfigError, ReasoningGymTaskConfig, load_config
from coordinator.errors import MissingDependency, TaskError
from coordinator.tasks.factory import check_task, make_task
from coordinator.tasks.reasoning_gym import ReasoningGymTask
from coordinator.tasks.text import TextCodec
from tests.unit.test_prompts import CHATML, hf_ids, tokenizer_folder

SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"], "allow_parentheses": False,
         "allow_negation": False}


def rg(**kw: Any) -> ReasoningGymTaskConfig:
    return ReasoningGymTaskConfig(**({"dataset": "basic_arithmetic", "size": 200, "heldout_size": 32,
                                      "config": SMALL} | kw))


def config_error(task: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        check_task(load_config(None, {"task": {"type": "reasoning-gym"} | task}).task)  # as `coordinator` does
    return str(info.value)


def test_an_unknown_dataset_lists_the_known_ones() -> None:
    msg = config_error({"dataset": "basic_arithmetics"})
    assert "'basic_arithmetics' is not a reasoning-gym dataset" in msg
    assert all(name in msg for name in ("basic_arithmetic", "gsm_symbolic", "countdown", "maze", "sokoban"))


@pytest.mark.parametrize(("task", "match"), [
    ({"dataset": "basic_arithmetic", "config": {"max_digit": 2}},
     "task.config has ['max_digit'], which basic_arithmetic does not take; its settings are: min_terms"),
    ({"dataset": "basic_arithmetic", "config": {"seed": 3}}, "use task.seed and task.size"),
    ({"dataset": "basic_arithmetic", "config": {"min_terms": 3, "max_terms": 2}},
     "not a valid basic_arithmetic configuration: max_terms must be >= min_terms"),
    ({"dataset": "basic_arithmetic", "prompt_template": "Q: {prompt}"}, "may name only the item's '{question}'"),
    ({"dataset": "basic_arithmetic", "prompt_template": "Q: no field"}, "and must name one"),
    ({"dataset": "basic_arithmetic", "system_prompt": "Think."}, "system_prompt needs chat_template = true"),
    ({"dataset": "basic_arithmetic", "chat_template": True}, "the built-in 'tiny' model has none"),
    ({"dataset": "basic_arithmetic", "size": 0}, "task.reasoning-gym.size"),
])
def test_config_errors_name_the_fix(task: dict[str, Any], match: str) -> None:
    assert match in config_error(task)


def test_generation_is_deterministic_and_the_heldout_set_repeats_no_training_question() -> None:
    a, b = ReasoningGymTask(rg()), ReasoningGymTask(rg())
    assert [it.prompt for it in a.train] == [it.prompt for it in b.train]  # every role builds the same items
    assert [it.prompt for it in a.heldout] == [it.prompt for it in b.heldout]
    assert len(a.train) == 200 and len(a.heldout) == 32
    assert not {it.source for it in a.heldout} & {it.source for it in a.train}
    assert [it.prompt for it in ReasoningGymTask(rg(seed=1)).train] != [it.prompt for it in a.train]


def test_a_config_that_leaves_nothing_to_hold_out_is_refused() -> None:
    tiny_space = SMALL | {"max_digits": 1}  # about 100 distinct questions, all drawn for training
    with pytest.raises(TaskError, match="no held-out question exists; widen task.config"):
        ReasoningGymTask(rg(size=2000, config=tiny_space))


def test_the_datasets_scorer_is_the_reward() -> None:
    task = ReasoningGymTask(rg(prompt_template="Q: {question} A:"))
    item = task.train[0]
    assert item.prompt == f"Q: {item.source} A:" and item.source.startswith("Calculate ")
    right = item.answer
    scored = task.score([item] * 4, [f" {right}", f"so <answer>{right}</answer>", "nothing", f"<answer>{right}0"])
    assert scored.rewards[:3] == [1.0, 1.0, 0.0]
    assert 0.0 < scored.rewards[3] < 1.0  # basic_arithmetic's own partial credit for an answer containing it
    assert scored.per_reward_means == {"basic_arithmetic": pytest.approx(sum(scored.rewards) / 4)}
    assert task.reward(item, right) == 1.0


def test_load_config_and_make_task() -> None:
    config = load_config(None, {"task": {"type": "reasoning-gym", "dataset": "gsm_symbolic", "size": 8,
                                         "heldout_size": 4}})
    task = make_task(config.task, config.model.path)
    assert task.name == "reasoning-gym" and len(task.train) == 8 and len(task.heldout) == 4
    assert task.reward(task.train[0], f"<answer>{task.train[0].answer}</answer>") == 1.0


def test_chat_template_prompt_tokens_equal_apply_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tokenizer_folder(tiny_model_dir, tmp_path / "tok", CHATML, bos_prefix=False)
    system = "Put the final answer inside <answer></answer>."
    task = ReasoningGymTask(rg(size=4, heldout_size=2, chat_template=True, system_prompt=system), folder)
    codec = TextCodec.from_folder(folder)
    for item in task.train:
        assert codec.encode(item.prompt) == hf_ids(folder, [{"role": "system", "content": system},
                                                            {"role": "user", "content": item.source or ""}])


def test_without_the_extra_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    assert "pip install 'echo-swarm[reasoning-gym]'" in config_error({"dataset": "basic_arithmetic"})
    with pytest.raises(MissingDependency, match=r"echo-swarm\[reasoning-gym\]"):
        ReasoningGymTask(ReasoningGymTaskConfig.model_construct(  # (built without its validator, which imports)
            type="reasoning-gym", dataset="basic_arithmetic", size=10, seed=0, heldout_size=2, config={},
            prompt_template="{question}", chat_template=False, system_prompt=None, tokenizer_path=None))


def test_the_template_may_name_the_items_metadata() -> None:
    task = ReasoningGymTask(rg(size=4, heldout_size=2, prompt_template="Q: {metadata[expression]}= A:"))
    assert all(it.prompt == f"Q: {it.source[len('Calculate '):-1]}= A:" for it in task.train)
    with pytest.raises(TaskError, match=r"names 'nope' that this dataset's items lack; their metadata keys are \["):
        ReasoningGymTask(rg(size=4, heldout_size=2, prompt_template="{metadata[nope]}"))


def test_the_task_loads_no_torch() -> None:
    """The API process builds the task and scores every result with it, and never loads torch."""
    import subprocess

    code = ("import sys; from coordinator.config import ReasoningGymTaskConfig; from coordinator.tasks.factory import make_task; "
            "t = make_task(ReasoningGymTaskConfig(dataset='basic_arithmetic', size=10, heldout_size=2)); "
            "t.score(t.train[:1], ['1']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_validating_a_config_imports_no_task_library() -> None:
    """Every role process validates the run config; reasoning-gym's registry (seconds to import) is loaded by
    coordinator.tasks when the task is checked or built, not by that validation (issue 33)."""
    import subprocess

    code = ("import sys; from coordinator.config import CoordinatorConfig; "
            "c = CoordinatorConfig.model_validate({'task': {'type': 'reasoning-gym', 'dataset': 'no_such_dataset'}}); "
            "print(c.task.dataset, 'reasoning_gym' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["no_such_dataset", "False"], out.stderr[-2000:]


def test_the_coordinator_refuses_an_unknown_dataset_before_anything_starts(tmp_path: Path) -> None:
    import subprocess

    from shared.exit_codes import ExitCode

    run_toml = tmp_path / "run.toml"
    run_toml.write_text('[task]\ntype = "reasoning-gym"\ndataset = "basic_arithmetics"\n')
    res = subprocess.run([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(run_toml), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert res.returncode == ExitCode.USAGE, res.stderr[-2000:]
    assert "'basic_arithmetics' is not a reasoning-gym dataset" in res.stderr and "basic_arithmetic," in res.stderr
    assert not (tmp_path / "run").exists()  # nothing written
