"""Rules around llama.cpp clients: backend choice (in Pythons that really lack llama.cpp, torch or both), snapshot
file forms, per-backend-class tolerances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig, VerificationConfig, load_config
from coordinator.core.trust import recompute_class
from shared.records import file_form
from swarm_client.backends import backend_kind, resolve_backend
from swarm_client.backends.llama_backend import log_softmax, token_logprobs

# What a process can import decides the backend, so each branch runs in a Python whose import path really lacks
# the packages: this venv's site-packages rebuilt as symlinks minus their folders and metadata, under `python -S`.
SITE = Path(sysconfig.get_paths()["purelib"])
REPO = Path(__file__).resolve().parents[2]
LLAMA = ("llama_cpp", "llama_cpp_python")
TORCH = ("torch", "torchgen", "functorch", "transformers")
PROBE = """
import json, sys
from swarm_client.backends import make_backend, resolve_backend
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = resolve_backend(name)
        out["made " + name] = type(make_backend(name, device="cpu", threads=1)).__name__
    except ValueError as exc:
        out.setdefault(name, "refused")
        out["made " + name] = "refused: " + str(exc)
out["imported"] = sorted(m for m in ("llama_cpp", "torch") if m in sys.modules)
print(json.dumps(out))
"""


def _env_without(tmp_path: Path, *absent: str) -> dict[str, str]:
    """An environment for ``python -S`` that finds the checkout and everything this venv has except the
    distributions ``absent`` (their import folders and metadata are simply not on the path)."""
    site = tmp_path / "site"
    site.mkdir()
    for entry in SITE.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() not in absent:
            (site / entry.name).symlink_to(entry)
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "PYTHONPATH": f"{REPO}{os.pathsep}{site}"}


def _run(env: dict[str, str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-S", "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _probe(tmp_path: Path, absent: tuple[str, ...], *backends: str) -> dict[str, Any]:
    """Which backend each name in ``backends`` resolves to and builds, in a Python without ``absent``."""
    proc = _run(_env_without(tmp_path, *absent), PROBE, *backends)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_probe_python_lacks_exactly_what_it_hides(tmp_path: Path) -> None:
    env = _env_without(tmp_path, *LLAMA)
    missing = _run(env, "import llama_cpp")
    assert missing.returncode != 0 and "No module named 'llama_cpp'" in missing.stderr
    assert _run(env, "import gguf, numpy, swarm_client.backends").returncode == 0  # the rest is there


def test_with_llama_cpp_installed_auto_builds_the_llama_backend(tmp_path: Path) -> None:
    got = _probe(tmp_path, (), "auto", "llama")
    assert got["auto"] == "llama" and got["made auto"] == "LlamaBackend" and got["made llama"] == "LlamaBackend"
    assert got["imported"] == ["llama_cpp"]  # torch is installed here, and not loaded for nothing


def test_without_llama_cpp_auto_builds_the_torch_backend_and_llama_says_what_to_install(tmp_path: Path) -> None:
    got = _probe(tmp_path, LLAMA, "auto", "llama")
    assert got["auto"] == "torch" and got["made auto"] == "TorchBackend"
    assert got["made llama"].startswith("refused: the llama backend needs llama-cpp-python")
    assert "pip install 'echo-swarm[llama]'" in got["made llama"] and "--backend torch" in got["made llama"]
    assert got["imported"] == ["torch"]


def test_without_torch_auto_builds_the_llama_backend_and_torch_says_what_to_install(tmp_path: Path) -> None:
    got = _probe(tmp_path, TORCH, "auto", "torch")
    assert got["auto"] == "llama" and got["made auto"] == "LlamaBackend"
    assert got["made torch"].startswith("refused: the torch backend needs torch and transformers")
    assert "--backend llama" in got["made torch"]
    assert got["imported"] == ["llama_cpp"]  # a llama.cpp client never loads torch


def test_with_neither_backend_installed_auto_is_refused_with_both_installs(tmp_path: Path) -> None:
    got = _probe(tmp_path, LLAMA + TORCH, "auto", "llama", "torch")
    assert got["auto"] == "refused" and "no generation backend is installed" in got["made auto"]
    assert "echo-swarm[llama]" in got["made auto"] and "echo-swarm[torch]" in got["made auto"]
    assert got["made llama"].startswith("refused:") and got["made torch"].startswith("refused:")
    assert got["imported"] == []


def test_an_unknown_backend_is_refused_with_the_choices() -> None:
    assert resolve_backend("torch") == "torch" and resolve_backend("llama") == "llama"
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
    assert v.tolerances(recompute_class("llama/cpu", "q8_0")) == (0.07, 1.5)
    assert v.tolerances(recompute_class("torch/cpu", None)) == (0.01, 0.2)  # torch clients never get the looser class
    assert v.tolerances(recompute_class("llama/cpu", "f32")) == (0.01, 0.2)  # no entry: the general tolerance
    default = CoordinatorConfig().verification
    for precision in ("f32", "f16", "q8_0"):
        assert f"llama-{precision}" in default.backend_tolerances


def test_further_precisions_are_offered_after_the_default_once() -> None:
    from coordinator.config import ConfigError

    assert load_config(None, {"snapshots.gguf_also": ["q4_K_M", "q8_0"]}).snapshots.offered() == ("f16", "q4_K_M",
                                                                                                   "q8_0")
    assert load_config(None, {"snapshots.gguf": "off"}).snapshots.offered() == ()
    with pytest.raises(ConfigError, match="twice"):
        load_config(None, {"snapshots.gguf_also": ["f16"]})
    with pytest.raises(ConfigError, match="'off'"):
        load_config(None, {"snapshots.gguf": "off", "snapshots.gguf_also": ["q4_K_M"]})
    with pytest.raises(ConfigError, match="full-weight runs"):
        load_config(None, {"snapshots.gguf_also": ["q4_K_M"], "learner.lora_rank": 4})


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
    assert v.choice_tolerance(recompute_class("llama/cpu", "q8_0")) == 0.4
    assert v.choice_tolerance(recompute_class("torch/cpu", None)) == 0.03  # never a llama class's tolerance
    assert v.choice_tolerance(recompute_class("llama/cpu", "f16")) == 0.03  # no choice_tol: the general one


def test_recompute_classes_get_their_tolerances_and_engines() -> None:
    """torch-bf16 (the bf16 replay's class) has its own entry by default, 0.1 logit; a class without one, "torch"
    included, gets the torch tolerances; the work queue names the bf16 replay's engine and refuses a name it does
    not know."""
    from coordinator.config import CHOICE_TOL_TORCH_BF16
    from coordinator.store.hops import engine_from_wire

    v = VerificationConfig()
    assert v.choice_tolerance("torch-bf16") == CHOICE_TOL_TORCH_BF16 and v.tolerances("torch-bf16") == (0.05, 1.0)
    assert v.choice_tolerance("torch") == v.choice_tol and v.tolerances("torch") == (0.05, 1.0)
    custom = VerificationConfig(choice_tol=0.03, backend_tolerances={"torch-bf16": {"mean_tol": 0.02, "max_tol": 0.5}})
    assert custom.choice_tolerance("torch-bf16") == 0.03  # no choice_tol in the entry: the general one
    assert custom.tolerances("torch-bf16") == (0.02, 0.5)
    assert [engine_from_wire(e) for e in (None, "torch", "torch-bf16", "llama")] == ["torch", "torch", "torch-bf16",
                                                                                    "llama"]
    with pytest.raises(ValueError, match="unknown recompute engine 'torch-fp8'"):
        engine_from_wire("torch-fp8")


def test_torch_dtype_is_checked_before_anything_loads() -> None:
    from swarm_client.backends import make_backend

    with pytest.raises(ValueError, match="float32 or bfloat16"):
        make_backend("torch", device="cpu", torch_dtype="float16")


def test_log_softmax_is_tempered_and_normalised() -> None:
    import numpy as np

    logits = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    lp = log_softmax(logits, 0.5)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    assert np.isclose(lp[0, 2] - lp[0, 1], 2.0)  # (3 − 2) / 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_agree_with_a_float64_log_softmax(temperature: float) -> None:
    """The client's lean per-step logprobs (float32 exponentials, float64 sums) at a real vocabulary size: within
    1e-5 nats of the float64 log-softmax, far inside any verification tolerance."""
    import numpy as np

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 151_936)) * 4).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, 151_936, 6)]
    tokens[0] = int(logits[0].argmax())  # the likeliest token too, whose logprob is nearest 0
    exact = log_softmax(logits, temperature)[np.arange(6), tokens]
    assert np.abs(np.array(token_logprobs(logits, tokens, temperature)) - exact).max() < 1e-5


def test_a_rows_logprob_is_the_same_bits_whatever_rows_it_is_batched_with() -> None:
    """LlamaBackend.sample flushes its logit rows whenever its cache-sized buffer is full, so a step's logprob is
    computed beside a varying number of others, in a reused scratch: the reported value must not depend on that."""
    import numpy as np

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((13, 151_936)) * rng.uniform(0.5, 8, (13, 1))).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, 151_936, 13)]
    work = np.empty_like(logits)
    for temperature in (1.0, 0.7):
        whole = token_logprobs(logits, tokens, temperature)
        for size in (1, 5, 6):
            pieces: list[float] = []
            for start in range(0, 13, size):
                pieces += token_logprobs(logits[start:start + size], tokens[start:start + size], temperature, work)
            assert pieces == whole, (temperature, size)


def test_every_place_that_names_the_gguf_precisions_names_the_same_ones() -> None:
    """The precisions are spelled where a type needs them spelled (config keys, the wire's Literal, the client's
    flag); one list, checked here, so that a precision added to the exporter is offered, leased and chosen alike."""
    from typing import get_args

    from coordinator.config import GGUF_PRECISIONS, SnapshotConfig
    from coordinator.publish.gguf_export import PRECISIONS
    from shared.messages import Precision
    from swarm_client.precision import QUALITY
    from swarm_client.settings import JoinConfig

    assert tuple(PRECISIONS) == GGUF_PRECISIONS == QUALITY
    assert get_args(SnapshotConfig.model_fields["gguf"].annotation) == ("off", *GGUF_PRECISIONS)
    assert get_args(get_args(SnapshotConfig.model_fields["gguf_also"].annotation)[0]) == GGUF_PRECISIONS
    assert get_args(JoinConfig.model_fields["precision"].annotation) == ("auto", *GGUF_PRECISIONS)
    assert set(get_args(Precision)) == {*GGUF_PRECISIONS, "bf16"}  # and torch's bf16 compute
