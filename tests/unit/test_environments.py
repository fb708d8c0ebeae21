"""The built-in environments (shared.envs) and the coordinator's replay verification of episodes
(coordinator.tasks.episodes): honest episodes replay, every kind of tampering is refused with its own reason code."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from coordinator.config import EnvironmentTaskConfig
from coordinator.errors import TaskError
from coordinator.tasks.episodes import EnvTask
from coordinator.tasks.text import TextCodec
from shared import envs
from shared.envs import (
    EnvError,
    EnvParams,
    Step,
    check_replayable,
    code_hash,
    make_env,
    parse_params,
)
from shared.envs.gridworld import GridWorld
from shared.envs.play import play
from shared.envs.sokoban import Sokoban
from shared.errors import ProtocolError, Reason
from shared.messages import Completion, Turn
from shared.policy import Sampled


# ---- gridworld -------------------------------------------------------------------------------------------
def test_gridworld_is_a_function_of_its_seed_and_actions() -> None:
    a, b = make_env("gridworld", {}), make_env("gridworld", {})
    assert a.reset(5) == b.reset(5)
    for action in ["1", "4", "x", "2"]:
        assert a.step(action) == b.step(action)


def test_gridworld_rewards_sum_to_one_on_the_shortest_path() -> None:
    env = make_env("gridworld", {"width": 3, "height": 3})
    assert isinstance(env, GridWorld)
    env.reset(3)
    total, done, turns = 0.0, False, 0
    while not done:
        (ax, ay), (gx, gy) = env.agent, env.goal
        action = "4" if gx > ax else "3" if gx < ax else "2" if gy > ay else "1"
        step = env.step(action)
        total, done, turns = total + step.reward, step.done, turns + 1
    assert env.solved and total == pytest.approx(1.0) and turns == env.start_distance


def test_gridworld_invalid_action_and_wall_leave_the_agent() -> None:
    env = make_env("gridworld", {"width": 2, "height": 1})
    first = env.reset(0)
    assert first.startswith("Q: ") and first.endswith(" A: ")
    assert isinstance(env, GridWorld)
    where = env.agent
    step = env.step("hello")
    assert env.agent == where and step.reward == 0.0 and not step.done
    env.step("1")  # up, off a one-row grid
    assert env.agent == where


# ---- sokoban ---------------------------------------------------------------------------------------------
def test_sokoban_rooms_are_unsolved_and_pushing_moves_the_box() -> None:
    for seed in range(20):
        env = make_env("sokoban", {"size": 6})
        text = env.reset(seed)
        assert not env.solved and text.count("$") == 1 and ("@" in text or "+" in text)
    env = make_env("sokoban", {"size": 5, "boxes": 1})
    assert isinstance(env, Sokoban)
    env.reset(0)
    env.player, env.boxes, env.targets = (1, 2), {(2, 2)}, frozenset({(3, 2)})
    step = env.step("Right.")
    assert step.done and step.reward == 1.0 and env.solved and "solved" in step.observation
    assert env.step("jump").observation.startswith("invalid action")


def test_sokoban_is_solvable_by_search() -> None:
    """Rooms come from pulls backwards from the solved state: a breadth-first search finds every one's solution."""
    for seed in range(5):
        env = make_env("sokoban", {"size": 5, "pulls": 8})
        env.reset(seed)
        frontier, seen, solved = [env], set(), False
        for _ in range(12):
            nxt = []
            for e in frontier:
                for action in Sokoban.actions:
                    c = e.clone()
                    if c.step(action).done:
                        solved = True
                    key = (c.player, frozenset(c.boxes))
                    if key not in seen:
                        seen.add(key)
                        nxt.append(c)
            frontier = nxt
            if solved:
                break
        assert solved, f"room of seed {seed} not solved within 12 moves"


# ---- interface ---------------------------------------------------------------------------------------------
def test_parameters_are_validated_with_an_actionable_message() -> None:
    with pytest.raises(EnvError, match="widht.*accepted: width, height"):
        parse_params("gridworld", {"widht": 3})
    with pytest.raises(EnvError, match="width"):
        parse_params("gridworld", {"width": 12})
    with pytest.raises(EnvError, match="unknown environment 'chess'; built in: gridworld, sokoban"):
        make_env("chess", {})
    with pytest.raises(ValueError, match="prompt_template must contain"):
        EnvironmentTaskConfig(prompt_template="go")
    with pytest.raises(ValueError, match="refuses its parameters"):
        EnvironmentTaskConfig(env="sokoban", params={"size": 2})


def test_code_hash_covers_the_environment_source() -> None:
    assert code_hash("gridworld") == code_hash("gridworld")
    assert code_hash("gridworld") != code_hash("sokoban")


