"""The default tiny model ships with the package (coordinator/engine/tiny_weights): every machine's cache gets the
same pinned bytes, so the demo starts from the same policy everywhere; damaged weights are refused, not used; other
recipes are still trained."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from coordinator.engine import tiny_model
from coordinator.engine.tiny_model import SHIPPED_SHA256, ShippedModelDamaged, TinyRecipe, ensure_tiny_model


def _no_training(*_: object) -> float:
    raise AssertionError("the default recipe was trained instead of copied")


def test_the_default_recipe_is_the_shipped_bytes_not_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_model, "_train", _no_training)
    folder = ensure_tiny_model(tmp_path)
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == SHIPPED_SHA256
    recipe = json.loads((folder / "echo_swarm_recipe.json").read_text())
    assert recipe["shipped"] is True and recipe["recipe"]["recipe_version"] == TinyRecipe().recipe_version
    assert ensure_tiny_model(tmp_path) == folder  # cached: the same folder, nothing copied again
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (TinyRecipe().hidden_size, TinyRecipe().num_layers)


def test_damaged_shipped_weights_are_refused_and_nothing_is_cached(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = tmp_path / "shipped"
    shutil.copytree(tiny_model.SHIPPED, damaged)
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    (damaged / "model.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(tiny_model, "SHIPPED", damaged)
    monkeypatch.setattr(tiny_model, "_train", _no_training)
    cache = tmp_path / "cache"
    with pytest.raises(ShippedModelDamaged, match="damaged .* reinstall echo-swarm"):
        ensure_tiny_model(cache)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_another_recipe_is_trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[TinyRecipe] = []

    def fake_train(dest: Path, recipe: TinyRecipe, progress: object) -> float:
        trained.append(recipe)
        (dest / "model.safetensors").write_bytes(b"weights")
        (dest / "echo_swarm_recipe.json").write_text("{}")
        return 0.0

    monkeypatch.setattr(tiny_model, "_train", fake_train)
    wide = TinyRecipe(hidden_size=256, intermediate_size=1024)
    folder = ensure_tiny_model(tmp_path, wide)
    assert trained == [wide] and folder.name.endswith(wide.key())
