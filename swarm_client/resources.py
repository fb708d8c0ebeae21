"""Resource pre-checks: refuse a snapshot this machine cannot hold *before* downloading it.

The size of a policy version is known from its signed manifest (the sum of its file sizes), so the client can
decide up front, instead of being killed for lack of memory half-way through loading (a common failure of
volunteer clients on laptops), or filling the disk. Pure functions: sizes in, a refusal with a message that
says what to do out.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import EchoSwarmError

GIB = 2**30
# Loading a safetensors checkpoint with transformers needs about its size in memory, plus the runtime
# (torch, tokenizer, KV cache for a batch of short completions): budget 20 % and a fixed 0.5 GiB on top.
MEMORY_OVERHEAD_FACTOR = 1.2
MEMORY_OVERHEAD_BYTES = GIB // 2
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


def memory_needed(model_bytes: int) -> int:
    """Estimated resident memory to load and run a model whose files total ``model_bytes``."""
    return int(model_bytes * MEMORY_OVERHEAD_FACTOR) + MEMORY_OVERHEAD_BYTES


def memory_ceiling(limits: Limits) -> int:
    if limits.memory_bytes is not None:
        return limits.memory_bytes
    return int(limits.total_memory_bytes * DEFAULT_MEMORY_FRACTION)


def check_memory(model_bytes: int, limits: Limits, version: int) -> None:
    need, ceiling = memory_needed(model_bytes), memory_ceiling(limits)
    if need > ceiling:
        how = ("raise --max-memory-gb (or max_memory_gb in the config file) if this machine has the memory to "
               "spare" if limits.memory_bytes is not None and limits.memory_bytes < limits.total_memory_bytes
               else "this machine does not have enough memory for this run's model; join a run with a smaller "
                    "model, or use a machine with more RAM")
        raise ResourceRefusal(
            f"model too big for this machine: policy version {version} is {model_bytes / GIB:.2f} GiB and needs "
            f"about {need / GIB:.2f} GiB of memory, but the memory ceiling is {ceiling / GIB:.2f} GiB; {how}.")


def check_gpu_memory(model_bytes: int, gpu_memory_bytes: int, gpu_name: str, version: int) -> None:
    """A model placed wholly on a GPU must fit its memory (same estimate, whole GPU memory as the ceiling)."""
    need = memory_needed(model_bytes)
    if need > gpu_memory_bytes:
        raise ResourceRefusal(
            f"model too big for this machine's GPU: policy version {version} needs about {need / GIB:.2f} GiB of "
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
