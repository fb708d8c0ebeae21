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

Lazy publication (``snapshots.lag_tolerance``, coordinator/publish/lazy.py): every version is published by one store
per tolerance in ``--lag-tolerance``, from the same trained weights, side by side. With ``--gap`` each published
version is loaded into a float32 replica and its policy compared with the learner's own on the next step's
samples (mean |Δ logprob| per token, the k3 KL estimate), next to how far that step moved the learner's policy.

    python bench/deltas.py --model tiny --lr 1e-6,1e-5 --steps 8 --lag-tolerance 0,0.25,0.5,1 --gap
    flock /tmp/echo-heavy.lock nice -n 5 python bench/deltas.py --model qwen0.5b --lr 1e-6,1e-5 --steps 2 --gap
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


def gap(replica: Any, published: Path, samples: list[Any], learner: Any) -> dict[str, float]:
    """How far the published snapshot's policy is from the learner's own float32 one on ``samples`` (drawn from the
    learner's policy, whose logprobs they carry): mean and max |Δ logprob| per token, and the k3 estimate of
    KL(learner ‖ published) from those tokens."""
    import math

    import torch
    from safetensors.torch import load_file

    from shared.policy import completion_logprobs

    state = load_file(str(published))
    with torch.no_grad():
        for name, value in state.items():
            replica.get_parameter(name).copy_(value.float())
        lp, mask = completion_logprobs(replica, [s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                                       temperature=1.0, pad_id=learner.pad_id)
    diffs = [o - p for s, row in zip(samples, lp.tolist(), strict=True) for o, p in zip(s.old_logprobs, row,
                                                                                        strict=False)]
    return {"mean_abs": sum(abs(d) for d in diffs) / len(diffs), "max_abs": max(abs(d) for d in diffs),
            "kl": sum(math.exp(-d) + d - 1 for d in diffs) / len(diffs)}


def run(model_dir: Path, lr: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One training run at ``lr``; each version published by one store per lag tolerance (the same weights, side
    by side), each patch applied as a client does, and (``--gap``) each published policy compared with the
    learner's."""
    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto, wire
    from shared.deltas import apply_patch
    from shared.messages import Manifest, SignedManifest
    from shared.policy import load_model

    learner = Learner(model_dir, ModelConfig(device="cpu"), LearnerConfig(lr=lr, weight_decay=0.0,
                                                                             threads=args.threads), 1.0,
                      gguf=args.gguf)
    def store(label: str) -> SnapshotStore:  # "τ" (capped at --lag-steps) or "τ:k" (capped at k steps; 0: none)
        tolerance, _, steps = label.partition(":")
        k = float(steps) if steps else args.lag_steps
        return SnapshotStore(work / f"snapshots-{lr}-{label}", crypto.generate_key(), "bench", anchor_every=10_000,
                             lag_tolerance=float(tolerance), lag_cap=k * lr if k > 0 else None)

    stores = {label: store(label) for label in args.lag_tolerance.split(",")}
    replica = load_model(model_dir) if args.gap else None
    rng = random.Random(0)
    prompts = [learner.encode(f"Q: {rng.randrange(100)}+{rng.randrange(100)}= A:") for _ in range(args.prompts)]

    def entries(store: SnapshotStore, v: int) -> dict[str, Any]:
        signed = store.signed_manifest(v)
        assert signed is not None
        return {f.path: f for f in wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files}

    for store in stores.values():
        store.publish(0, learner.snapshot_files("bfloat16"), time.time())
    rows = []
    samples, reward = rollouts(learner, prompts, args.group, args.max_tokens, seed=0)
    try:
        for v in range(1, args.steps + 1):
            t0 = time.monotonic()
            metrics = learner.train_step(samples)
            row: dict[str, Any] = {"version": v, "reward": reward, "grad_norm": float(metrics["grad_norm"]),
                                   "train_s": time.monotonic() - t0, "stores": {}}
            if args.gap:  # the scale of a policy gap: how far this one step moved the learner's own policy
                after = learner.recompute([x.prompt_ids for x in samples], [x.completion_ids for x in samples])
                moved = [a - b for x, row_ in zip(samples, after, strict=True)
                         for a, b in zip(row_, x.old_logprobs, strict=True)]
                row["step_change"] = sum(abs(d) for d in moved) / len(moved)
            for t, store in stores.items():
                t0 = time.monotonic()
                store.publish(v, learner.snapshot_files("bfloat16"), time.time())
                settled = store.last_settled
                at: dict[str, Any] = {"publish_s": time.monotonic() - t0,
                                      "republished": settled.republished / settled.elements if settled else None,
                                      "held": settled.held / settled.elements if settled else None}
                now, before = entries(store, v), entries(store, v - 1)
                for name in ("model.safetensors", "model.gguf"):
                    if name not in now:
                        continue
                    full, delta = now[name], now.get(name + ".delta")
                    at[name] = {"full": full.size, "delta": delta.size if delta else None}
                    if delta is None:
                        continue
                    base, patch = store.blob_path(before[name].sha256), store.blob_path(delta.sha256)
                    assert base is not None and patch is not None
                    out = work / "rebuilt"
                    t0 = time.monotonic()
                    digest = apply_patch(base, patch, out, base_sha256=before[name].sha256, result_sha256=full.sha256)
                    at[name] |= {"apply_s": time.monotonic() - t0, "rebuilt_hash_ok": digest == full.sha256}
                    out.unlink()
                row["stores"][str(t)] = at
            samples, reward = rollouts(learner, prompts, args.group, args.max_tokens, seed=v)  # the next step's
            if replica is not None:
                for t, store in stores.items():
                    row["stores"][str(t)]["gap"] = gap(replica, store.folder(v) / "model.safetensors", samples,
                                                       learner)
            rows.append(row)
            print(json.dumps(row), flush=True)
            for store in stores.values():
                store.prune({v - 1, v})
    finally:
        for store in stores.values():
            shutil.rmtree(store.root, ignore_errors=True)
        del learner
    return {"lr": lr, "rows": rows}


def summary(results: list[dict[str, Any]], label: str) -> str:
    lines = ["| model, lr | lag tolerance | file | full file | patch per version, median (max) | "
             "patch ÷ full, median (max) | rebuilt = published | client apply + sha256, median (max) | "
             "elements republished / held per version, median | policy gap: mean \\|Δ logprob\\| / KL, median (÷ one "
             "step's change of the learner's policy) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = r["rows"]
        for t in rows[0]["stores"]:
            for name in ("model.safetensors", "model.gguf"):
                have = [row["stores"][t][name] for row in rows
                        if name in row["stores"][t] and row["stores"][t][name]["delta"] is not None]
                if not have:
                    continue
                full = statistics.median(h["full"] for h in have)
                deltas = [h["delta"] for h in have]
                apply_s = [h["apply_s"] for h in have]
                ok = sum(h["rebuilt_hash_ok"] for h in have)
                shares = [row["stores"][t] for row in rows]
                moved = ("–" if shares[0]["republished"] is None else
                         f"{100 * statistics.median(x['republished'] for x in shares):.2f} % / "
                         f"{100 * statistics.median(x['held'] for x in shares):.2f} %")
                gaps = [x["gap"] for x in shares if "gap" in x]
                step = [row["step_change"] for row in rows if "step_change" in row]
                gap_text = (f"{statistics.median(g['mean_abs'] for g in gaps):.5f} / "
                            f"{statistics.median(g['kl'] for g in gaps):.2e}"
                            + (f" ({statistics.median(g['mean_abs'] for g in gaps) / statistics.median(step):.2f} "
                               f"of a step)" if step else "")) if gaps else "–"
                lines.append(
                    f"| {label}, {r['lr']:g} | {t} | {name} | {full / 1e6:.1f} MB | "
                    f"{statistics.median(deltas) / 1e6:.2f} MB ({max(deltas) / 1e6:.2f} MB) | "
                    f"{100 * statistics.median(deltas) / full:.2f} % ({100 * max(deltas) / full:.2f} %) | "
                    f"{ok} of {len(have)} | {statistics.median(apply_s):.2f} s ({max(apply_s):.2f} s) | {moved} | "
                    f"{gap_text} |")
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
    ap.add_argument("--lag-tolerance", default="0,0.5", help="snapshots.lag_tolerance values, comma-separated: one "
                    "snapshot store each, publishing the same trained weights side by side")
    ap.add_argument("--lag-steps", type=float, default=8.0, help="snapshots.lag_steps (the threshold's cap: this "
                    "many steps of lr); a tolerance written 'τ:k' uses k instead (0: no cap)")
    ap.add_argument("--gap", action="store_true", help="also load each published version into a float32 replica "
                    "and measure its policy's gap to the learner's on the next step's samples")
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
