"""Built-in rewards on real answer formats, weighted combinations, and plug-ins that misbehave: a failing reward is
a typed refusal (reward_failed), never a crash and never counted against the client."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.trust import is_invalidating
from coordinator.tasks.rewards import (
    RewardFailed,
    RewardSet,
    RewardTerm,
    answer_format,
    exact_match,
    final_answer,
    last_number,
    load_plugin,
    math_reward,
    regex_reward,
)
from shared.errors import HTTP_STATUS, ProtocolError, Reason

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def one(fn: Any, completion: str, answer: str) -> float:
    return float(fn(["q"], [completion], answer=[answer])[0])


# ---- last_number (today's jsonl reward) ---------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "answer", "want"), [
    ("She sold 72 clips in all.", GSM8K_ANSWER, 1.0),
    ("48 + 24 = 72\n#### 72", GSM8K_ANSWER, 1.0),
    ("#### 72 and then 5 more words", GSM8K_ANSWER, 1.0),  # after ####, the first number counts
    ("The total is $1,234.", "#### 1234", 1.0),  # thousands separators
    ("-2.5", "#### -2.5", 1.0),
    ("72 clips, or 73?", GSM8K_ANSWER, 0.0),  # the last number counts
    ("seventy-two", GSM8K_ANSWER, 0.0),  # no number at all
    ("٧٢", GSM8K_ANSWER, 0.0),  # other Unicode digits are text
])
def test_last_number(completion: str, answer: str, want: float) -> None:
    assert one(last_number, completion, answer) == want


# ---- exact_match --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "answer", "want"), [
    ("Paris", "Paris", 1.0),
    ("  Paris\n", "Paris", 1.0),
    ("<think>capital of France</think><answer> Paris </answer>", "Paris", 1.0),
    ("reasoning… #### 72", GSM8K_ANSWER, 1.0),
    ("paris", "Paris", 0.0),
    ("The answer is Paris", "Paris", 0.0),
    ("<answer>Lyon</answer>", "Paris", 0.0),
])
def test_exact_match(completion: str, answer: str, want: float) -> None:
    assert one(exact_match, completion, answer) == want


def test_final_answer_prefers_the_last_answer_tag() -> None:
    assert final_answer("<answer>1</answer> no, <answer>2</answer> #### 3") == "2"
    assert final_answer("work #### 3 ") == "3"


# ---- format and regex ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "want"), [
    ("<answer>42</answer>", 1.0),
    ("<think>…</think>\n<answer>\nx = 4\n</answer>", 1.0),
    ("<answer>  </answer>", 0.0),  # empty
    ("<answer>42", 0.0),  # unclosed
    ("answer: 42", 0.0),
])
def test_format_reward(completion: str, want: float) -> None:
    assert answer_format(["q"], [completion]) == [want]


def test_regex_reward() -> None:
    fn = regex_reward(r"^<think>.*</think>")
    assert fn(["q", "q"], ["<think>hm</think> 4", "4 <think></think>"]) == [1.0, 0.0]


# ---- math (math-verify) -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def math_fn() -> Any:
    import math_verify  # noqa: F401 — the optional extra is installed for the tests
    return math_reward()


@pytest.mark.parametrize(("completion", "answer", "want"), [
    ("So the answer is $\\boxed{72}$.", GSM8K_ANSWER, 1.0),  # GSM8K '####' reference, boxed completion
    ("48 + 24 = 72\n#### 72", GSM8K_ANSWER, 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # bare LaTeX reference
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "$\\frac{1}{2}$", 1.0),
    ("The total is 1,234 dollars.", "#### 1234", 1.0),  # thousands separator
    ("<answer>3/4</answer>", "\\frac{3}{4}", 1.0),
    ("\\boxed{73}", GSM8K_ANSWER, 0.0),
    ("I do not know", GSM8K_ANSWER, 0.0),
    ("", "\\frac{1}{2}", 0.0),
])
def test_math_equivalence(math_fn: Any, completion: str, answer: str, want: float) -> None:
    assert one(math_fn, completion, answer) == want


def test_math_without_math_verify_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.tasks.rewards import MissingExtra

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    with pytest.raises(MissingExtra, match=r"echo-swarm\[math\]"):
        math_reward()


# ---- combining and failing ----------------------------------------------------------------------------------
def const(value: Any) -> Any:
    def fn(prompts: list[str], completions: list[str], **_: Any) -> Any:
        return [value] * len(completions)
    return fn


def test_weighted_sum_and_per_reward_means() -> None:
    rs = RewardSet([RewardTerm("last_number", last_number, 1.0), RewardTerm("format", answer_format, 0.5)])
    scored = rs.score(["q", "q"], ["<answer>72</answer>", "71"], {"answer": ["72", "72"]})
    assert scored.rewards == [1.5, 0.0]
    assert scored.per_reward_means == {"last_number": 0.5, "format": 0.5}


def test_columns_reach_the_reward_by_name() -> None:
    seen: dict[str, Any] = {}

    def plug(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        seen.update(columns, prompts=prompts)
        return [float(d) for d in columns["difficulty"]]

    scored = RewardSet([RewardTerm("p", plug, 2.0)]).score(["a", "b"], ["x", "y"],
                                                           {"answer": ["1", "2"], "difficulty": [1, 3]})
    assert scored.rewards == [2.0, 6.0]
    assert seen == {"answer": ["1", "2"], "difficulty": [1, 3], "prompts": ["a", "b"]}


def test_none_means_does_not_apply() -> None:
    def partial(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [None, 1.0]

    scored = RewardSet([RewardTerm("p", partial, 1.0)]).score(["a", "b"], ["x", "y"], {})
    assert scored.rewards == [0.0, 1.0] and scored.per_reward_means == {"p": 1.0}


def boom(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    raise KeyError("solution")


@pytest.mark.parametrize(("fn", "match"), [
    (boom, r"reward p raised KeyError"),
    (const(math.nan), r"returned nan for completion 0"),
    (const(math.inf), r"returned inf"),
    (const("1.0x"), r"returned str for completion 0, not a number"),
    (lambda prompts, completions, **_: [1.0], r"returned 1 values for 2 completions"),
    (lambda prompts, completions, **_: 1.0, r"returned float, not a list"),
    (lambda prompts, completions, **_: "11", r"returned str, not a list"),
])
def test_a_failing_reward_is_a_typed_refusal(fn: Any, match: str) -> None:
    rs = RewardSet([RewardTerm("last_number", last_number, 1.0), RewardTerm("p", fn, 1.0)])
    with pytest.raises(RewardFailed, match=match) as info:
        rs.score(["q", "q"], ["1", "2"], {"answer": ["1", "2"]})
    err = info.value
    assert isinstance(err, ProtocolError) and err.reason is Reason.REWARD_FAILED
    assert HTTP_STATUS[err.reason] == 422
    assert not is_invalidating(err.reason)  # the reward's fault, not the client's: no trust lost


def test_overflowing_weights_are_refused() -> None:
    rs = RewardSet([RewardTerm("a", const(1e308), 1e10)])
    with pytest.raises(RewardFailed, match="overflowed"):
        rs.score(["q"], ["x"], {})


# ---- loading plug-ins ---------------------------------------------------------------------------------------
def test_plugin_from_a_file_and_from_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, **kw):\n    return [1.0 if len(c) < 5 else 0.0 for c in completions]\n")
    fn = load_plugin(f"{tmp_path / 'my_rewards.py'}:short")
    assert fn(["q", "q"], ["ok", "far too long"]) == [1.0, 0.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_plugin("my_rewards:short")(["q"], ["ok"]) == [1.0]


@pytest.mark.parametrize(("spec", "match"), [
    ("no_such_module_xyz:f", r"importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("coordinator.tasks.rewards:no_such_function", r"has no function 'no_such_function'"),
    ("/nonexistent/r.py:f", r"there is no file"),
])
def test_a_plugin_that_cannot_load_is_named(spec: str, match: str) -> None:
    from coordinator.tasks.rewards import PluginError

    with pytest.raises(PluginError, match=match):
        load_plugin(spec)


def test_a_plugin_that_raises_on_import_is_named(tmp_path: Path) -> None:
    from coordinator.tasks.rewards import PluginError

    (tmp_path / "bad.py").write_text("raise RuntimeError('no licence key')\n")
    with pytest.raises(PluginError, match="RuntimeError: no licence key"):
        load_plugin(f"{tmp_path / 'bad.py'}:f")
