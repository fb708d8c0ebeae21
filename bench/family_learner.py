"""The learner side of a model family (issue 35): one real GRPO step of the coordinator's own Learner on the family
model, the same step on 2 FSDP ranks (gloo, real processes), and the version published after the step rebuilt by a
client from the version before it through the published patches. Used by bench/families.py (``--learner``) and
tests/integration/test_families.py.

Why these settings: the step is on-policy (the batch's π_b logprobs are the model's own, read by plain transformers,
alike in every process), so it is the step an honest torch client's rollouts would give, whatever the random model;
the versions are published as a run at real model size publishes them (``snapshots.dtype = "bfloat16"``, the default
lazy publication, ``model.gguf`` at f16 through the family's GGUF route, patches against the previous version) at
``LR`` 1e-5, the scale of bench/deltas.py's runs: a step then moves a few per cent of the bf16 elements, so each
patch is a small share of its file and is published (at float32 every element moves and no patch would save
anything). The FSDP comparison is in float32 (the published ``model.safetensors`` at ``snapshots.dtype =
"float32"``, gathered from the shards as the publisher gets them), as tests/integration/test_fsdp_learner.py's.

    python bench/family_learner.py OUT MODEL_DIR 2    # rank 0 of a 2-rank FSDP learner: OUT/full-1, OUT/metrics.json
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LR = 1e-5
PUBLISH_DTYPE = "bfloat16"
FULL = "full-1"  # the float32 weights after the step, in OUT (both layouts)


def batch(model_dir: Path) -> list[Any]:
    """Nine on-policy samples (odd, so the two ranks' shares differ): three arithmetic prompts, three completions
    each, advantages of both signs; π_b is the model's own float32 logprob of each token at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from coordinator.engine.learner import Sample
    from shared.policy import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(7)
    out = []
    for _ in range(3):
        a, b = rng.randint(1, 60), rng.randint(1, 30)
        prompt = list(tok.encode(f"{a}+{b}="))
        for j, advantage in enumerate((1.0, -0.5, -0.5)):
            completion = list(tok.encode(f" {a + b + j}", add_special_tokens=False))
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
            old = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(completion)]
            out.append(Sample(prompt, completion, old, old, advantage))
    return out


def _learner(model_dir: Path, world: int, run_dir: Path, gguf: tuple[str, ...]) -> tuple[Any, Any]:
    """The coordinator's Learner on one device (``world`` 1) or as rank 0 of ``world`` FSDP ranks (started here, as
    the learner role starts them); (learner, ranks or None)."""
    from coordinator.config import CoordinatorConfig, LearnerConfig
    from coordinator.engine.learner import Learner
    from coordinator.launch import ranks as rank_start

    cfg = LearnerConfig(lr=LR, world_size=world, threads=1)
    config = CoordinatorConfig(run_dir=run_dir, learner=cfg, model={"device": "cpu"})
    ranks = rank_start.start(config) if cfg.sharded else None
    learner = Learner(model_dir, config.model, cfg, 1.0, gguf=gguf, ranks=ranks)
    # the one-device learner computes the passes the ranks compute: the output layer whole (engine.head streams it
    # a vocabulary slice at a time on one device: the same numbers up to float rounding, test_fsdp_learner.py)
    learner.passes.stream_head = False
    return learner, ranks


def write_float32(learner: Any, folder: Path) -> None:
    """The version's float32 snapshot files, as the publisher writes them (gathered from the shards on ranks)."""
    learner.snapshot_files("float32").write_whole(folder)


