"""Rewards, computed on the coordinator from the completion text; a client never reports one.

Every reward has TRL's reward-function signature, ``fn(prompts, completions, **columns) -> list[float]``: the
dataset's prompts (before any template), the decoded completions, and the task's columns as lists of the same
length (``answer`` always, plus the ``extra_columns`` a dataset task names). A task combines several rewards with
weights (:class:`RewardSet`); :meth:`RewardSet.score` returns the weighted sums and each reward's mean
(:class:`ScoredBatch`). A reward that raises, returns the wrong number of values or a non-finite value fails the
result it was scoring with :class:`RewardFailed` — a refusal with its own reason code, recorded in the audit log
and never counted against the client — instead of reaching the learner.

Built-ins (``[[task.rewards]] name = ...``):

- ``exact_match``: 1 iff the completion's answer equals the reference answer, both stripped (the answer is the
  text inside the last ``<answer>…</answer>`` if there is one, else the text after the last ``####``, else all).
- ``last_number``: 1 iff the final number matches (GSM8K: the number after ``####``, else the last number).
- ``regex``: 1 iff ``pattern`` matches somewhere in the completion (``re.search``).
- ``format``: 1 iff the completion holds an ``<answer>…</answer>`` span with some text in it.
- ``math``: 1 iff the answer is mathematically equivalent to the reference (``math-verify``: ``\\boxed{}``,
  LaTeX, fractions, thousands separators); needs the ``math`` extra.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ProtocolError, Reason

RewardFn = Callable[..., Sequence[Any]]

# Numbers are ASCII digits only. Python's \d (and int(), float()) also take Arabic-Indic, Devanagari, fullwidth
# and every other Unicode decimal digit; the answer a reward counts is written in ASCII digits, so "٤٢" or "４２" is
# not 42. A run of digits is found with the Unicode \d (so "4٢" is one run, not "4" followed by text) and a run
# holding any non-ASCII digit is not a number at all: it counts as text, like a word. The sign is the ASCII "-".
_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def _ascii_numbers(pattern: re.Pattern[str], text: str) -> Iterator[str]:
    return (m.group() for m in pattern.finditer(text) if m.group().isascii())


def first_integer(text: str) -> int | None:
    """The first integer written in ASCII digits in ``text`` (with a directly preceding ``-``), or None. A run of
    digits that holds any other Unicode digit ("٤٢", "４2") is not an integer: it is skipped like a word."""
    first = next(_ascii_numbers(_INT, text), None)
    return None if first is None else int(first)


def parse_final_number(text: str) -> float | None:
    """GSM8K convention: the number after '####' if present, else the last number in the text. Numbers are ASCII
    digits with optional ``,`` grouping, a ``.`` fraction and a leading ``-``; a number holding any other Unicode
    digit is text, as in :func:`first_integer`."""
    if "####" in text:
        text = text.split("####")[-1]
        candidate = next(_ascii_numbers(_NUMBER, text), None)
    else:
        numbers = list(_ascii_numbers(_NUMBER, text))
        candidate = numbers[-1] if numbers else None
    if candidate is None:
        return None
    try:
        return float(candidate.replace(",", ""))
    except ValueError:
        return None


def final_answer(text: str) -> str:
    """The answer part of a completion or reference: inside the last ``<answer>…</answer>``, else after the last
    ``####``, else the whole text; stripped."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return str(tagged[-1]).strip()
    if "####" in text:
        return text.rsplit("####", 1)[-1].strip()
    return text.strip()


def numbers_match(completion: str, answer: str) -> bool:
    got, want = parse_final_number(completion), parse_final_number(answer)
    return got is not None and want is not None and abs(got - want) < 1e-6


