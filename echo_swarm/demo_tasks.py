"""The built-in task types as `echo-swarm demo --task NAME` runs them: one row each, sized for the tiny model.

Kept apart from echo_swarm.demo (and free of heavy imports) so that the CLI can list the tasks in its help.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEMO_DATA = Path(__file__).with_name("demo_data")


@dataclass(frozen=True)
class DemoTask:
    """One built-in task type as the demo runs it: the run config's [task] table (and [sampling], TOML), a line
    of help, and the learner settings that make the tiny model learn it within the demo's minutes."""

    help: str
    toml: str
    lr: float = 1e-4  # the learner's learning rate for this task
    learner: dict[str, int] = field(default_factory=dict)  # further [learner] keys


# `echo-swarm demo --task NAME`: one row per built-in task type, each sized for the tiny model on a few CPU cores
DEMO_TASKS: dict[str, DemoTask] = {
    "addition": DemoTask("two-number addition, 'Q: a+b= A:' (the tiny model's warm-start task)",
                         '[task]\ntype = "arithmetic"\n'),
    "dataset": DemoTask("the dataset task on a bundled JSONL file (GSM8K-style answers, last_number reward)",
                        f'[task]\ntype = "dataset"\ntrain_path = {json.dumps(str(DEMO_DATA / "sums.jsonl"))}\n'
                        'prompt_column = "question"\nprompt_template = "Q: {prompt}= A:"\nheldout_size = 256\n'),
    # the question's expression in the tiny model's own 'Q: ...= A:' form: it was warm-started on nothing else, and
    # "Calculate 5 + 3." starts it near 0.06 held-out accuracy with no measurable gain in 75 steps (docs/benchmarks.md)
    "reasoning-gym": DemoTask("reasoning-gym's basic_arithmetic (one-digit sums), scored by its own scorer (needs "
                              "the reasoning-gym extra)",
                              '[task]\ntype = "reasoning-gym"\ndataset = "basic_arithmetic"\nsize = 60\n'
                              'heldout_size = 64\nprompt_template = "Q: {metadata[expression]}= A:"\n'
                              "config = { min_terms = 2, max_terms = 2, max_digits = 1, operators = [\"+\"], "
                              "allow_parentheses = false, allow_negation = false }\n", lr=3e-4),
    # multi-turn, verified by replay (coordinator.tasks.episodes): a 3×3 grid, four turns of one digit each; held out:
    # 24 of the 72 starting states (docs/benchmarks.md, "Multi-turn gridworld")
    "gridworld": DemoTask("multi-turn episodes in a 3×3 gridworld, verified by replaying every action "
                          "(coordinator.tasks.episodes)",
                          '[task]\ntype = "environment"\nenv = "gridworld"\nparams = { width = 3, height = 3 }\n'
                          'max_turns = 4\nheldout_size = 24\nmax_observation_tokens = 16\n\n'
                          '[sampling]\nmax_tokens = 1\n',
                          lr=1e-3, learner={"prompts_per_step": 16, "group_size": 8}),
}
