from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.config import ArithmeticTaskConfig, ConfigError, JsonlTaskConfig, load_config
from coordinator.errors import TaskError
from coordinator.tasks.base import TaskItem
from coordinator.tasks.builtin import ArithmeticTask, JsonlQATask, first_integer, parse_final_number
from coordinator.tasks.factory import make_task

# ---- arithmetic -----------------------------------------------------------------------------------------


def small_arith(**kw: int) -> ArithmeticTask:
    return ArithmeticTask(ArithmeticTaskConfig(**({"max_operand": 9, "heldout_size": 20} | kw)))


def test_arithmetic_split_sizes_and_disjoint() -> None:
    task = small_arith()
    assert len(task.heldout) == 20
    assert len(task.train) == 100 - 20
    train = {i.prompt for i in task.train}
    held = {i.prompt for i in task.heldout}
    assert len(train) == 80 and len(held) == 20
    assert not train & held
    all_prompts = {ArithmeticTask.format_prompt(a, b) for a in range(10) for b in range(10)}
    assert train | held == all_prompts


def test_arithmetic_default_config_sizes() -> None:
    task = ArithmeticTask(ArithmeticTaskConfig())
    assert len(task.heldout) == 512 and len(task.train) == 100 * 100 - 512


def test_arithmetic_items_are_correct() -> None:
    for item in small_arith().train:
        a, b = item.prompt.removeprefix("Q: ").removesuffix("= A:").split("+")
        assert item.answer == str(int(a) + int(b))


def test_arithmetic_split_deterministic_and_seeded() -> None:
    assert small_arith().heldout == small_arith().heldout
    assert small_arith().heldout != small_arith(split_seed=1).heldout


def test_arithmetic_heldout_too_large() -> None:
    with pytest.raises(TaskError, match="heldout_size"):
        small_arith(max_operand=3, heldout_size=16)


def test_prompt_format() -> None:
    assert ArithmeticTask.format_prompt(12, 7) == "Q: 12+7= A:"


ITEM = TaskItem("Q: 20+22= A:", "42")


@pytest.mark.parametrize(("completion", "reward"), [
    (" 42", 1.0),
    ("42", 1.0),
    ("   42\n", 1.0),
    (" 42 and then some text 7", 1.0),
    (" 42<eos>", 1.0),
    (" 43", 0.0),
    (" 4", 0.0),
    (" 420", 0.0),
    (" -42", 0.0),
    (" 7 42", 0.0),          # the first integer counts, not any integer
    ("", 0.0),
    (" forty-two", 0.0),
    (" ", 0.0),
])
def test_arithmetic_reward(completion: str, reward: float) -> None:
    assert small_arith().reward(ITEM, completion) == reward


def test_first_integer() -> None:
    assert first_integer("a -5 b 6") == -5
    assert first_integer("none") is None


# ---- parse_final_number ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", 72.0),
    ("#### 1,234", 1234.0),
    ("so 5 + 5 = 10\n#### 1,234,567", 1234567.0),
    ("#### -3", -3.0),
    ("####12", 12.0),
    ("#### 2.5", 2.5),
    ("1 then 2 #### 3 and 4", 3.0),            # the first number after the marker
    ("The answer is 42.", 42.0),                # last number fallback, sentence full stop
    ("3 apples and 4 pears make 7", 7.0),
    ("It costs $1,000.50 in total", 1000.5),
    ("temperature -12 degrees", -12.0),
    ("0.75", 0.75),
    ("7", 7.0),
    ("no numbers here", None),
    ("", None),
    ("#### none", None),
])
def test_parse_final_number(text: str, expected: float | None) -> None:
    assert parse_final_number(text) == expected


# ---- jsonl ----------------------------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def qa_rows(n: int) -> list[object]:
    return [{"question": f"What is {i} + 1?", "answer": f"{i} plus one\n#### {i + 1}"} for i in range(n)]


