"""The episode loop, one implementation for every side that plays: the client's job (swarm_client.episodes, any
backend) and the coordinator's held-out evaluation (greedy). A turn generates one action per live episode in
one batch, steps each episode's environment with its decoded action, and appends the observation's tokens to
that episode's context; an episode ends when its environment says done or after ``max_turns`` turns."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.envs import EnvError, EnvParams, decode_action, encode_observation, make_env

#: (contexts, turn) → one sampled action per context, in order. ``Sampled``-like objects: token_ids, logprobs,
#: finish_reason.
Generate = Callable[[list[list[int]], int], Sequence[Any]]


@dataclass
class Episode:
    seed: int
    context: list[int]  # prompt, then every action and observation so far
    turns: list[tuple[Any, list[int]]] = field(default_factory=list)  # (sampled action, observation tokens)
    reward: float = 0.0
    done: bool = False
    solved: bool = False


def turn_seed(job_seed: int, turn: int) -> int:
    """The sampling seed of one turn of a job, derived from the job's seed (turns must not share a stream)."""
    digest = hashlib.sha256(f"{job_seed}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**63)


def episode_segments(job_seed: int, turns: Sequence[Sequence[tuple[int, int]]]) -> list[list[tuple[int, int, int, int]]]:
    """The keyed draws (shared.sampler.Segment) of a job's episodes as :func:`play` sampled them, from each
    episode's turns as (action tokens, observation tokens) counts: turn k of every episode was one generation with
    seed :func:`turn_seed` (job seed, k) over the episodes still live at turn k, in episode order — so an episode's
    rollout index at turn k is the number of earlier episodes that had a turn k — and its action starts after the
    episode's earlier actions and observations."""
    out: list[list[tuple[int, int, int, int]]] = []
    for e, episode in enumerate(turns):
        row, offset = [], 0
        for k, (n_action, n_obs) in enumerate(episode):
            live_before = sum(1 for other in turns[:e] if len(other) > k)
            row.append((turn_seed(job_seed, k), live_before, offset, n_action))
            offset += n_action + n_obs
        out.append(row)
    return out


def play(generate: Generate, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, group_size: int,
         env_id: str, params: EnvParams, max_turns: int, max_observation_tokens: int, tokenizer: Any,
         should_stop: Callable[[], bool] | None = None) -> list[Episode]:
    """Play ``group_size`` episodes per prompt (prompt-major), prompt ``k``'s environments reset from ``seeds[k]``.
    Returns early (episodes unfinished) if ``should_stop()`` becomes true."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} environment seeds")
    episodes: list[Episode] = []
    envs = []
    for prompt, seed in zip(prompts, seeds, strict=True):
        for _ in range(group_size):
            env = make_env(env_id, params)
            env.reset(seed)
            envs.append(env)
            episodes.append(Episode(seed=seed, context=list(prompt)))
    for turn in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live or (should_stop is not None and should_stop()):
            break
        actions = generate([episodes[i].context for i in live], turn)
        for i, sampled in zip(live, actions, strict=True):
            ep = episodes[i]
            step = envs[i].step(decode_action(tokenizer, sampled.token_ids))
            obs = encode_observation(tokenizer, step.observation)
            if len(obs) > max_observation_tokens:
                raise EnvError(f"environment {env_id!r} answered with {len(obs)} observation tokens; the job "
                                        f"allows {max_observation_tokens} (raise task.max_observation_tokens)")
            ep.turns.append((sampled, obs))
            ep.context.extend(list(sampled.token_ids) + obs)
            ep.reward += step.reward
            ep.done = step.done
            ep.solved = envs[i].solved
    return episodes