class _Dice:
    """An environment with hidden randomness (the global random state): it cannot be replayed."""

    id: ClassVar[str] = "dice"
    Params: ClassVar[type[EnvParams]] = EnvParams
    actions: ClassVar[tuple[str, ...]] = ("roll",)

    def __init__(self, params: EnvParams) -> None:
        pass

    def reset(self, seed: int) -> str:
        return "start"

    def step(self, action: str) -> Step:
        return Step(str(random.random()), 0.0, False)

    def clone(self) -> _Dice:
        return self

    @property
    def solved(self) -> bool:
        return False


def test_hidden_randomness_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(envs.REGISTRY, "dice", f"{__name__}:_Dice")
    with pytest.raises(EnvError, match="not replayable"):
        check_replayable("dice", EnvParams(), seeds=[0])
    with pytest.raises(TaskError, match="not replayable"):
        EnvTask(EnvironmentTaskConfig(env="dice"))


# ---- replay ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def codec(tiny_model_dir: Path) -> TextCodec:
    return TextCodec.from_folder(tiny_model_dir)


@pytest.fixture(scope="module")
def task() -> EnvTask:
    return EnvTask(EnvironmentTaskConfig(env="gridworld", max_turns=4, heldout_size=8))


def _episodes(task: EnvTask, codec: TextCodec, n: int = 6, group: int = 2) -> tuple[list[Completion], list[int]]:
    """Honest episodes of a scripted policy (a digit per turn, as the tiny model's sampler would return them)."""
    rng = random.Random(1)

    def generate(contexts: list[list[int]], turn: int) -> list[Sampled]:
        return [Sampled([codec.encode(rng.choice("12345"))[0]], [-1.5], "length") for _ in contexts]

    items = task.train[:n]
    eps = play(generate, [codec.encode(it.prompt) for it in items], [it.seed for it in items], group_size=group,
               env_id="gridworld", params=task.params, max_turns=4, max_observation_tokens=64,
               tokenizer=codec.tokenizer)
    comps = [Completion(token_ids=[], logprobs=[], finish_reason="stop", turns=[
        Turn(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason="length", observation_ids=obs)
        for s, obs in ep.turns]) for ep in eps]
    return comps, [it.seed for it in items for _ in range(group)]


def _replay(task: EnvTask, codec: TextCodec, comps: list[Completion], seeds: list[int]) -> Any:
    return task.replay(comps, seeds, tokenizer=codec.tokenizer, max_tokens=1, stop_ids=frozenset(codec.stop_ids),
                       vocab_size=codec.vocab_size)


def test_honest_episodes_replay_with_the_coordinators_rewards(task: EnvTask, codec: TextCodec) -> None:
    comps, seeds = _episodes(task, codec)
    out = _replay(task, codec, comps, seeds)
    assert len(out.rewards) == len(comps)
    for comp, seq, mask, rep in zip(comps, out.sequences, out.masks, out.reported, strict=True):
        assert comp.turns is not None
        assert len(seq) == len(mask) == sum(len(t.token_ids) + len(t.observation_ids) for t in comp.turns)
        assert sum(mask) == len(comp.turns) == len(rep)
        assert [tok for tok, m in zip(seq, mask, strict=True) if m] == [t.token_ids[0] for t in comp.turns]
    # the rewards are the environment's, recomputed by stepping it
    env = make_env("gridworld", task.params)
    env.reset(seeds[0])
    first = comps[0].turns
    assert first is not None
    expect = sum(env.step(codec.decode(t.token_ids)).reward for t in first)
    assert out.rewards[0] == pytest.approx(expect)


def _turns(comp: Completion) -> list[Turn]:
    assert comp.turns is not None
    return list(comp.turns)


def _refused(task: EnvTask, codec: TextCodec, comps: list[Completion], seeds: list[int]) -> Reason:
    with pytest.raises(ProtocolError) as exc:
        _replay(task, codec, comps, seeds)
    return exc.value.reason