# ---- built-ins (TRL signature) ----------------------------------------------------------------------------
def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [1.0 if final_answer(c) == final_answer(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def last_number(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [1.0 if numbers_match(c, a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def answer_format(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [1.0 if any(t.strip() for t in _ANSWER_TAG.findall(c)) else 0.0 for c in completions]


def regex_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern)

    def regex(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [1.0 if compiled.search(c) else 0.0 for c in completions]

    return regex


class MissingExtra(ImportError):
    """An optional dependency a configured feature needs is not installed; the message says what to install."""


def math_reward() -> RewardFn:
    """Equivalence by math-verify. Imported here, at start-up, so a missing extra stops the run before any job."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise MissingExtra("the 'math' reward needs math-verify: pip install 'echo-swarm[math]' "
                           "(or pip install math-verify)") from None

    def _parse(text: str, timeout: int | None) -> Any:
        parsed = parse(text, parsing_timeout=timeout)
        if not parsed and "$" not in text and "\\boxed" not in text:  # a bare LaTeX reference such as \frac{1}{2}
            parsed = parse(f"${text}$", parsing_timeout=timeout)
        return parsed

    def math_equivalence(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        # math-verify's timeouts are SIGALRM-based: only the main thread may set them (an evaluator thread scores
        # without); the API process scores results on its main thread
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        out = []
        for c, a in zip(completions, answer, strict=True):
            gold = _parse(final_answer(a), timeout)
            pred = parse(final_answer(c) if _ANSWER_TAG.search(c) else c, parsing_timeout=timeout)
            out.append(1.0 if gold and pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
        return out

    return math_equivalence


BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "exact_match": lambda: exact_match,
    "last_number": lambda: last_number,
    "format": lambda: answer_format,
    "math": math_reward,
}


# ---- plug-ins ---------------------------------------------------------------------------------------------
class PluginError(Exception):
    """An operator's reward plug-in cannot be loaded (start-up): the message says which and why."""


def load_plugin(spec: str) -> RewardFn:
    """``package.module:function`` (importable on the coordinator's path) or ``path/to/file.py:function``."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise PluginError(f"reward plug-in {spec!r}: there is no file {path}")
            name = f"echo_swarm_reward_{abs(hash(str(path)))}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise PluginError(f"reward plug-in {spec!r}: {path} cannot be imported as a Python module")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except PluginError:
        raise
    except Exception as exc:  # the operator's module may raise anything while importing
        raise PluginError(f"reward plug-in {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}. "
                          f"Put the module on PYTHONPATH (or name its file: 'path/to/file.py:function')") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise PluginError(f"reward plug-in {spec!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


# ---- combining ----------------------------------------------------------------------------------------------
class RewardFailed(ProtocolError):
    """A reward could not score a result (it raised, or returned the wrong length or a non-finite value). The
    result is refused with reason ``reward_failed``; the fault is the reward's, so nothing counts against the
    client."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.REWARD_FAILED, message)


@dataclass(frozen=True)
class ScoredBatch:
    rewards: list[float]  # the weighted sum per completion: what the learner trains on
    per_reward_means: dict[str, float]  # each reward's own (unweighted) mean over this batch


@dataclass(frozen=True)
class RewardTerm:
    key: str  # the name the per-reward means are recorded under
    fn: RewardFn
    weight: float


def _values(term: RewardTerm, out: Any, n: int) -> list[float | None]:
    if isinstance(out, str | bytes | Mapping) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise RewardFailed(f"reward {term.key} returned {type(out).__name__}, not a list of {n} numbers")
    if len(out) != n:
        raise RewardFailed(f"reward {term.key} returned {len(out)} values for {n} completions")
    values: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:  # TRL: this reward does not apply to this completion
            values.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardFailed(f"reward {term.key} returned {type(v).__name__} for completion {i}, not a number"
                               ) from None
        if not math.isfinite(f):
            raise RewardFailed(f"reward {term.key} returned {f} for completion {i}; rewards must be finite")
        values.append(f)
    return values


class RewardSet:
    """Several rewards, each with a weight: reward = Σ weight · value (a value of None, TRL's "does not apply",
    adds nothing and is left out of that reward's mean)."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise ValueError("a RewardSet needs at least one reward")
        self.terms = list(terms)

    def score(self, prompts: list[str], completions: list[str], columns: Mapping[str, list[Any]]) -> ScoredBatch:
        n = len(completions)
        totals = [0.0] * n
        means: dict[str, float] = {}
        for term in self.terms:
            try:
                out = term.fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
            except RewardFailed:
                raise
            except Exception as exc:  # the operator's code may raise anything: it fails this result only
                raise RewardFailed(f"reward {term.key} raised {type(exc).__name__}: {exc}"[:1500]) from None
            values = _values(term, out, n)
            applied = [v for v in values if v is not None]
            if applied:
                means[term.key] = sum(applied) / len(applied)
            for i, v in enumerate(values):
                if v is not None:
                    totals[i] += term.weight * v
        if not all(math.isfinite(t) for t in totals):
            raise RewardFailed("the weighted reward overflowed; lower the rewards' weights or values")
        return ScoredBatch(rewards=totals, per_reward_means=means)
