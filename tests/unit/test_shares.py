"""The machine's generation slot among several runs (swarm_client/shares.py): turns by debt, and only the run on the
machine holding its model in memory — real torch backends on the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarm_client.backends.torch_backend import TorchBackend
from swarm_client.shares import Shares


def test_the_run_furthest_behind_its_share_goes_first() -> None:
    async def main() -> list[str]:
        shares = Shares({"a": 3.0, "b": 1.0}, grace_s=0.0)
        order: list[str] = []

        async def one(name: str, hold: asyncio.Event | None = None) -> None:
            async with shares.turn(name) as turn:
                order.append(name)
                turn.tokens = 100
                if hold is not None:
                    await hold.wait()

        for _ in range(3):  # a alone (b has no job): 300 tokens to a, 0 to b
            await one("a")
        busy = asyncio.Event()
        first = asyncio.create_task(one("a", busy))  # a on the machine while both queue behind it
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(one("a")), asyncio.create_task(one("b"))]
        await asyncio.sleep(0)
        busy.set()
        await asyncio.gather(first, *waiting)
        return order

    # after 400 tokens, a's debt is 3/4 · 400 − 400 = −100 and b's 1/4 · 400 − 0 = +100: b goes before a
    assert asyncio.run(main()) == ["a", "a", "a", "a", "b", "a"]


def test_a_run_turn_frees_the_other_runs_model_and_loads_its_own(tiny_model_dir: Path) -> None:
    """Two runs of one model would keep two copies in memory for one generation at a time: the run whose turn begins
    unloads the other's, and a run's own model stays loaded across its consecutive turns."""
    backends = {"a": TorchBackend(device="cpu", threads=1), "b": TorchBackend(device="cpu", threads=1)}

    async def main() -> list[tuple[str, bool, bool]]:
        shares = Shares({"a": 1.0, "b": 1.0}, grace_s=0.0)
        for name, backend in backends.items():
            shares.holds_model(name, backend.unload)
        seen = []
        for name in ("a", "a", "b", "a"):
            async with shares.turn(name) as turn:
                backend = backends[name]
                reused = backend.model is not None
                await asyncio.to_thread(backend.load, tiny_model_dir)
                turn.tokens = 10
                other = backends["b" if name == "a" else "a"]
                seen.append((name, reused, other.model is None))
        return seen

    assert asyncio.run(main()) == [("a", False, True), ("a", True, True), ("b", False, True), ("a", False, True)]
    assert backends["a"].model is not None and backends["b"].model is None


def test_keep_models_leaves_every_runs_model_loaded_between_its_turns(tiny_model_dir: Path) -> None:
    """`join --keep-models`: no run's model is unloaded when another's turn begins, so each loads once."""
    backends = {"a": TorchBackend(device="cpu", threads=1), "b": TorchBackend(device="cpu", threads=1)}
    loads = {"a": 0, "b": 0}

    async def main() -> None:
        shares = Shares({"a": 1.0, "b": 1.0}, grace_s=0.0, keep_models=True)
        for name, backend in backends.items():
            shares.holds_model(name, backend.unload)
        for name in ("a", "b", "a", "b"):
            async with shares.turn(name) as turn:
                if backends[name].model is None:
                    loads[name] += 1
                    await asyncio.to_thread(backends[name].load, tiny_model_dir)
                turn.tokens = 10

    asyncio.run(main())
    assert loads == {"a": 1, "b": 1}
    assert all(b.model is not None for b in backends.values())


def test_an_unloaded_backend_loads_the_same_folder_again(tiny_model_dir: Path) -> None:
    backend = TorchBackend(device="cpu", threads=1)
    backend.load(tiny_model_dir)
    backend.unload()
    assert backend.model is None
    with pytest.raises(RuntimeError, match="no model loaded"):
        backend.generate(None, lambda: False)  # type: ignore[arg-type]
    backend.load(tiny_model_dir)  # not skipped as "already loaded"
    assert backend.model is not None


def test_work_is_counted_in_flops_so_a_bigger_model_gets_fewer_tokens_for_the_same_share() -> None:
    """Two runs with equal shares, one of a model four times the other's size: the machine's work (FLOPs: 2 × the
    parameters per token) comes out equal, so the bigger model's run gets a quarter of the tokens."""
    params = {"small": 1_000_000, "big": 4_000_000}

    async def main() -> dict[str, int]:
        shares = Shares({"small": 1.0, "big": 1.0}, grace_s=0.0)
        tokens = dict.fromkeys(params, 0)
        turns = 0

        async def run(name: str) -> None:
            nonlocal turns
            while turns < 50:
                async with shares.turn(name) as turn:
                    turns += 1
                    turn.tokens, turn.per_token = 100, 2.0 * params[name]
                    tokens[name] += 100
                    await asyncio.sleep(0)

        await asyncio.gather(run("small"), run("big"))
        return tokens

    tokens = asyncio.run(main())
    assert tokens["small"] / tokens["big"] == pytest.approx(4.0, rel=0.15), tokens
