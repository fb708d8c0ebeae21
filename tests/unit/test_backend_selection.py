"""Pure rules around llama.cpp clients: backend choice, snapshot file forms, per-backend-class tolerances."""

from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig, VerificationConfig, load_config
from shared.records import file_form
from swarm_client.backends import backend_kind, llama_available, resolve_backend
from swarm_client.backends.llama_backend import log_softmax


def test_auto_prefers_llama_where_installed() -> None:
    assert resolve_backend("auto") == ("llama" if llama_available() else "torch")
    assert resolve_backend("torch") == "torch"
    assert resolve_backend("llama") == "llama"
    with pytest.raises(ValueError, match="choose one of: auto, torch, llama"):
        resolve_backend("vllm")


def test_backend_kind_is_what_the_wire_carries() -> None:
    class Fake:
        name = "llama"

    assert backend_kind(Fake()) == "llama"
    assert backend_kind(object()) == "torch"


def test_file_forms() -> None:
    assert file_form("model.gguf") == "gguf"
    assert file_form("base.gguf") == "gguf-base"
    assert file_form("adapter.gguf") == "gguf-lora"
    assert file_form("model.safetensors") == "hf" and file_form("tokenizer.json") == "hf"


def test_llama_results_get_their_precision_class_tolerance() -> None:
    v = VerificationConfig(logprob_mean_tol=0.01, logprob_max_tol=0.2,
                           backend_tolerances={"llama-q8_0": {"mean_tol": 0.07, "max_tol": 1.5}})
    assert v.tolerances("llama", "q8_0") == (0.07, 1.5)
    assert v.tolerances("torch", "q8_0") == (0.01, 0.2)  # torch clients never get the looser class
    assert v.tolerances("llama", "f32") == (0.01, 0.2)  # no entry for the class: the general tolerance
    default = CoordinatorConfig().verification
    for precision in ("f32", "f16", "q8_0"):
        assert f"llama-{precision}" in default.backend_tolerances


def test_config_refuses_unknown_precision_with_the_choices() -> None:
    from coordinator.config import ConfigError

    with pytest.raises(ConfigError, match="snapshots.gguf"):
        load_config(None, {"snapshots.gguf": "q4_k"})
    with pytest.raises(ConfigError, match="lora_rank"):
        load_config(None, {"learner.lora_rank": -1})


def test_llama_classes_get_their_choice_tolerance() -> None:
    v = VerificationConfig(choice_tol=0.03, backend_tolerances={
        "llama-q8_0": {"mean_tol": 0.07, "max_tol": 1.5, "choice_tol": 0.4},
        "llama-f16": {"mean_tol": 0.01, "max_tol": 0.5}})
    assert v.choice_tolerance("llama/cpu", "q8_0") == 0.4
    assert v.choice_tolerance("torch/cpu", "q8_0") == 0.03  # torch clients never get a llama class's tolerance
    assert v.choice_tolerance("llama/cpu", "f16") == 0.03  # no choice_tol in the class: the general one


def test_log_softmax_is_tempered_and_normalised() -> None:
    import numpy as np

    logits = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    lp = log_softmax(logits, 0.5)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    assert np.isclose(lp[0, 2] - lp[0, 1], 2.0)  # (3 − 2) / 0.5
