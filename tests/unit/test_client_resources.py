"""Memory and disk pre-checks refuse with a message that says what to do; hardware parsing."""

from __future__ import annotations

import pytest

from swarm_client.footprint import Need
from swarm_client.hardware import parse_nvidia_smi
from swarm_client.resources import (
    GIB,
    Limits,
    ResourceRefusal,
    check_disk,
    check_gpu_memory,
    check_memory,
)


def limits(**kw: object) -> Limits:
    base: dict[str, object] = dict(memory_bytes=None, total_memory_bytes=16 * GIB, min_free_disk_bytes=GIB,
                                   cache_max_bytes=None)
    return Limits(**(base | kw))  # type: ignore[arg-type]


def need(total: float) -> Need:
    return Need({"weights": int(total * GIB) - GIB // 2, "runtime": GIB // 2})


def test_model_fitting_the_default_ceiling_passes() -> None:
    check_memory(need(12.8), 8 * GIB, limits(), version=3)  # exactly 80 % of 16 GiB


def test_model_too_big_for_the_machine() -> None:
    with pytest.raises(ResourceRefusal, match="model too big for this machine") as err:
        check_memory(need(12.9), 8 * GIB, limits(), version=3)
    text = str(err.value)
    assert "version 3 is 8.00 GiB" in text and "needs about 12.90 GiB" in text and "smaller model" in text
    assert "(weights 12.40, runtime 0.50 GiB)" in text  # what the estimate is made of


def test_model_over_the_volunteers_own_ceiling_names_the_flag() -> None:
    with pytest.raises(ResourceRefusal, match="--max-memory-gb"):
        check_memory(need(2.5), GIB, limits(memory_bytes=2 * GIB), version=0)
    check_memory(need(2), GIB, limits(memory_bytes=2 * GIB), version=0)


def test_disk_check_keeps_the_reserve_free() -> None:
    check_disk(2 * GIB, free_bytes=3 * GIB, limits=limits(), version=1)  # exactly 1 GiB left
    with pytest.raises(ResourceRefusal, match="not enough free disk.*--home.*--min-free-disk-gb"):
        check_disk(2 * GIB + 1, free_bytes=3 * GIB, limits=limits(), version=1)


def test_disk_check_refuses_a_model_larger_than_the_cache_cap() -> None:
    with pytest.raises(ResourceRefusal, match="--cache-max-gb"):
        check_disk(3 * GIB, free_bytes=100 * GIB, limits=limits(cache_max_bytes=2 * GIB), version=1)


def test_nvidia_smi_parsing() -> None:
    gpus = parse_nvidia_smi("NVIDIA GeForce RTX 3060, 12288\nNVIDIA H200, 143771\ngarbage\n, 5\nX, nan-ish\nY, nan\nZ, inf\n")
    assert [(g.name, g.memory_gb) for g in gpus] == [("NVIDIA GeForce RTX 3060", 12.0), ("NVIDIA H200", 140.4)]
    assert parse_nvidia_smi("") == ()


def test_gpu_memory_check_suggests_the_cpu() -> None:
    check_gpu_memory(need(12.5), 24 * GIB, "NVIDIA RTX 4090", version=2)
    with pytest.raises(ResourceRefusal, match="GPU memory.*RTX 3060 has 12.00 GiB.*--gpu-layers 0"):
        check_gpu_memory(need(12.5), 12 * GIB, "NVIDIA GeForce RTX 3060", version=2)
