"""Multi-turn environment tasks on the coordinator: the task (episode seeds, prompts from first observations), the
job's environment spec, replay verification of a returned episode, and greedy held-out evaluation.

Replay is what makes a multi-turn result trustworthy without trusting the client: the coordinator resets its
own copy of the environment (shared.envs, the same code: the job carries its hash) from the job's seed, steps it
with the actions the model's tokens spell, and checks each observation the client reports against what its copy
answers. The reward is the sum of the replayed steps' rewards, computed here. Only the model's tokens are
checked against the policy (logprob recompute, sampling test) and trained on; the observation tokens are the
environment's, masked out of both. What replay cannot check: an environment whose answers the seed and actions
do not fix (refused at start-up, shared.envs.check_replayable), and an action changed into another with the same
observation (the environment cannot tell them apart either).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from coordinator.config import EnvironmentTaskConfig
from coordinator.errors import TaskError
from coordinator.tasks.rewards import ScoredBatch
from shared.envs import (
    EnvError,
    EnvParams,
    check_replayable,
    code_hash,
    decode_action,
    encode_observation,
    make_env,
    params_json,
    parse_params,
)
from shared.envs.play import play
from shared.errors import ProtocolError, Reason
from shared.messages import Completion, EnvironmentSpec
from shared.policy import generate, stop_token_ids

REWARD_NAME = "episode"


@dataclass(frozen=True)
class EpisodeItem:
    prompt: str  # the formatted first observation: what the job's prompt tokens encode
    answer: str  # the episode seed, as text (TaskItem's shape)
    seed: int
    source: str | None = None
    columns: Any = None


@dataclass(frozen=True)
class Replayed:
    """A result's episodes as the learner sees them: each one a completion of action and observation tokens."""

    sequences: list[list[int]]  # every turn's action tokens then its observation tokens
    masks: list[list[int]]  # 1 on the model's tokens, 0 on observation tokens
    reported: list[list[float]]  # the client's logprobs of the model's tokens only
    rewards: list[float]  # replayed, per episode


class EnvDescription(TypedDict):
    """What an environment task says of itself. ``params`` are the environment's own parameters (config
    ``task.env.params``): their keys are each environment's."""

    env: str
    params: dict[str, object]
    code_sha256: str
    max_turns: int
    train: int
    heldout: int


