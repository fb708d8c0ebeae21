"""One way to load a snapshot's whole weights into a model that is already built, with one check that they are its.

Why: a model is reloaded in place from a folder (the evaluator's kept model, the verifier's replica, a LoRA run's
base); ``load_state_dict(strict=False)`` then copies whatever names match and silently leaves the rest as they
were, so another model's folder (or a damaged one) would be evaluated or verified as this one. Only a tied output
layer may be absent: save_pretrained (and the learner's snapshots) store it once, as the input embedding. Issue 33
found three such loaders, one of them unchecked; they now share this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.adapters import base_weight_files

if TYPE_CHECKING:
    from torch import Tensor

#: The output layer's weight, absent from a tied model's files (tie_word_embeddings).
TIED_OUTPUT = "lm_head.weight"


class WeightsMismatch(ValueError):
    """A folder's weights are not the model's they are loaded into (a ValueError, as the loaders raised before)."""


def read_weights(folder: Path, device: str) -> dict[str, Tensor]:
    """A folder's whole weights as one state dict (its safetensors files, an adapter's own file excluded)."""
    from safetensors.torch import load_file

    shards = base_weight_files(folder)
    if not shards:
        raise FileNotFoundError(f"no weights in {folder}")
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard), device=device))
    return state


def load_full_state(model: Any, state: Mapping[str, Tensor], folder: Path) -> None:
    """Load ``state`` (the whole weights read from ``folder``) into ``model`` in place. Missing may be only
    ``lm_head.weight`` where the model ties it to the embeddings (``config.tie_word_embeddings``); anything else
    missing, or any tensor the model lacks, raises :class:`WeightsMismatch`. The copy has happened by then (torch
    loads what matches before it reports), so the model must not be used after that error."""
    result = model.load_state_dict(state, strict=False)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = sorted(set(result.missing_keys) - ({TIED_OUTPUT} if tied else set()))
    unexpected = sorted(result.unexpected_keys)
    if not missing and not unexpected:
        return
    hint = ""
    if TIED_OUTPUT in missing:
        hint = (f" ({TIED_OUTPUT} may be absent only where the model ties it to the input embedding, and this "
                f"model's config has tie_word_embeddings false)")
    raise WeightsMismatch(f"the weights in {folder} are not this model's: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}{hint}. The folder holds another model's weights (or a damaged copy): "
                          f"resume the run with the model it was started with (model.path), or give another model "
                          f"a run directory of its own")
