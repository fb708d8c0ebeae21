"""GridWorld: walk to the goal on a small open grid. Small enough that the built-in ~1 M-parameter model learns
it on a CPU in minutes (docs/benchmarks.md).

Observation: the agent's and the goal's column and row as four digits in the arithmetic task's question format,
``"Q: {ax}{ay}{gx}{gy} A: "`` (after the first, on a new line), so the warm-started tiny model answers with a digit
and a 3×3 episode of four turns fits its 64-position context (11 + 4 × 13 byte tokens). Actions are digits:
``1`` up, ``2`` down, ``3`` left, ``4`` right (the digits the warm start already emits most); any other text is
an invalid action and leaves the agent where it is. Reward: the share of the starting
distance by which the step brings the agent closer than it has been yet (so an episode earns the share of the
distance it closed at best, 1 at the goal, where it ends). Never negative: a signed reward (moving away costs)
made standing still — an invalid action, reward 0 — the tiny model's safest choice, and GRPO collapsed onto it.
"""

from __future__ import annotations

import random
from typing import ClassVar

from pydantic import Field, model_validator

from shared.envs import EnvParams, Step

MOVES = {"1": (0, -1), "2": (0, 1), "3": (-1, 0), "4": (1, 0)}


class GridParams(EnvParams):
    width: int = Field(3, ge=2, le=9, description="Columns (coordinates are single digits).")
    height: int = Field(3, ge=1, le=9, description="Rows.")

    @model_validator(mode="after")
    def _room_for_two(self) -> GridParams:
        if self.width * self.height < 2:
            raise ValueError("the grid needs at least two cells (agent and goal)")
        return self


class GridWorld:
    id: ClassVar[str] = "gridworld"
    Params: ClassVar[type[EnvParams]] = GridParams
    actions: ClassVar[tuple[str, ...]] = tuple(MOVES)

    def __init__(self, params: EnvParams) -> None:
        assert isinstance(params, GridParams)
        self.p = params
        self.agent = (0, 0)
        self.goal = (0, 0)
        self.start_distance = 1
        self.best = 1  # the closest the agent has been to the goal

    def _obs(self, first: bool = False) -> str:
        return f"{'' if first else chr(10)}Q: {self.agent[0]}{self.agent[1]}{self.goal[0]}{self.goal[1]} A: "

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        cells = [(x, y) for y in range(self.p.height) for x in range(self.p.width)]
        self.agent, self.goal = rng.sample(cells, 2)
        self.start_distance = self.best = self._distance()
        return self._obs(first=True)

    def _distance(self) -> int:
        return abs(self.agent[0] - self.goal[0]) + abs(self.agent[1] - self.goal[1])

    def step(self, action: str) -> Step:
        move = MOVES.get(action.strip()[:1])
        if move is not None:
            x, y = self.agent[0] + move[0], self.agent[1] + move[1]
            if 0 <= x < self.p.width and 0 <= y < self.p.height:
                self.agent = (x, y)
        now = self._distance()
        progress = max(0, self.best - now)
        self.best = min(self.best, now)
        return Step(self._obs(), progress / self.start_distance, now == 0)

    def clone(self) -> GridWorld:
        twin = GridWorld(self.p)
        twin.agent, twin.goal, twin.start_distance, twin.best = self.agent, self.goal, self.start_distance, self.best
        return twin

    @property
    def solved(self) -> bool:
        return self.agent == self.goal
