"""What this machine is, as reported at registration (informational only: never trusted for security).

Detection is best effort and never fails the client: CPU cores and RAM from the OS, NVIDIA GPUs from
``nvidia-smi`` (if installed; 5 s timeout), Apple silicon from the platform, free disk at the client home.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shared.messages import ClientProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float


@dataclass(frozen=True)
class Hardware:
    cpu_count: int
    memory_gb: float
    gpus: tuple[Gpu, ...]
    apple_silicon: bool
    disk_free_gb: float

    def summary(self) -> str:
        gpu = (", ".join(f"{g.name} ({g.memory_gb:.0f} GiB)" for g in self.gpus) if self.gpus
               else "Apple silicon GPU (unified memory)" if self.apple_silicon else "no GPU")
        return (f"{self.cpu_count} CPU cores, {self.memory_gb:.1f} GiB RAM, {gpu}, "
                f"{self.disk_free_gb:.1f} GiB free disk")


def total_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def free_disk_gb(path: Path) -> float:
    """Free space on the file system holding ``path`` (or its nearest existing parent), in GiB."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free / 2**30
    except OSError:
        return 0.0


def parse_nvidia_smi(text: str) -> tuple[Gpu, ...]:
    """Parse ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`` (memory in MiB)."""
    gpus = []
    for line in text.splitlines():
        name, sep, mem = line.rpartition(",")
        if not sep or not name.strip():
            continue
        try:
            mib = float(mem.strip())
        except ValueError:
            continue
        if math.isfinite(mib) and 0 <= mib < 1e8:
            gpus.append(Gpu(name.strip()[:96], round(mib / 1024, 2)))
    return tuple(gpus)


def nvidia_gpus() -> tuple[Gpu, ...]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("nvidia-smi failed: %s", exc)
        return ()
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else ()


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def detect(home: Path) -> Hardware:
    return Hardware(cpu_count=os.cpu_count() or 0, memory_gb=round(total_memory_gb(), 2), gpus=nvidia_gpus(),
                    apple_silicon=is_apple_silicon(), disk_free_gb=round(free_disk_gb(home), 2))


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}"[:128]
    return device


def profile(backend: str, device: str, name: str = "", hardware: Hardware | None = None,
            benchmark_tokens_per_s: float | None = None, team: str = "") -> ClientProfile:
    from importlib.metadata import PackageNotFoundError, version

    try:
        software = f"echo-swarm {version('echo-swarm')}"
    except PackageNotFoundError:
        software = "echo-swarm (source)"
    gpu = gpu_mem = None
    if hardware is not None and hardware.gpus:
        gpu, gpu_mem = hardware.gpus[0].name, hardware.gpus[0].memory_gb
    elif hardware is not None and hardware.apple_silicon:
        gpu = "Apple silicon"
    bench = None if benchmark_tokens_per_s is None else round(min(max(benchmark_tokens_per_s, 0.0), 1e7), 2)
    return ClientProfile(
        name=name[:64], team=team[:64], backend="llama" if backend == "llama" else "torch", device=describe_device(device),
        platform=f"{platform.system()} {platform.machine()}"[:128], cpu_count=os.cpu_count() or 0,
        memory_gb=round(total_memory_gb(), 2), software=software, gpu=gpu, gpu_memory_gb=gpu_mem,
        disk_free_gb=None if hardware is None else min(hardware.disk_free_gb, 1e9),
        benchmark_tokens_per_s=bench,
    )