def step_and_publish(model_dir: Path, store: Any, out: Path, gguf: tuple[str, ...] = ("f16",)) -> dict[str, Any]:
    """On one device: version 0 published into ``store`` (a SnapshotStore with deltas), one step, version 1
    published, and the float32 weights after the step written to ``out / FULL``. The step's loss, grad norm and
    seconds, and each publication's seconds."""
    out.mkdir(parents=True, exist_ok=True)
    learner, _ = _learner(model_dir, 1, out / "run", gguf)
    t0 = time.perf_counter()
    store.publish(0, learner.snapshot_files(PUBLISH_DTYPE), 1.0)
    published_s = [time.perf_counter() - t0]
    samples = batch(model_dir)
    t0 = time.perf_counter()
    metrics = learner.train_step(samples)
    step_s = time.perf_counter() - t0
    write_float32(learner, out / FULL)
    t0 = time.perf_counter()
    store.publish(1, learner.snapshot_files(PUBLISH_DTYPE), 2.0)
    published_s.append(time.perf_counter() - t0)
    return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),  # type: ignore[arg-type]
            "step_s": step_s, "publish_s": published_s, "samples": len(samples),
            "tokens": sum(len(s.completion_ids) for s in samples)}


def start_ranks(out: Path, model_dir: Path, world: int = 2) -> subprocess.Popen[bytes]:
    """This module as its own process: rank 0 of a ``world``-rank FSDP learner taking the same step (its log:
    ``out``.log)."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("WORLD_SIZE", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "wb")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(out), str(model_dir), str(world)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], out: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Wait for :func:`start_ranks`' process; its metrics. RuntimeError with the log's tail if it failed."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"the FSDP learner exited {rc}: " +
                           (out.parent / f"{out.name}.log").read_text(errors="replace")[-4000:])
    return dict(json.loads((out / "metrics.json").read_text()))


def weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v.float() for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())[:4]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def moved(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, float]:
    """(largest |Δ| of any parameter, share of parameters that changed at all) from ``before`` to ``after``."""
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    return max_diff(before, after), changed / sum(v.numel() for v in before.values())


def rebuilt(store: Any, version: int) -> dict[str, dict[str, Any]]:
    """What a client holding ``version - 1`` does with each patch of ``version``'s manifest: shared.deltas.apply_patch
    on its copy of the previous file (swarm_client.snapshot_patches calls the same), then the sha256 of the result
    against the manifest's. Per patched file: patch and file bytes, and whether the rebuilt file is the published one."""
    import tempfile

    from coordinator.publish.snapshots import MANIFEST_FILE
    from shared import wire
    from shared.deltas import apply_patch
    from shared.messages import Manifest, SignedManifest

    def entries(v: int) -> Any:
        signed = (store.folder(v) / MANIFEST_FILE).read_bytes()
        return wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files

    files = {f.path: f for f in entries(version)}
    old = {f.sha256: f for f in entries(version - 1)}
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="family-rebuild-") as tmp:
        for delta in (f for f in files.values() if f.form == "delta"):
            target = next(f for f in files.values() if f.form != "delta" and f.sha256 == delta.result_sha256)
            base = old[delta.base_sha256]  # type: ignore[index]
            t0 = time.perf_counter()
            digest = apply_patch(store.folder(version - 1) / base.path, store.folder(version) / delta.path,
                                 Path(tmp) / target.path, base_sha256=base.sha256, result_sha256=target.sha256)
            out[target.path] = {"patch_bytes": delta.size, "file_bytes": target.size, "same": digest == target.sha256,
                                "apply_s": time.perf_counter() - t0}
    return out


def main(out: Path, model_dir: Path, world: int) -> None:
    from coordinator.engine import fsdp

    out.mkdir(parents=True, exist_ok=True)
    learner, ranks = _learner(model_dir, world, out / "run", ())
    try:
        samples = batch(model_dir)
        t0 = time.perf_counter()
        metrics = learner.train_step(samples)
        step_s = time.perf_counter() - t0
        write_float32(learner, out / FULL)
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])  # type: ignore[arg-type]
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise ValueError(f"loss {loss}, grad norm {norm}")
        (out / "metrics.json").write_text(json.dumps({"loss": loss, "grad_norm": norm, "step_s": step_s}))
    finally:
        if ranks is not None:
            fsdp.stop(ranks)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
