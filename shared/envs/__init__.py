"""Multi-turn environments that both sides run: the client plays episodes in them, the coordinator replays the
client's actions in its own copy from the job's seed and refuses a trajectory the environment would not have
produced (coordinator.tasks.episodes).

Why in ``shared``: replay verification is only sound if the client and the coordinator step the *same* code.
A job names its environment by id, parameters and :func:`code_hash` (the sha256 of the environment's source
file and of this interface module); a client whose copy hashes differently refuses the job and says which
version it runs (swarm_client.episodes). An environment must be a pure function of its seed and the actions it
is given: :func:`check_replayable` refuses, at coordinator start-up, one whose transcript the seed does not fix.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError


class EnvError(ValueError):
    """An unknown environment, parameters it refuses, or one that cannot be replayed; the message says what to do."""

#: Built-in environments: id → "module:class" (imported only when used).
REGISTRY: dict[str, str] = {
    "gridworld": "shared.envs.gridworld:GridWorld",
    "sokoban": "shared.envs.sokoban:Sokoban",
}


@dataclass(frozen=True)
class Step:
    """What the environment answers to one action."""

    observation: str  # appended (tokenised) to the model's context before its next action
    reward: float  # this step's reward; the episode's reward is the sum, computed by the coordinator
    done: bool  # the episode is over: no further turn is allowed


class EnvParams(BaseModel):
    """Base of each environment's parameters: strict, extra keys refused (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Environment(Protocol):
    """reset(seed) → first observation; step(action text) → Step. ``actions`` are the canonical action texts the
    environment understands (any other text is an invalid action, answered without changing the state); replay
    uses them to tell a changed action from a changed observation. ``solved`` says whether the episode reached its
    goal (held-out evaluation counts solved episodes)."""

    id: ClassVar[str]
    Params: ClassVar[type[EnvParams]]
    actions: ClassVar[tuple[str, ...]]

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> Step: ...

    def clone(self) -> Environment: ...

    @property
    def solved(self) -> bool: ...


def env_class(env_id: str) -> Any:
    if env_id not in REGISTRY:
        raise EnvError(f"unknown environment {env_id!r}; built in: {', '.join(sorted(REGISTRY))}")
    module, name = REGISTRY[env_id].split(":")
    return getattr(importlib.import_module(module), name)


def parse_params(env_id: str, params: dict[str, Any]) -> EnvParams:
    """The environment's validated parameters; a bad key or value names the field and its bounds."""
    cls = env_class(env_id)
    try:
        return cls.Params.model_validate(params)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(p) for p in e['loc']) or '(all)'}: {e['msg']}" for e in exc.errors()]
        raise EnvError(f"environment {env_id!r} refuses its parameters: {'; '.join(parts)} "
                                f"(accepted: {', '.join(cls.Params.model_fields)})") from None


def make_env(env_id: str, params: dict[str, Any] | EnvParams) -> Environment:
    cls = env_class(env_id)
    p = params if isinstance(params, EnvParams) else parse_params(env_id, params)
    env: Environment = cls(p)
    return env


def params_json(params: EnvParams) -> str:
    """Canonical JSON of the parameters: what the job carries and the code hash covers."""
    return json.dumps(params.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def code_hash(env_id: str) -> str:
    """sha256 over the environment's source file and this interface module: two installs agree iff they would
    step identically (parameters travel separately, in the job)."""
    cls = env_class(env_id)
    h = hashlib.sha256(env_id.encode() + b"\0")
    for path in (Path(__file__), Path(importlib.import_module(cls.__module__).__file__ or "")):
        h.update(path.read_bytes().replace(b"\r\n", b"\n"))
        h.update(b"\0")
    return h.hexdigest()


# ---- the tokens an observation adds to the context: one rule for both sides ---------------------------------
def encode_observation(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an observation (a ``tokenizers.Tokenizer``; no special tokens added): what the client appends
    to the model's context and the coordinator expects to find in the result."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def decode_action(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The action text the environment is stepped with: the model's tokens, special tokens dropped."""
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizer(folder: Path) -> Any:
    """The snapshot's ``tokenizers`` tokenizer (the same file the coordinator's codec reads)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no tokenizer.json; multi-turn jobs need the snapshot's fast tokenizer")
    return Tokenizer.from_file(str(path))


# ---- determinism probe --------------------------------------------------------------------------------------
def check_replayable(env_id: str, params: EnvParams, seeds: Sequence[int], turns: int = 8) -> None:
    """Refuse an environment whose transcript its seed does not fix (hidden randomness: wall clock, global
    random state, iteration over unordered sets, ...): two fresh copies are reset with each seed and stepped with
    the same actions (cycled through ``actions``, plus an invalid one), and must answer identically."""
    cls = env_class(env_id)
    script = [*cls.actions, "?", *reversed(cls.actions)][:turns]
    for seed in seeds:
        transcripts = []
        for _ in range(2):
            env = make_env(env_id, params)
            out: list[Any] = [env.reset(seed)]
            for action in script:
                st = env.step(action)
                out.append((st.observation, st.reward, st.done))
                if st.done:
                    break
            transcripts.append(out)
        if transcripts[0] != transcripts[1]:
            raise EnvError(f"environment {env_id!r} is not replayable: two copies reset with seed {seed} "
                                    f"answered the same actions differently, so the coordinator could not verify its "
                                    f"episodes. Derive every random choice from the reset seed")
