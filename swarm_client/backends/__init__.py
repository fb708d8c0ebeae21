"""Generation backends. Each loads a verified model folder and generates a job's completions with the
job's sampling parameters and seed, returning the per-token logprobs of the sampled tokens.

``forms`` names the snapshot files a backend needs (see shared.records.file_form): the snapshot cache fetches
only those, so a llama.cpp client never downloads safetensors and a torch client never downloads GGUF.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from shared.messages import Job
from shared.policy import Sampled
from swarm_client.backends.llama_backend import LlamaBackend
from swarm_client.backends.torch_backend import TorchBackend

BACKENDS = ("auto", "torch", "llama")


class Backend(Protocol):
    name: str
    device: str

    def load(self, folder: Path) -> None: ...

    def parameters(self) -> int | None:
        """The loaded model's parameter count (None: none loaded): a generated token costs twice this in FLOPs."""
        ...

    def unload(self) -> None:
        """Release the model's memory; the next :meth:`load` reads it again (another run takes the machine)."""
        ...

    def generate(self, job: Job, should_stop: Callable[[], bool]) -> list[Sampled]: ...


def llama_available() -> bool:
    """True when llama-cpp-python is installed (it is imported only when the backend is made)."""
    return importlib.util.find_spec("llama_cpp") is not None


def torch_available() -> bool:
    """True when torch and transformers are installed (the `torch` extra), without importing them."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def resolve_backend(name: str) -> str:
    """'auto' → 'llama' where llama-cpp-python is installed, else 'torch'."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if name == "auto":
        if not llama_available() and not torch_available():
            raise ValueError("no generation backend is installed: pip install 'echo-swarm[llama]' (llama.cpp) or "
                             "'echo-swarm[torch]', or run installer/install.sh")
        return "llama" if llama_available() else "torch"
    return name


def make_backend(name: str, *, device: str = "auto", threads: int | None = None,
                 gpu_layers: int | None = None, torch_dtype: str = "float32") -> Backend:
    """``gpu_layers``: layers to offload to a GPU (None: the backend's default, all layers where a GPU is
    found; 0: GPU off). The torch backend cannot split a model, so for it any value but 0 means "all layers
    on the GPU if there is one". ``torch_dtype``: what the torch backend computes in (float32 or bfloat16)."""
    chosen = resolve_backend(name)
    if chosen == "llama":
        if not llama_available():
            raise ValueError("the llama backend needs llama-cpp-python: pip install 'echo-swarm[llama]' "
                             "(see README, 'llama.cpp clients'), or join with --backend torch")

        return LlamaBackend(device=device, threads=threads, n_gpu_layers=gpu_layers)
    if not torch_available():
        raise ValueError("the torch backend needs torch and transformers: pip install 'echo-swarm[torch]' (see "
                         "installer/README.md), or join with --backend llama")
    if gpu_layers == 0:
        device = "cpu"

    return TorchBackend(device=device, threads=threads, dtype=torch_dtype)


def backend_forms(backend: object) -> frozenset[str] | None:
    """The snapshot file forms a backend needs (None: every file)."""
    forms = getattr(backend, "forms", None)
    return frozenset(forms) if forms is not None else None


def backend_kind(backend: object) -> Literal["torch", "llama"]:
    """'llama' or 'torch': what the lease and result messages carry."""
    return "llama" if getattr(backend, "name", "torch") == "llama" else "torch"
