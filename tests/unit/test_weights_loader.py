"""The one loader of a snapshot's whole weights into a built model (coordinator.engine.weights, issue 33): only a tied
output layer may be missing, and the evaluator's in-place reload, which used to load whatever names matched and
keep the rest, now refuses a folder of another model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.config import ArithmeticTaskConfig
from coordinator.engine.evaluation import Evaluator
from coordinator.engine.weights import WeightsMismatch, load_full_state
from coordinator.tasks.builtin import ArithmeticTask
from shared.policy import load_model


def _llama(tied: bool, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def _without_output_layer(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights as save_pretrained stores a tied model's: no lm_head.weight."""
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_a_tied_model_loads_without_its_output_layer_and_an_untied_one_is_refused(tmp_path: Path) -> None:
    tied, source = _llama(True, 0), _llama(True, 1)
    load_full_state(tied, _without_output_layer(source), tmp_path)
    assert torch.equal(tied.lm_head.weight, source.model.embed_tokens.weight)  # the output layer is the embedding's

    untied = _llama(False, 0)
    with pytest.raises(WeightsMismatch, match=r"lm_head\.weight.*tie_word_embeddings false") as refused:
        load_full_state(untied, _without_output_layer(_llama(False, 1)), tmp_path)
    assert isinstance(refused.value, ValueError)  # what the loaders raised before, for callers that catch it
    assert str(tmp_path) in str(refused.value) and "model.path" in str(refused.value)  # where, and what to do


def test_a_tied_model_refuses_anything_else_missing_or_unexpected(tmp_path: Path) -> None:
    model = _llama(True, 0)
    state = _without_output_layer(_llama(True, 1))
    norm = state.pop("model.norm.weight")
    with pytest.raises(WeightsMismatch, match=r"missing \['model\.norm\.weight'\], unexpected \[\]"):
        load_full_state(model, state, tmp_path)
    state |= {"model.norm.weight": norm, "model.extra.weight": norm}
    with pytest.raises(WeightsMismatch, match=r"missing \[\], unexpected \['model\.extra\.weight'\]"):
        load_full_state(model, state, tmp_path)


def test_the_evaluators_reload_refuses_another_models_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The evaluator keeps its model and reloads each version into it in place: a folder whose tensors have other
    names (another architecture's) used to leave every weight as it was and score the previous version again."""
    from safetensors.torch import save_file

    model = load_model(tiny_model_dir, "cpu")
    other = tmp_path / "other"
    other.mkdir()
    save_file({k.replace("model.", "backbone.", 1): v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(other / "model.safetensors"))
    task = ArithmeticTask(ArithmeticTaskConfig())
    evaluator = Evaluator(task, task.heldout[:4], 4, keep_model=True)
    try:
        first = evaluator.submit(0, tiny_model_dir).result(timeout=120)
        again = evaluator.submit(1, tiny_model_dir).result(timeout=120)  # the same weights loaded in place
        assert again.accuracy == first.accuracy
        with pytest.raises(WeightsMismatch, match="backbone"):
            evaluator.submit(2, other).result(timeout=120)
    finally:
        evaluator.close()
