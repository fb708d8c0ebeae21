"""Held-out evaluation: greedy accuracy of a policy on prompts that are never trained on."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.engine.weights import load_full_state, read_weights
from coordinator.tasks.base import Task, TaskItem
from shared.policy import generate, load_model, load_tokenizer, stop_token_ids

YIELD_BATCH = 128  # prompts per greedy batch when the evaluator yields between batches (Evaluator.yield_to)


def greedy_accuracy(model: Any, tokenizer: Any, task: Task, items: Sequence[TaskItem], max_tokens: int,
                    batch_size: int = 256, before_batch: Callable[[], object] | None = None) -> float:
    """Share of ``items`` whose greedy completion earns reward 1 under the task's own reward. ``before_batch``
    runs before each batch of ``batch_size`` prompts (the evaluator lets verification go first there)."""

    episodes = getattr(task, "greedy_success", None)
    if episodes is not None:  # a multi-turn task: the share of held-out episodes solved (coordinator.tasks.episodes)
        return float(_in_eval_mode(model, lambda: episodes(model, tokenizer, items, max_tokens)))
    return _batched_accuracy(lambda fn: fn(model), tokenizer, task, items, max_tokens, batch_size, before_batch)


def borrowed_accuracy(on_model: Callable[[Callable[[Any], Any]], Any], tokenizer: Any, task: Task,
                      items: Sequence[TaskItem], max_tokens: int, batch_size: int,
                      before_batch: Callable[[], object] | None = None) -> float:
    """:func:`greedy_accuracy` on a model someone else holds: ``on_model(fn)`` returns ``fn(model)``, called once per
    batch (the verifier lends its replica between recomputes, coordinator.engine.verifier.Verifier.lend). A
    multi-turn task's episodes are played ``batch_size`` at a time as well, so no call holds the model long."""
    episodes = getattr(task, "greedy_success", None)
    if episodes is None:
        return _batched_accuracy(on_model, tokenizer, task, items, max_tokens, batch_size, before_batch)
    solved = 0.0
    for start in range(0, len(items), batch_size):
        if before_batch is not None:
            before_batch()
        chunk = items[start : start + batch_size]

        def play(model: Any, chunk: Sequence[TaskItem] = chunk) -> Any:
            return _in_eval_mode(model, lambda: episodes(model, tokenizer, chunk, max_tokens))

        solved += float(on_model(play)) * len(chunk)
    return solved / max(1, len(items))


def _batched_accuracy(on_model: Callable[[Callable[[Any], Any]], Any], tokenizer: Any, task: Task,
                      items: Sequence[TaskItem], max_tokens: int, batch_size: int,
                      before_batch: Callable[[], object] | None) -> float:
    stops = stop_token_ids(tokenizer)
    correct = 0.0
    for start in range(0, len(items), batch_size):
        if before_batch is not None:
            before_batch()
        chunk = items[start : start + batch_size]
        prompts = [tokenizer.encode(it.prompt) for it in chunk]

        def greedy(model: Any, prompts: list[list[int]] = prompts) -> list[Any]:
            return _in_eval_mode(model, lambda: generate(model, prompts, group_size=1, temperature=1.0,
                                                         max_tokens=max_tokens, stop_ids=stops, seed=None,
                                                         pad_id=pad_id(tokenizer)))

        outs = on_model(greedy)
        for it, out in zip(chunk, outs, strict=True):
            correct += task.reward(it, tokenizer.decode(out.token_ids, skip_special_tokens=True))
    return correct / max(1, len(items))


def _in_eval_mode(model: Any, fn: Callable[[], Any]) -> Any:
    was_training = model.training
    model.eval()
    try:
        return fn()
    finally:
        model.train(was_training)


