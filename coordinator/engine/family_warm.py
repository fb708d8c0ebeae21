"""Warm-started family models: the random-initialised family models of coordinator.engine.family_models, trained
briefly on the arithmetic task as the tiny model is (coordinator.engine.warm_start), so that a demo on another
family (`echo-swarm demo --model-family NAME`) has rewards to learn from — a random family model's are all 0.

Each is cached like the tiny model's non-default recipes: a folder keyed by the recipe under the cache, built in a
temporary folder and renamed into place, one build at a time (coordinator.engine.tiny_model.build_cached). The
tokenizer files are the ones the learner publishes: the family's tokenizer loaded and saved again by transformers
(shared.policy.load_tokenizer), since that save rewrites them (transformers 5 names the class TokenizersBackend,
which llama.cpp's Phi-3 converter reads; docs/benchmarks.md "Model families"), and the warm start encodes with the
tokenizer loaded from those files, as the held-out evaluation will.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from coordinator.engine.family_models import BY_NAME, build_family_model, unknown_family
from coordinator.engine.tiny_model import build_cached, default_cache_dir
from coordinator.engine.warm_start import warm_start


class UnknownFamily(ValueError):
    """A model family this project builds no model for."""


@dataclass(frozen=True)
class FamilyRecipe:
    """How a family's warm-started model is built; every field is part of its cache key."""

    family: str
    seed: int = 0
    lr: float = 1e-3
    batch_size: int = 64
    max_sft_steps: int = 1500
    check_every: int = 10
    first_check: int = 100
    # above the tiny model's 0.22: held-out lags this train slice on these 2-layer models (Llama 3 stopped at 0.227
    # there and was 0.143 held-out, below the 20-50 % band RL is meant to start in)
    target_accuracy: float = 0.3
    check_size: int = 256
    # the demo's addition task (ArithmeticTaskConfig's defaults): the held-out prompts are never trained on
    max_operand: int = 99
    split_seed: int = 0
    heldout_size: int = 512
    recipe_version: int = 1

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def family_recipe(name: str) -> FamilyRecipe:
    """The recipe of ``name``'s model, refused in one line naming the families there are."""
    if name not in BY_NAME:
        raise UnknownFamily(unknown_family(name))
    return FamilyRecipe(name)


def ensure_family_model(name: str, cache_dir: Path | None = None, progress: Callable[[int, int, float], None] | None
                        = None, recipe: FamilyRecipe | None = None) -> Path:
    """The folder of family ``name``'s warm-started model, built into the cache first if it lacks it (a minute or
    a few on two CPU cores)."""
    recipe = recipe or family_recipe(name)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    final = cache_dir / "models" / f"{recipe.family}-arith-{recipe.key()}"
    return build_cached(final, lambda tmp: _train(tmp, recipe, progress or (lambda *_: None)))


def _train(dest: Path, recipe: FamilyRecipe, progress: Callable[[int, int, float], None]) -> float:
    import torch

    # shared.policy loads transformers: only a build needs it, not a cached model's lookup (or the demo's --help)
    from shared.policy import load_model, load_tokenizer

    t0 = time.monotonic()
    build_family_model(BY_NAME[recipe.family], dest, seed=recipe.seed)
    load_tokenizer(dest).save_pretrained(str(dest))  # as the learner publishes them
    tokenizer = load_tokenizer(dest)
    model = load_model(dest, own_memory=True)
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        acc = warm_start(model, tokenizer, recipe, progress)
    model.save_pretrained(str(dest), safe_serialization=True)
    (dest / "echo_swarm_recipe.json").write_text(json.dumps(
        {"recipe": asdict(recipe), "warm_start_accuracy": acc, "build_s": round(time.monotonic() - t0, 1)}, indent=2))
    return acc
