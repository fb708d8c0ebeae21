"""Sokoban, as in Echo's multi-turn demonstration: push every box onto a target in a small walled room.

A room is generated from the seed by playing backwards from the solved state (boxes on their targets, random
pulls by the player), so every room is solvable. Observation: the room as text rows (``#`` wall, ``@`` player,
``$`` box, ``.`` target, ``*`` box on a target, ``+`` player on a target, space floor) after a one-line summary of
the last action. Actions: ``up``, ``down``, ``left``, ``right`` (the first word, case-insensitive; ``u d l r``
also accepted); anything else is an invalid action. Reward: +1 when the last box reaches its target (the episode
ends), −0.01 per step otherwise.
"""

from __future__ import annotations

import random
from typing import ClassVar

from pydantic import Field

from shared.envs import EnvParams, Step

DIRS = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
SHORT = {"u": "up", "d": "down", "l": "left", "r": "right"}
Cell = tuple[int, int]


class SokobanParams(EnvParams):
    size: int = Field(6, ge=4, le=10, description="Room side, walls included.")
    boxes: int = Field(1, ge=1, le=3, description="Boxes (and targets).")
    pulls: int = Field(12, ge=1, le=200, description="Backward moves played from the solved state.")
    step_penalty: float = Field(0.01, ge=0.0, le=1.0, description="Reward lost per step.")


class Sokoban:
    id: ClassVar[str] = "sokoban"
    Params: ClassVar[type[EnvParams]] = SokobanParams
    actions: ClassVar[tuple[str, ...]] = tuple(DIRS)

    def __init__(self, params: EnvParams) -> None:
        assert isinstance(params, SokobanParams)
        self.p = params
        self.player: Cell = (1, 1)
        self.boxes: set[Cell] = set()
        self.targets: frozenset[Cell] = frozenset()

    def _inside(self, c: Cell) -> bool:
        return 1 <= c[0] < self.p.size - 1 and 1 <= c[1] < self.p.size - 1

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        while True:  # a few rooms end where they began (pulls undone): draw again, still from this seed
            floor = [(x, y) for y in range(1, self.p.size - 1) for x in range(1, self.p.size - 1)]
            picked = rng.sample(floor, self.p.boxes + 1)
            self.targets = frozenset(picked[:-1])
            self.boxes = set(self.targets)
            self.player = picked[-1]
            for _ in range(self.p.pulls):
                name = rng.choice(sorted(DIRS))
                dx, dy = DIRS[name]
                nxt = (self.player[0] + dx, self.player[1] + dy)
                if not self._inside(nxt) or nxt in self.boxes:
                    continue
                behind = (self.player[0] - dx, self.player[1] - dy)
                if behind in self.boxes and rng.random() < 0.7:  # pull the box behind along
                    self.boxes.remove(behind)
                    self.boxes.add(self.player)
                self.player = nxt
            if not self.solved:
                return self._render("new room")

    def _render(self, head: str) -> str:
        rows = []
        for y in range(self.p.size):
            row = []
            for x in range(self.p.size):
                c = (x, y)
                if not self._inside(c):
                    row.append("#")
                elif c == self.player:
                    row.append("+" if c in self.targets else "@")
                elif c in self.boxes:
                    row.append("*" if c in self.targets else "$")
                else:
                    row.append("." if c in self.targets else " ")
            rows.append("".join(row))
        return head + "\n" + "\n".join(rows) + "\n"

    def step(self, action: str) -> Step:
        words = action.strip().lower().split()
        word = words[0].strip(".,!") if words else ""
        name = SHORT.get(word, word)
        if name not in DIRS:
            return Step(self._render("invalid action; say up, down, left or right"), -self.p.step_penalty, False)
        dx, dy = DIRS[name]
        nxt = (self.player[0] + dx, self.player[1] + dy)
        head = f"moved {name}"
        if not self._inside(nxt):
            head = f"{name}: blocked by a wall"
        elif nxt in self.boxes:
            beyond = (nxt[0] + dx, nxt[1] + dy)
            if not self._inside(beyond) or beyond in self.boxes:
                head = f"{name}: the box does not move"
            else:
                self.boxes.remove(nxt)
                self.boxes.add(beyond)
                self.player = nxt
                head = f"pushed the box {name}"
        else:
            self.player = nxt
        if self.solved:
            return Step(self._render(head + "; solved"), 1.0, True)
        return Step(self._render(head), -self.p.step_penalty, False)

    def clone(self) -> Sokoban:
        twin = Sokoban(self.p)
        twin.player, twin.boxes, twin.targets = self.player, set(self.boxes), self.targets
        return twin

    @property
    def solved(self) -> bool:
        return self.boxes == set(self.targets)
