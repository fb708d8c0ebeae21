"""Delta snapshots under real training (issue 23): bytes per version, patch vs full file, and a client's apply time.

In one process, without the HTTP roles (so that the 0.5 B shape fits in ~10 GB): the coordinator's own
:class:`~coordinator.engine.learner.Learner` (f32 AdamW, full fine-tuning) trains GRPO steps on completions it samples
itself at temperature 1, scored by ``bench/rewards.py``'s share of even token ids (a real gradient on random
weights: completions of one prompt differ in it), and each version is published by the coordinator's own
:class:`~coordinator.publish.snapshots.SnapshotStore` in bf16 safetensors plus GGUF (``--gguf``, f16 by default), with
patches against the previous version. For each version the bench then does what a client holding the previous one
does (``shared.deltas.apply_patch`` on the previous file, then the sha256 check of the result against the manifest)
and times it. The full client path over HTTP, refusals and fallbacks included, is exercised by
tests/integration/test_delta_snapshots.py and by ``bench/scale.py``'s delta table (real processes).

    python bench/deltas.py --model tiny --lr 1e-6,1e-5 --steps 8
    nice -n 5 python bench/deltas.py --model qwen0.5b --lr 1e-6,1e-5 --steps 4
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rollouts(learner: Any, prompts: list[list[int]], group: int, max_tokens: int, seed: int) -> tuple[list[Any], float]:
    """Sample ``group`` completions per prompt from the learner's current policy; GRPO samples and the mean reward."""
    import torch

    from bench.rewards import even_share
    from coordinator.core.advantages import group_advantages
    from coordinator.engine.learner import Sample

    torch.manual_seed(seed)
    eos = learner.tokenizer.eos_token_id
    comps: list[list[int]] = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p] * group)
            out = learner.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                         top_k=0, top_p=1.0, max_new_tokens=max_tokens, pad_token_id=eos)
            for row in out[:, len(p):].tolist():
                comps.append(row[: row.index(eos) + 1] if eos in row else row)
    rewards = [even_share([t for t in c if t != eos]) for c in comps]
    advs = [a for s in range(0, len(comps), group) for a in group_advantages(rewards[s:s + group], group)]
    flat_prompts = [p for p in prompts for _ in range(group)]
    old = learner.recompute(flat_prompts, comps)
    return [Sample(p, c, o, o, a) for p, c, o, a in zip(flat_prompts, comps, old, advs, strict=True)], \
        sum(rewards) / len(rewards)


def run(model_dir: Path, lr: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto, wire
    from shared.deltas import apply_patch
    from shared.hashing import sha256_file
    from shared.messages import Manifest, SignedManifest

    learner = Learner(model_dir, ModelConfig(device="cpu"), LearnerConfig(lr=lr, weight_decay=0.0,
                                                                             threads=args.threads), 1.0,
                      gguf=args.gguf)
    store = SnapshotStore(work / f"snapshots-{lr}", crypto.generate_key(), "bench", anchor_every=10_000)
    rng = random.Random(0)
    prompts = [learner.encode(f"Q: {rng.randrange(100)}+{rng.randrange(100)}= A:") for _ in range(args.prompts)]

    def entries(v: int) -> dict[str, Any]:
        signed = store.signed_manifest(v)
        assert signed is not None
        return {f.path: f for f in wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files}

    store.publish(0, learner.snapshot_files("bfloat16"), time.time())
    rows = []
    try:
        for v in range(1, args.steps + 1):
            samples, reward = rollouts(learner, prompts, args.group, args.max_tokens, seed=v)
            t0 = time.monotonic()
            metrics = learner.train_step(samples)
            train_s = time.monotonic() - t0
            t0 = time.monotonic()
            store.publish(v, learner.snapshot_files("bfloat16"), time.time())
            row: dict[str, Any] = {"version": v, "reward": reward, "grad_norm": float(metrics["grad_norm"]),
                                   "train_s": train_s, "publish_s": time.monotonic() - t0}
            now, before = entries(v), entries(v - 1)
            for name in ("model.safetensors", "model.gguf"):
                if name not in now:
                    continue
                full, delta = now[name], now.get(name + ".delta")
                row[name] = {"full": full.size, "delta": delta.size if delta else None}
                if delta is None:
                    continue
                base, patch = store.blob_path(before[name].sha256), store.blob_path(delta.sha256)
                assert base is not None and patch is not None
                out = work / "rebuilt"
                t0 = time.monotonic()
                apply_patch(base, patch, out, base_sha256=before[name].sha256, result_sha256=full.sha256)
                ok = sha256_file(out) == full.sha256
                row[name] |= {"apply_s": time.monotonic() - t0, "rebuilt_hash_ok": ok}
                out.unlink()
            rows.append(row)
            print(json.dumps(row), flush=True)
            store.prune({v - 1, v})
    finally:
        shutil.rmtree(store.root, ignore_errors=True)
        del learner
    return {"lr": lr, "rows": rows}


def summary(results: list[dict[str, Any]], label: str) -> str:
    lines = ["| model, lr | file | full file | patch per version, median (max) | patch ÷ full, median (max) | "
             "rebuilt = published | client apply + sha256 check, median (max) | reward, first → last | grad norm, median |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["rows"]
        for name in ("model.safetensors", "model.gguf"):
            have = [row[name] for row in rows if name in row and row[name]["delta"] is not None]
            if not have:
                continue
            full = statistics.median(h["full"] for h in have)
            deltas = [h["delta"] for h in have]
            apply_s = [h["apply_s"] for h in have]
            ok = sum(h["rebuilt_hash_ok"] for h in have)
            lines.append(
                f"| {label}, {r['lr']:g} | {name} | {full / 1e6:.1f} MB | {statistics.median(deltas) / 1e6:.2f} MB "
                f"({max(deltas) / 1e6:.2f} MB) | {100 * statistics.median(deltas) / full:.2f} % "
                f"({100 * max(deltas) / full:.2f} %) | {ok} of {len(have)} | {statistics.median(apply_s):.2f} s "
                f"({max(apply_s):.2f} s) | {rows[0]['reward']:.3f} → {rows[-1]['reward']:.3f} | "
                f"{statistics.median(row['grad_norm'] for row in rows):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen0.5b"], default="tiny")
    ap.add_argument("--lr", default="1e-6,1e-5", help="learning rates, comma-separated (one run each)")
    ap.add_argument("--steps", type=int, default=8, help="versions per learning rate")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gguf", default="f16", help="snapshots.gguf: off, f32, f16, q8_0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench-out/deltas")
    args = ap.parse_args()
    from bench.scale import build_model

    work = Path(tempfile.mkdtemp(prefix="echo-swarm-deltas-"))
    results = []
    try:
        model = build_model(args.model, work)
        for lr in (float(x) for x in args.lr.split(",")):
            results.append(run(model, lr, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print()
    print(summary(results, args.model))


if __name__ == "__main__":
    main()
