"""Verifier recomputes on fixed batches, run as its own process by tests/integration/
test_fsdp_verifier.py.

``python -m tests.integration.verifier_ranks OUT SPEC.json GROUP``: GROUP 1 is a single-device replica (the
reference, ``verification.placement = "replicas"``); with N > 1 this process is rank 0 of a verifier group and
starts the other ranks itself (coordinator.launch.ranks.start, as the verifier role does), which follow it; ``bf16`` is a
group of 2 with ``verification.mixed_precision = "bf16"``.

SPEC names the version folders (``full``: two full-weight versions; ``lora``: two LoRA versions and their base
folder) and the requests. OUT/results.json gets, per case, the TokenStats of each request (logprobs, entropy,
surprisal variance, top logprob).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig


async def _cases(ver: Any, spec: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for version in versions:  # one cached replica: the second version's load drops the first's shards
        stats = await asyncio.gather(*(ver.recompute_stats(r["prompts"], r["completions"], version)
                                       for r in spec["requests"]))  # queued together: one batch, split over ranks
        lone = await ver.recompute_stats(spec["lone"]["prompts"], spec["lone"]["completions"], version)
        out[str(version)] = [[s.logprobs, s.entropy, s.variance, s.top] for s in [*stats, lone]]
    out["loads"] = ver.stats.loads
    return out


def main(out: Path, spec: dict[str, Any], group: str) -> None:
    from coordinator.engine import fsdp
    from coordinator.launch import ranks as rank_start
    from coordinator.roles.verifier import _verifier

    world = 2 if group == "bf16" else int(group)
    config = CoordinatorConfig(run_dir=out / "run", model={"device": "cpu"},
                               verification={"placement": "fsdp" if world > 1 else "replicas", "world_size": world,
                                             "mixed_precision": "bf16" if group == "bf16" else "off"})
    ranks = rank_start.start(config, "verifier", 0) if world > 1 else None
    results: dict[str, Any] = {}
    try:
        for case, lora_base in (("full", None), ("lora", spec["lora_base"])):
            folders = {int(v): Path(f) for v, f in spec[case].items()}
            fsdp.lead(ranks, "init", spec["pad_id"], spec["stop_ids"], lora_base)
            ver = _verifier(config, folders.get, ranks.device if ranks else "cpu", spec["pad_id"], spec["stop_ids"],
                            lora_base, ranks)
            try:
                results[case] = asyncio.run(_cases(ver, spec, sorted(folders)))
            finally:
                ver.close()
    finally:
        if ranks is not None:
            fsdp.stop(ranks)
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