def test_jsonl_split_from_one_file(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", qa_rows(10))
    task = JsonlQATask(JsonlTaskConfig(train_path=train, heldout_size=3))
    assert len(task.heldout) == 3 and len(task.train) == 7
    assert not {i.prompt for i in task.train} & {i.prompt for i in task.heldout}
    assert {i.prompt for i in task.train + task.heldout} == {f"Question: What is {i} + 1?\nAnswer:" for i in range(10)}


def test_jsonl_separate_heldout_file(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", qa_rows(4))
    held = write_jsonl(tmp_path / "held.jsonl", [{"question": "Q?", "answer": 5}])
    task = JsonlQATask(JsonlTaskConfig(train_path=train, heldout_path=held, heldout_size=100))
    assert len(task.train) == 4 and [i.answer for i in task.heldout] == ["5"]
    assert [i.prompt for i in task.train][0] == "Question: What is 0 + 1?\nAnswer:"  # file order kept


def test_jsonl_custom_template_and_blank_lines(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", ["", qa_rows(1)[0], "   ", qa_rows(2)[1], ""])
    task = JsonlQATask(JsonlTaskConfig(train_path=train, heldout_path=train, prompt_template="Q: {question} A:"))
    assert [i.prompt for i in task.train] == ["Q: What is 0 + 1? A:", "Q: What is 1 + 1? A:"]


def test_jsonl_reward(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", qa_rows(2))
    task = JsonlQATask(JsonlTaskConfig(train_path=train, heldout_path=train))
    item = TaskItem("Q", "... #### 1,234")
    assert task.reward(item, "The total is 1234") == 1.0
    assert task.reward(item, "work...\n#### 1,234.0") == 1.0
    assert task.reward(item, "I get 1234 then 12") == 0.0
    assert task.reward(item, "no idea") == 0.0
    assert task.reward(TaskItem("Q", "#### -2.5"), "-2.5") == 1.0


def test_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="cannot read"):
        JsonlQATask(JsonlTaskConfig(train_path=tmp_path / "absent.jsonl"))


def test_jsonl_missing_heldout_file(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", qa_rows(2))
    with pytest.raises(TaskError):
        JsonlQATask(JsonlTaskConfig(train_path=train, heldout_path=tmp_path / "absent.jsonl"))


@pytest.mark.parametrize("bad", ["{not json", '{"question": "q"}', '{"answer": "#### 1"}', "[1, 2]", "42", "null",
                                 '"a string"'])
def test_jsonl_bad_line_names_line_number(tmp_path: Path, bad: str) -> None:
    rows = qa_rows(2) + [bad] + qa_rows(1)
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(TaskError) as info:
        JsonlQATask(JsonlTaskConfig(train_path=path, heldout_size=1))
    assert f"{path}:3:" in str(info.value)


def test_jsonl_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [qa_rows(1)[0], "", "{broken"])
    with pytest.raises(TaskError, match=r":3:"):
        JsonlQATask(JsonlTaskConfig(train_path=path, heldout_size=1))


def test_jsonl_answer_without_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(1) + [{"question": "q", "answer": "no number at all"}])
    with pytest.raises(TaskError) as info:
        JsonlQATask(JsonlTaskConfig(train_path=path, heldout_size=1))
    assert f"{path}:2:" in str(info.value)
    assert "####" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_jsonl_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TaskError, match="no questions"):
        JsonlQATask(JsonlTaskConfig(train_path=path))


def test_jsonl_heldout_size_too_large(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(3))
    with pytest.raises(TaskError, match="heldout_size"):
        JsonlQATask(JsonlTaskConfig(train_path=path, heldout_size=3))


def test_template_without_placeholder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"task.type": "jsonl", "task.train_path": str(tmp_path / "t.jsonl"),
                           "task.prompt_template": "Question: Answer:"})
    assert "prompt_template" in str(info.value)
    assert "{question}" in str(info.value)


