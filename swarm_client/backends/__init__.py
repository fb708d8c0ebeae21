"""Generation backends. Each loads a verified model folder and generates a job's completions with the
job's sampling parameters and seed, returning the per-token logprobs of the sampled tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from shared.messages import Job
from shared.policy import Sampled


class Backend(Protocol):
    name: str
    device: str

    def load(self, folder: Path) -> None: ...

    def generate(self, job: Job, should_stop: Callable[[], bool]) -> list[Sampled]: ...


def make_backend(name: str, *, device: str = "auto", threads: int | None = None,
                 gpu_layers: int | None = None) -> Backend:
    """``gpu_layers``: layers to offload to a GPU (None: the backend's default; 0: GPU off). The torch
    backend cannot split a model, so for it any value but 0 means "all layers on the GPU if there is one"."""
    if name in ("torch", "auto"):
        if gpu_layers == 0:
            device = "cpu"
        from swarm_client.backends.torch_backend import TorchBackend

        return TorchBackend(device=device, threads=threads)
    raise ValueError(f"unknown backend {name!r}; this build supports: torch")