def pad_id(tokenizer: Any) -> int:
    """Padding id for batching: the tokenizer's pad token, else its end-of-sequence token."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pid) if pid is not None else 0


@dataclass(frozen=True)
class EvalOutcome:
    version: int
    accuracy: float
    n: int  # held-out prompts evaluated
    seconds: float  # loading and generating, on the evaluator's thread
    load_s: float  # of which loading the snapshot


class Evaluator:
    """Held-out evaluation of *published* snapshots, on its own thread.

    Evaluating on the learner's model meant the learner stopped learning for it (10–12 s per evaluation at
    0.5 B parameters). Here a version is evaluated from the files clients download, so the figure is the
    accuracy of what was actually published (in the publish dtype).

    With ``borrow(version, fn)`` (the verifier role: coordinator.engine.verifier.Verifier.lend) the evaluation
    runs each batch on a model that already holds the version — the verifier's replica, loaded from the same
    snapshot — so the role holds one model, not two (a second float32 copy was most of the verifier role's 4.1×
    its replica at 0.5 B, issue 23), and the accuracy is computed in the replica's dtype (``model.dtype``; an own
    copy is float32); ``tokenizer_of(folder)`` reads the tokenizer (default: the folder's own).
    Otherwise the model is loaded for an evaluation and dropped after it unless ``keep_model``: memory holds one
    extra model copy only while evaluating. ``load(folder)`` returns (model, tokenizer) for a snapshot folder (a
    LoRA layout can pass its own).
    """

    def __init__(self, task: Task, items: Sequence[TaskItem], max_tokens: int, *, device: str = "cpu",
                 load: Any = None, keep_model: bool = False, yield_to: Callable[[], object] | None = None,
                 borrow: Callable[[int, Callable[[Any], Any]], Any] | None = None,
                 tokenizer_of: Callable[[Path], Any] | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.task = task
        self.items = list(items)
        self.max_tokens = max_tokens
        self.device = device
        self._load = load or self._load_folder
        self._borrow = borrow
        self._tokenizer_of = tokenizer_of or load_tokenizer
        self.keep_model = keep_model
        self.yield_to = yield_to  # called before the load and each batch: lets more urgent work on the host go first
        self._model: Any = None
        self._tokenizer: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluator")
        self.eval_s_total = 0.0  # seconds spent evaluating, for the step metrics

    def _load_folder(self, folder: Path) -> tuple[Any, Any]:
        if self._model is not None:  # same architecture: load the new weights in place
            load_full_state(self._model, read_weights(folder, self.device), folder)
            return self._model, self._tokenizer
        model = load_model(folder, self.device, own_memory=True)
        return model, load_tokenizer(folder)

    def submit(self, version: int, folder: Path) -> Future[EvalOutcome]:
        """Evaluate the snapshot in ``folder`` in the background; the future carries the accuracy."""
        return self._executor.submit(self._evaluate, version, folder)

    def _evaluate(self, version: int, folder: Path) -> EvalOutcome:
        t0 = time.monotonic()
        if self.yield_to is not None:
            self.yield_to()
        if self._borrow is not None:
            return self._evaluate_borrowed(self._borrow, version, folder, t0)
        model, tokenizer = self._load(folder)
        load_s = time.monotonic() - t0
        try:
            acc = greedy_accuracy(model, tokenizer, self.task, self.items, self.max_tokens,
                                  batch_size=YIELD_BATCH if self.yield_to is not None else 256,
                                  before_batch=self.yield_to)
        finally:
            if self.keep_model:
                self._model, self._tokenizer = model, tokenizer
            else:
                self._model = self._tokenizer = None
        seconds = time.monotonic() - t0
        self.eval_s_total += seconds
        return EvalOutcome(version, acc, len(self.items), seconds, load_s)

    def _evaluate_borrowed(self, borrow: Callable[[int, Callable[[Any], Any]], Any], version: int, folder: Path,
                           t0: float) -> EvalOutcome:
        tokenizer = self._tokenizer_of(folder)
        borrow(version, lambda model: None)  # the replica loads the version now, if it holds another
        load_s = time.monotonic() - t0
        acc = borrowed_accuracy(lambda fn: borrow(version, fn), tokenizer, self.task, self.items, self.max_tokens,
                                batch_size=YIELD_BATCH if self.yield_to is not None else 256,
                                before_batch=self.yield_to)
        seconds = time.monotonic() - t0
        self.eval_s_total += seconds
        return EvalOutcome(version, acc, len(self.items), seconds, load_s)

    def close(self) -> None:
        """Stop taking work; an evaluation already running finishes in the background (it writes nothing)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