@pytest.mark.parametrize("template", ["{question} {answer}", "Q: {question} {0}", "JSON {\"q\": {question}}"])
def test_unusable_template_is_refused_not_a_crash(tmp_path: Path, template: str) -> None:
    # A template that passes validation must be usable; one that is not must fail as ConfigError or
    # TaskError, never as a bare KeyError/IndexError/ValueError from str.format.
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(3))
    try:
        cfg = load_config(None, {"task.type": "jsonl", "task.train_path": str(path),
                                 "task.prompt_template": template, "task.heldout_size": 1})
    except ConfigError:
        return
    with pytest.raises(TaskError):
        make_task(cfg.task)


def test_make_task_dispatches(tmp_path: Path) -> None:
    assert isinstance(make_task(ArithmeticTaskConfig(max_operand=9, heldout_size=16)), ArithmeticTask)
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(3))
    assert isinstance(make_task(JsonlTaskConfig(train_path=path, heldout_size=1)), JsonlQATask)


# ---- strict answer parser: ASCII digits only ----------------------------------------------------------------
# Python's \d, int() and float() accept every Unicode decimal digit; the reward must not. Each form below is
# "42" (or 1234) in another script: none of them is the answer.
OTHER_DIGITS = {
    "arabic-indic": "٤٢",
    "extended-arabic-indic": "۴۲",
    "devanagari": "४२",
    "bengali": "৪২",
    "fullwidth": "４２",
    "mathematical-bold": "𝟒𝟐",
    "thai": "๔๒",
    "mixed-ascii-first": "4٢",
    "mixed-ascii-last": "٤2",
    "mixed-fullwidth": "４2",
}


@pytest.mark.parametrize("digits", OTHER_DIGITS.values(), ids=OTHER_DIGITS.keys())
def test_other_unicode_digits_are_not_the_arithmetic_answer(digits: str) -> None:
    assert int(digits) == 42  # what a lax parser (int, \d) would have taken
    assert small_arith().reward(ITEM, f" {digits}") == 0.0
    assert first_integer(f" {digits}") is None
    assert first_integer(f" -{digits}") is None


@pytest.mark.parametrize("digits", OTHER_DIGITS.values(), ids=OTHER_DIGITS.keys())
def test_other_unicode_digits_are_skipped_like_words(digits: str) -> None:
    # a run holding a non-ASCII digit is text: the next ASCII integer is the first integer
    assert first_integer(f"{digits} 42") == 42
    assert small_arith().reward(ITEM, f" {digits} 7") == 0.0
    assert small_arith().reward(ITEM, f" {digits} 42") == 1.0


@pytest.mark.parametrize("digits", ["٤٢", "４２", "४२", "4٢", "٤2", "４2"])
def test_other_unicode_digits_are_not_a_final_number(digits: str) -> None:
    assert parse_final_number(f"#### {digits}") is None
    assert parse_final_number(digits) is None
    assert parse_final_number(f"the answer is 7 then {digits}") == 7.0  # the last *ASCII* number


def test_jsonl_reward_refuses_other_digits(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", qa_rows(2))
    task = JsonlQATask(JsonlTaskConfig(train_path=train, heldout_path=train))
    item = TaskItem("Q", "#### 42")
    assert task.reward(item, "#### 42") == 1.0
    assert task.reward(item, "#### ٤٢") == 0.0
    assert task.reward(item, "#### ４２") == 0.0
    assert task.reward(item, "so ٤٢") == 0.0


def test_a_task_file_answer_in_other_digits_has_no_final_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(2) + [{"question": "q", "answer": "#### ٤٢"}])
    with pytest.raises(TaskError) as info:
        JsonlQATask(JsonlTaskConfig(train_path=path, heldout_size=1))
    assert f"{path}:3:" in str(info.value)


def test_unicode_minus_is_not_a_sign() -> None:
    assert first_integer(" \u221242") == 42  # U+2212 MINUS SIGN is text; the ASCII hyphen-minus is the sign
    assert first_integer(" -42") == -42
