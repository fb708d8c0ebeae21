"""A result's rollouts as the intake checks them: the two strategies of one sequence of checks.

The intake (coordinator.api.intake) runs the same checks on every result — the recompute, the logprob, choice and
sampling checks, the lease, the acceptance — and asks the result's rollouts three things that differ between a
one-turn result and a multi-turn episode:

- which sequences to recompute, with which keyed draws (:attr:`Rollout.segments`: the job's seed, or each episode
  turn's, shared.envs.play) and how the recompute groups them (a group's rollouts share the prompt's cache; an
  episode's every turn starts afresh);
- which of the recomputed tokens are the model's (:meth:`Rollout.checked`): all of a plain completion's, an
  episode's actions but never its observations;
- what the learner trains on (:meth:`Rollout.outcome`): the task's rewards of the decoded completions, or the
  rewards of the episodes' replay with the recompute as π_b at the observations.

An episode is replayed here, when its rollout is made, before any forward pass is spent on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.core.verify import TokenStats
from coordinator.store.job_rows import JobRow
from coordinator.tasks.base import Task
from coordinator.tasks.episodes import REWARD_NAME as EPISODE_REWARD
from coordinator.tasks.episodes import EnvTask, Replayed, episode_behaviour, select
from coordinator.tasks.text import PromptTokens, TextCodec
from shared.envs.play import episode_segments
from shared.messages import ResultSubmission
from shared.sampler import Segment, plain_segments


@dataclass(frozen=True)
class Outcome:
    """What an accepted result gives the learner (coordinator.run.records.AcceptedResult) and the credit counts."""

    completions: list[list[int]]
    behaviour: list[list[float]]
    recomputed: list[list[float]]
    loss_mask: list[list[int]] | None
    rewards: list[float]
    reward_means: dict[str, float]
    n_tokens: int


class Rollout(Protocol):
    """One result's sequences, as its strategy presents them to the intake's checks."""

    @property
    def prompts(self) -> list[list[int]]: ...

    @property
    def completions(self) -> list[list[int]]:
        """What is recomputed: a plain completion, or an episode's actions and observations."""
        ...

    @property
    def reported(self) -> list[list[float]]:
        """The client's logprobs of the model's tokens."""
        ...

    @property
    def segments(self) -> list[list[Segment]]:
        """Every sampled token's keyed draw."""
        ...

    @property
    def group(self) -> int:
        """Rollouts recomputed together (llama.cpp shares a group's prompt cache)."""
        ...

    def checked(self, stats: TokenStats) -> TokenStats:
        """The recompute's figures of the model's tokens only, in the order of ``reported``."""
        ...

    def outcome(self, stats: TokenStats) -> Outcome:
        """Rewards and what the learner trains on, from the whole recompute; raises RewardFailed (a refusal)."""
        ...


@dataclass(frozen=True)
class PlainRollout:
    """One-turn completions: every token is the model's; rewards from the task's reward functions."""

    prompts: list[list[int]]
    completions: list[list[int]]
    reported: list[list[float]]
    segments: list[list[Segment]]
    group: int
    task: Task
    codec: TextCodec
    prompt_ids: Sequence[int]  # one per completion

    def checked(self, stats: TokenStats) -> TokenStats:
        return stats

    def outcome(self, stats: TokenStats) -> Outcome:
        items = [self.task.train[i] for i in self.prompt_ids]
        scored = self.task.score(items, [self.codec.decode(c) for c in self.completions])  # RewardFailed: a refusal
        return Outcome(completions=self.completions, behaviour=self.reported, recomputed=stats.logprobs,
                       loss_mask=None, rewards=scored.rewards, reward_means=scored.per_reward_means,
                       n_tokens=sum(len(c) for c in self.completions))


@dataclass(frozen=True)
class EpisodeRollout:
    """Multi-turn episodes, replayed against their environments: the model's tokens are the actions; the
    observations are the environment's, never trained on and never checked."""

    prompts: list[list[int]]
    replayed: Replayed
    segments: list[list[Segment]]
    group: int = 1  # every turn's evaluation starts afresh

    @property
    def completions(self) -> list[list[int]]:
        return self.replayed.sequences

    @property
    def reported(self) -> list[list[float]]:
        return self.replayed.reported

    def checked(self, stats: TokenStats) -> TokenStats:
        m = self.replayed.masks
        return TokenStats(select(stats.logprobs, m), select(stats.entropy, m), select(stats.variance, m),
                          select(stats.top, m), None if stats.margins is None else select(stats.margins, m))

    def outcome(self, stats: TokenStats) -> Outcome:
        rewards = self.replayed.rewards
        return Outcome(completions=self.replayed.sequences, behaviour=episode_behaviour(self.replayed, stats.logprobs),
                       recomputed=[list(r) for r in stats.logprobs], loss_mask=self.replayed.masks, rewards=rewards,
                       reward_means={EPISODE_REWARD: sum(rewards) / len(rewards)},
                       n_tokens=sum(len(r) for r in self.replayed.reported))


def rollout_of(sub: ResultSubmission, row: JobRow, task: Task, prompt_tokens: PromptTokens, max_tokens: int
               ) -> Rollout:
    """The result's rollouts under the strategy its task calls for (an episode task's results are replayed now)."""
    per_completion = [i for i in row.prompt_ids for _ in range(row.group_size)]
    codec = prompt_tokens.codec
    prompts = [prompt_tokens(i) for i in per_completion]
    if isinstance(task, EnvTask):
        replayed = task.replay(sub.completions, [task.train[i].seed for i in per_completion],
                               tokenizer=codec.tokenizer, max_tokens=max_tokens, stop_ids=frozenset(codec.stop_ids),
                               vocab_size=codec.vocab_size)
        segments = episode_segments(row.seed, [[(len(t.token_ids), len(t.observation_ids)) for t in c.turns or []]
                                               for c in sub.completions])
        return EpisodeRollout(prompts, replayed, segments)
    completions = [list(c.token_ids) for c in sub.completions]
    return PlainRollout(prompts, completions, [list(c.logprobs) for c in sub.completions],
                        plain_segments(row.seed, [len(c) for c in completions]), row.group_size, task, codec,
                        per_completion)
