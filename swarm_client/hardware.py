"""What this machine is, as reported at registration (informational only: never trusted for security)."""

from __future__ import annotations

import os
import platform

from shared.messages import ClientProfile


def total_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}"[:128]
    return device


def profile(backend: str, device: str, name: str = "") -> ClientProfile:
    from importlib.metadata import PackageNotFoundError, version

    try:
        software = f"echo-swarm {version('echo-swarm')}"
    except PackageNotFoundError:
        software = "echo-swarm (source)"
    return ClientProfile(
        name=name[:64], backend="llama" if backend == "llama" else "torch", device=describe_device(device),
        platform=f"{platform.system()} {platform.machine()}"[:128], cpu_count=os.cpu_count() or 0,
        memory_gb=round(total_memory_gb(), 2), software=software,
    )