def test_tampered_episodes_are_refused_each_with_its_reason(task: EnvTask, codec: TextCodec) -> None:
    comps, seeds = _episodes(task, codec)
    long_k = next(k for k, c in enumerate(comps) if len(_turns(c)) == 4 and _turns(c)[0].observation_ids)
    turns = _turns(comps[long_k])

    def with_turns(new: list[Turn]) -> list[Completion]:
        out = list(comps)
        out[long_k] = comps[long_k].model_copy(update={"turns": new})
        return out

    # a changed observation
    obs = list(turns[0].observation_ids)
    obs[4] = codec.encode("9")[0]
    changed = turns[0].model_copy(update={"observation_ids": obs})
    assert _refused(task, codec, with_turns([changed, *turns[1:]]), seeds) is Reason.OBSERVATION_MISMATCH
    # an extra turn (past max_turns)
    assert _refused(task, codec, with_turns([*turns, turns[-1]]), seeds) is Reason.EXTRA_TURN
    # a missing turn (the episode had not ended)
    not_done = next(k for k, c in enumerate(comps) if len(_turns(c)) == 4 and not _solved(task, c, seeds[k], codec))
    short = list(comps)
    short[not_done] = comps[not_done].model_copy(update={"turns": _turns(comps[not_done])[:-1]})
    assert _refused(task, codec, short, seeds) is Reason.MISSING_TURN
    # an action the environment never saw: the turn's token changed to another move, the observation kept
    env = make_env("gridworld", task.params)
    env.reset(seeds[long_k])
    before = env.clone()
    seen = codec.decode(turns[0].token_ids)
    moved = next(a for a in "1234" if a != seen and before.clone().step(a) != before.clone().step(seen))
    swapped = turns[0].model_copy(update={"token_ids": codec.encode(moved)})
    assert _refused(task, codec, with_turns([swapped, *turns[1:]]), seeds) is Reason.UNSEEN_ACTION
    # a reward claimed by the client
    claimed = turns[-1].model_copy(update={"reward": 1.0})
    assert _refused(task, codec, with_turns([*turns[:-1], claimed]), seeds) is Reason.REWARD_CLAIMED
    # a completion that is not an episode
    flat = list(comps)
    flat[0] = Completion(token_ids=turns[0].token_ids, logprobs=turns[0].logprobs, finish_reason="length")
    assert _refused(task, codec, flat, seeds) is Reason.SHAPE_MISMATCH


def _solved(task: EnvTask, comp: Completion, seed: int, codec: TextCodec) -> bool:
    env = make_env("gridworld", task.params)
    env.reset(seed)
    return any(env.step(codec.decode(t.token_ids)).done for t in _turns(comp))


def test_the_split_holds_out_starting_states(task: EnvTask) -> None:
    train = {it.prompt for it in task.train}
    held = {it.prompt for it in task.heldout}
    assert not train & held and len(held) == 8 and len(train) + len(held) == 72  # every 3×3 start, once
    spec = task.spec([0, 1])
    assert spec.seeds == [task.train[0].seed, task.train[1].seed] and spec.code_sha256 == code_hash("gridworld")


# ---- both sides run the same version --------------------------------------------------------------------------
def test_a_client_refuses_a_job_whose_environment_code_differs() -> None:
    from swarm_client.episodes import check_environment
    from tests.unit.factories import job

    spec = EnvTask(EnvironmentTaskConfig(env="gridworld", heldout_size=8)).spec([0])
    check_environment(job(environment=spec))  # the same code: accepted
    other = spec.model_copy(update={"code_sha256": "0" * 64})
    with pytest.raises(ProtocolError, match="code version .* the job needs 000000000000") as exc:
        check_environment(job(environment=other))
    assert exc.value.reason is Reason.ENVIRONMENT_MISMATCH
    unknown = spec.model_copy(update={"env_id": "chess"})
    with pytest.raises(ProtocolError, match="cannot run the job's environment 'chess'"):
        check_environment(job(environment=unknown))


def test_the_run_config_refuses_what_cannot_be_replayed(tmp_path: Path) -> None:
    from coordinator.config import ConfigError, load_config

    task = {"task.type": "environment", "run_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="colocated baseline does not play multi-turn episodes"):
        load_config(None, task | {"sync_mode": "colocated"})
    with pytest.raises(ConfigError, match="accepted: size, boxes, pulls, step_penalty"):
        load_config(None, task | {"task.env": "sokoban", "task.params": {"walls": 3}})
    with pytest.raises(ConfigError, match="episodes × 64 turns could need .* Lower jobs.prompts_per_job"):
        load_config(None, task | {"task.max_turns": 64, "sampling.max_tokens": 1024, "jobs.prompts_per_job": 16})
    assert load_config(None, task).task.type == "environment"


def test_gridworld_rewards_only_new_progress() -> None:
    env = make_env("gridworld", {"width": 3, "height": 1})
    assert isinstance(env, GridWorld)
    env.reset(0)
    env.agent, env.goal, env.start_distance, env.best = (1, 0), (2, 0), 1, 1
    assert env.step("3").reward == 0.0  # away: no reward, and no penalty (standing still must not be safer)
    assert env.step("4").reward == 0.0  # back to where it was: no new progress
    step = env.step("4")
    assert step.reward == 1.0 and step.done