class EnvTask:
    """A task whose completions are episodes in an environment (task.type = "environment")."""

    name = "environment"

    def __init__(self, config: EnvironmentTaskConfig) -> None:
        self.config = config
        self.env_id = config.env
        try:
            self.params: EnvParams = parse_params(config.env, config.params)
            check_replayable(config.env, self.params, seeds=range(4))  # hidden randomness stops the run here
        except EnvError as exc:
            raise TaskError(str(exc)) from None
        self.code_sha256 = code_hash(config.env)
        self.params_json = params_json(self.params)
        seen: set[str] = set()
        items: list[EpisodeItem] = []
        for seed in range(config.episodes):
            first = make_env(self.env_id, self.params).reset(seed)
            if first in seen:
                continue
            seen.add(first)
            items.append(EpisodeItem(prompt=config.prompt_template.format(observation=first), answer=str(seed),
                                     seed=seed))
        random.Random(config.split_seed).shuffle(items)
        if config.heldout_size >= len(items):
            raise TaskError(f"environment {self.env_id!r} has {len(items)} distinct starting states in "
                            f"{config.episodes} seeds; heldout_size ({config.heldout_size}) must be smaller")
        self.heldout: list[Any] = items[: config.heldout_size]
        self.train: list[Any] = items[config.heldout_size :]

    # -- the job --------------------------------------------------------------------------------------------
    def spec(self, prompt_ids: Sequence[int]) -> EnvironmentSpec:
        return EnvironmentSpec(env_id=self.env_id, code_sha256=self.code_sha256, params_json=self.params_json,
                               seeds=[self.train[i].seed for i in prompt_ids], max_turns=self.config.max_turns,
                               max_observation_tokens=self.config.max_observation_tokens)

    # -- replay verification ------------------------------------------------------------------------------
    def replay(self, completions: Sequence[Completion], seeds: Sequence[int], *, tokenizer: Any, max_tokens: int,
               stop_ids: frozenset[int], vocab_size: int) -> Replayed:
        """Replay every episode (``seeds`` per completion); raise ProtocolError with the first failure's reason."""
        out = Replayed([], [], [], [])
        for k, (comp, seed) in enumerate(zip(completions, seeds, strict=True)):
            if comp.turns is None or comp.token_ids or comp.logprobs:
                raise ProtocolError(Reason.SHAPE_MISMATCH, f"completion {k}: a multi-turn job's completions carry "
                                                           f"their tokens in 'turns' (token_ids and logprobs empty)")
            env = make_env(self.env_id, self.params)
            env.reset(seed)
            seq: list[int] = []
            mask: list[int] = []
            reported: list[float] = []
            total, done = 0.0, False
            for t, turn in enumerate(comp.turns):
                where = f"episode {k}, turn {t}"
                if turn.reward is not None:
                    raise ProtocolError(Reason.REWARD_CLAIMED, f"{where} reports a reward ({turn.reward}); rewards are "
                                                               f"computed by the coordinator's replay: send none")
                if done or t >= self.config.max_turns:
                    why = "the episode had ended" if done else f"the job allows {self.config.max_turns} turns"
                    raise ProtocolError(Reason.EXTRA_TURN, f"{where} follows the end of the episode ({why})")
                _check_turn(turn, where, max_tokens, stop_ids, vocab_size)
                before = env.clone()
                step = env.step(decode_action(tokenizer, turn.token_ids))
                if list(turn.observation_ids) != encode_observation(tokenizer, step.observation):
                    other = self._answering_action(before, turn.observation_ids, tokenizer)
                    if other is not None:
                        raise ProtocolError(Reason.UNSEEN_ACTION,
                                            f"{where}: the observation answers action {other!r}, but the turn's "
                                            f"tokens say {decode_action(tokenizer, turn.token_ids)!r}: the action "
                                            f"was changed after the environment saw it")
                    raise ProtocolError(Reason.OBSERVATION_MISMATCH,
                                        f"{where}: the observation is not what environment {self.env_id!r} answers "
                                        f"to this action when replayed from the job's seed. Send the environment's "
                                        f"observations unchanged (and run its code version {self.code_sha256[:12]})")
                total += step.reward
                done = step.done
                seq.extend(turn.token_ids)
                seq.extend(turn.observation_ids)
                mask.extend([1] * len(turn.token_ids) + [0] * len(turn.observation_ids))
                reported.extend(turn.logprobs)
            if not done and len(comp.turns) < self.config.max_turns:
                raise ProtocolError(Reason.MISSING_TURN,
                                    f"episode {k} stops after {len(comp.turns)} turns, but it had not ended: play "
                                    f"until the environment says done or {self.config.max_turns} turns")
            out.sequences.append(seq)
            out.masks.append(mask)
            out.reported.append(reported)
            out.rewards.append(total)
        return out

    def _answering_action(self, state: Any, observation_ids: Sequence[int], tokenizer: Any) -> str | None:
        """The canonical action whose answer from ``state`` is the reported observation, if any."""
        for action in state.actions:
            probe = state.clone()
            if encode_observation(tokenizer, probe.step(action).observation) == list(observation_ids):
                return str(action)
        return None

    # -- Task protocol: single-completion scoring does not apply -------------------------------------------
    def score(self, items: Sequence[Any], completions: Sequence[str]) -> ScoredBatch:
        raise TaskError("episodes are scored by replay (EnvTask.replay), not from completion text")

    def reward(self, item: Any, completion: str) -> float:
        raise TaskError("episodes are scored by replay (EnvTask.replay), not from completion text")

    # -- held-out evaluation --------------------------------------------------------------------------------
    def greedy_success(self, model: Any, tokenizer: Any, items: Sequence[Any], max_tokens: int) -> float:
        """Share of held-out episodes the greedy policy solves (the environment's own ``solved``)."""

        tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        stops = stop_token_ids(tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]

        def greedy(contexts: list[list[int]], turn: int) -> Any:
            return generate(model, contexts, group_size=1, temperature=1.0, max_tokens=max_tokens, stop_ids=stops,
                            seed=None, pad_id=pad)

        prompts = [list(tokenizer.encode(it.prompt)) for it in items]
        episodes = play(greedy, prompts, [it.seed for it in items], group_size=1, env_id=self.env_id,
                        params=self.params, max_turns=self.config.max_turns,
                        max_observation_tokens=self.config.max_observation_tokens, tokenizer=tok)
        return sum(1.0 for ep in episodes if ep.solved) / max(1, len(episodes))

    def describe(self) -> EnvDescription:
        return {"env": self.env_id, "params": json.loads(self.params_json), "code_sha256": self.code_sha256,
                "max_turns": self.config.max_turns, "train": len(self.train), "heldout": len(self.heldout)}


def _check_turn(turn: Any, where: str, max_tokens: int, stop_ids: frozenset[int], vocab_size: int) -> None:
    """A turn's action obeys the rules of a completion (core.verify.verify_submission)."""
    n = len(turn.token_ids)
    if n != len(turn.logprobs):
        raise ProtocolError(Reason.SHAPE_MISMATCH, f"{where}: {n} tokens but {len(turn.logprobs)} logprobs")
    if n > max_tokens:
        raise ProtocolError(Reason.TOKEN_OUT_OF_RANGE, f"{where}: {n} tokens; max_tokens is {max_tokens} per turn")
    bad = next((t for t in [*turn.token_ids, *turn.observation_ids] if t >= vocab_size), None)
    if bad is not None:
        raise ProtocolError(Reason.TOKEN_OUT_OF_RANGE, f"{where}: token id {bad} is outside the vocabulary "
                                                       f"(size {vocab_size})")
    stops = [i for i, t in enumerate(turn.token_ids) if t in stop_ids]
    if turn.finish_reason == "stop" and stops != [n - 1]:
        raise ProtocolError(Reason.FINISH_REASON, f"{where}: finish_reason 'stop' requires exactly one stop token, "
                                                  f"at the end")
    if turn.finish_reason == "length" and (stops or n != max_tokens):
        raise ProtocolError(Reason.FINISH_REASON, f"{where}: finish_reason 'length' requires max_tokens tokens and "
                                                  f"no stop token")


def select(rows: Sequence[Sequence[float]], masks: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per sequence, the values at the model's tokens (mask 1)."""
    return [[v for v, m in zip(row, mask, strict=True) if m] for row, mask in zip(rows, masks, strict=True)]


def episode_behaviour(replayed: Replayed, recomputed: list[list[float]]) -> list[list[float]]:
    """π_b of each episode over its whole sequence, for the learner: the client's logprobs at the model's tokens,
    the verifier's recompute (``recomputed``, over the whole sequence) at the observations, which the loss mask
    leaves out."""
    behaviour: list[list[float]] = []
    for mask, reported, rec in zip(replayed.masks, replayed.reported, recomputed, strict=True):
        it = iter(reported)
        behaviour.append([next(it) if m else r for m, r in zip(mask, rec, strict=True)])
    return behaviour
