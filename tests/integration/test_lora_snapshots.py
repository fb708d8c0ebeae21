"""LoRA training on the learner: a version = base GGUF (identical across versions) + a small adapter GGUF. llama.cpp
loads base + adapter, swaps adapters without reloading the base, and matches the learner's merged weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.learner import Learner
from shared.hashing import sha256_file
from shared.records import build_manifest


def _perturb_adapters(learner: Learner, seed: int) -> None:
    """Stand-in for training: give every adapter a non-zero B (peft initialises B to zero)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _torch_logprobs(folder: Path, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    from shared.policy import completion_logprobs, load_model

    model = load_model(folder).eval()
    with torch.no_grad():
        lp, _ = completion_logprobs(model, [prompt], [completion], temperature=1.0, pad_id=256)
    return lp[0, : len(completion)].tolist()


@pytest.mark.parametrize("precision", ["f32", "f16"])
def test_lora_versions_in_llama_cpp(tmp_path: Path, tiny_model_dir: Path, precision: str) -> None:
    from swarm_client.backends.llama_backend import LlamaBackend

    cfg = LearnerConfig(lora_rank=4, threads=2)
    learner = Learner(tiny_model_dir, ModelConfig(device="cpu"), cfg, temperature=1.0, gguf=precision)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    _perturb_adapters(learner, 1)
    learner.save_model(v1)
    _perturb_adapters(learner, 2)
    learner.save_model(v2)

    # the base is byte-identical across versions, so a client fetches it once; each version adds an adapter
    assert sha256_file(v1 / "base.gguf") == sha256_file(v2 / "base.gguf")
    assert sha256_file(v1 / "adapter.gguf") != sha256_file(v2 / "adapter.gguf")
    forms = {f.path: f.form for f in build_manifest(v1, run_id="r", version=1, created_at=1.0).files}
    assert forms["base.gguf"] == "gguf-base" and forms["adapter.gguf"] == "gguf-lora"
    assert forms["model.safetensors"] == "hf"
    # adapter bytes per version vs a full GGUF snapshot of the same precision (the bar: ≤ 2 %)
    full = os.path.getsize(v1 / "base.gguf")
    assert os.path.getsize(v1 / "adapter.gguf") <= 0.02 * full

    # the client's snapshot cache hard-links blobs: the same base file appears in every version's folder
    c1, c2 = tmp_path / "c1", tmp_path / "c2"
    for c, v in ((c1, v1), (c2, v2)):
        c.mkdir()
        os.link(v1 / "base.gguf", c / "base.gguf")
        os.link(v / "adapter.gguf", c / "adapter.gguf")

    prompt = list(learner.tokenizer.encode("Q: 24+13= A:"))
    completion = list(learner.tokenizer.encode(" 37")) + [256]
    backend = LlamaBackend(device="cpu", threads=2, n_ctx=128)
    tol = 2e-2  # f16 KV cache (and f16 adapter) rounding; see docs/benchmarks.md
    backend.load(c1)
    llm = backend.llm
    got1 = backend.score(prompt, completion)
    want1 = _torch_logprobs(v1, prompt, completion)
    assert max(abs(a - b) for a, b in zip(got1, want1, strict=True)) < tol
    backend.load(c2)
    assert backend.llm is llm  # adapter swapped, base not reloaded
    got2 = backend.score(prompt, completion)
    want2 = _torch_logprobs(v2, prompt, completion)
    assert max(abs(a - b) for a, b in zip(got2, want2, strict=True)) < tol
    assert max(abs(a - b) for a, b in zip(want1, want2, strict=True)) > 10 * tol  # the versions really differ
    backend.load(c1)  # and back: the context was reset, nothing of v2's KV cache leaks into v1
    assert max(abs(a - b) for a, b in zip(backend.score(prompt, completion), want1, strict=True)) < tol
