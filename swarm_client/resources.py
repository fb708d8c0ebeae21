"""Resource pre-checks: refuse a snapshot this machine cannot hold *before* downloading it.

The size of a policy version is known from its signed manifest (the sum of its file sizes), so the client can
decide up front, instead of being killed for lack of memory half-way through loading (a common failure of
volunteer clients on laptops), or filling the disk. How much memory a model needs on a given backend, for a
given job, is estimated in swarm_client/footprint.py; the runner checks that estimate twice, from the manifest
before downloading and from the verified files and the job's batch before loading. Pure functions: sizes in, a
refusal with a message that says what to do out.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import EchoSwarmError
from swarm_client.footprint import GIB, Need

DEFAULT_MEMORY_FRACTION = 0.8  # default ceiling: this share of the machine's RAM


class ResourceRefusal(EchoSwarmError):
    """This machine (or the limits its owner set) cannot take the work; the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """The volunteer's caps, in bytes. ``memory_bytes`` None: DEFAULT_MEMORY_FRACTION of RAM."""

    memory_bytes: int | None
    total_memory_bytes: int
    min_free_disk_bytes: int
    cache_max_bytes: int | None


def memory_ceiling(limits: Limits) -> int:
    if limits.memory_bytes is not None:
        return limits.memory_bytes
    return int(limits.total_memory_bytes * DEFAULT_MEMORY_FRACTION)


def check_memory(need: Need, model_bytes: int, limits: Limits, version: int) -> None:
    """``need``: the backend's estimated peak (swarm_client.footprint); ``model_bytes``: the version's files."""
    ceiling = memory_ceiling(limits)
    if need.total > ceiling:
        how = ("raise --max-memory-gb (or max_memory_gb in the config file) if this machine has the memory to "
               "spare" if limits.memory_bytes is not None and limits.memory_bytes < limits.total_memory_bytes
               else "this machine does not have enough memory for this run's model; join a run with a smaller "
                    "model, or use a machine with more RAM")
        raise ResourceRefusal(
            f"model too big for this machine: policy version {version} is {model_bytes / GIB:.2f} GiB and needs "
            f"about {need.total / GIB:.2f} GiB of memory ({need.describe()} GiB), but the memory ceiling is "
            f"{ceiling / GIB:.2f} GiB; {how}.")


def check_gpu_memory(need: Need, gpu_memory_bytes: int, gpu_name: str, version: int) -> None:
    """A model placed wholly on a GPU must fit its memory (the same estimate, runtime included, against the
    whole GPU memory: the CUDA context and its workspaces take about what the Python runtime takes in RAM)."""
    if need.total > gpu_memory_bytes:
        raise ResourceRefusal(
            f"model too big for this machine's GPU: policy version {version} needs about {need.total / GIB:.2f} GiB of "
            f"GPU memory, {gpu_name} has {gpu_memory_bytes / GIB:.2f} GiB; run on the CPU instead with "
            f"--gpu-layers 0 (or --device cpu), or join a run with a smaller model.")


def check_disk(missing_bytes: int, free_bytes: int, limits: Limits, version: int) -> None:
    """``missing_bytes``: what must still be downloaded (files not already in the cache)."""
    if limits.cache_max_bytes is not None and missing_bytes > limits.cache_max_bytes:
        raise ResourceRefusal(
            f"policy version {version} needs {missing_bytes / GIB:.2f} GiB of snapshot cache but the cache is "
            f"capped at {limits.cache_max_bytes / GIB:.2f} GiB; raise --cache-max-gb.")
    after = free_bytes - missing_bytes
    if after < limits.min_free_disk_bytes:
        raise ResourceRefusal(
            f"not enough free disk: policy version {version} needs {missing_bytes / GIB:.2f} GiB more, "
            f"{free_bytes / GIB:.2f} GiB are free and at least {limits.min_free_disk_bytes / GIB:.2f} GiB must stay "
            f"free; free some disk space, move the client home (--home) to a larger disk, or lower "
            f"--min-free-disk-gb.")


def disk_full_message(path: object) -> str:
    return (f"disk full while writing {path}: free some disk space, move the client home (--home) to a larger "
            f"disk, or set a smaller --cache-max-gb; then run `echo-swarm join` again (downloads resume).")
