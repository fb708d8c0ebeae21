"""`echo-swarm env`: what to paste into a bug report — versions, backends, devices and paths.

Read without importing the heavy libraries (package versions come from their metadata; torch's build from its
version's local part, e.g. ``+cpu`` or ``+cu126``), so it works, and is quick, on a machine whose torch is broken.
"""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from swarm_client.backends import llama_available, torch_available
from swarm_client.config import client_paths, default_config_path
from swarm_client.control import read_status
from swarm_client.hardware import detect
from swarm_client.service import unit_path
from swarm_client.webcontrol import page_info

PACKAGES = ("echo-swarm", "torch", "transformers", "peft", "llama-cpp-python", "gguf", "hivemind", "aiohttp",
            "pydantic", "numpy", "cryptography", "typer", "rich")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def torch_build(torch_version: str | None) -> str:
    """``2.13.0+cpu`` → "CPU", ``2.13.0+cu126`` → "CUDA 12.6", a plain version → "default (PyPI)"."""
    if torch_version is None:
        return "not installed"
    local = torch_version.partition("+")[2]
    if local == "cpu":
        return "CPU"
    if local.startswith("cu") and local[2:].isdigit():
        digits = local[2:]
        return f"CUDA {digits[:-1]}.{digits[-1]}"
    if local.startswith("rocm"):
        return f"ROCm {local[4:]}"
    return "default (PyPI: CUDA on Linux x86_64, Metal on macOS)"


def report(home: Path | None = None, config_path: Path | None = None) -> dict[str, Any]:
    versions = {name: _version(name) for name in PACKAGES}
    paths = client_paths(home, config_path)
    hw = detect(paths.home)
    status = read_status(paths.home) or {}
    unit = unit_path()
    return {
        "python": f"{sys.version.split()[0]} ({sys.executable})",
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "versions": versions,
        "backends": {"llama": llama_available(), "torch": torch_available(),
                     "auto picks": "llama" if llama_available() else "torch" if torch_available() else "none"},
        "torch build": torch_build(versions["torch"]),
        "devices": {"cpu cores": hw.cpu_count, "memory GiB": round(hw.memory_gb, 1),
                    "nvidia gpus": [f"{g.name} ({g.memory_gb:.0f} GiB)" for g in hw.gpus],
                    "apple silicon": hw.apple_silicon},
        "paths": {"config file": str(config_path or default_config_path()), "client home": str(paths.home),
                  "snapshot cache": str(paths.cache), "logs": str(paths.logs), "service unit": str(unit)
                  + (" (installed)" if unit.exists() else " (not installed)")},
        "client": {"state": status.get("state", "never ran"), "client id": status.get("client_id") or None,
                   "control page": (page_info(paths.home) or {}).get("url")},
    }


def render(data: dict[str, Any]) -> str:
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            width = max(len(k) for k in value)
            for k, v in value.items():
                shown = (", ".join(v) or "none") if isinstance(v, list) else "-" if v is None else v
                lines.append(f"  {k:<{width}}  {shown}")
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
