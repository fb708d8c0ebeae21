"""Benchmark: what a fixed policy lag costs GRPO, and how much each off-policy correction wins back.

The async rows of ``bench/sync_modes.py`` mix two things: the scheduling (how stale the rollouts end up) and
the off-policy correction (how the learner treats them). This bench isolates the second. One process, no
network, no clients: at step t the rollouts are sampled from a copy of the policy as it was at step t − k
(version max(0, t − k)), their behaviour log-probabilities are recomputed under that copy exactly as the
coordinator does for a stale result, and the learner's own ``train_step`` trains on them with the staleness
set to k. Everything else is the coordinator's: the tiny model, the task and its held-out split, job plans
(prompts and sampling seeds from ``core.jobs.plan_job``), group-normalised advantages and the learner
configuration defaults (lr 1e-4, 16 prompts × 8 samples per step).

    python bench/policy_lag.py                                   # lags 0, 1, 3, 4 × every correction × 3 seeds
    python bench/policy_lag.py --lags 0,3 --seeds 1 --steps 60   # a quick look
    python bench/policy_lag.py --lags 0,16,64 --corrections behaviour-clip,m2po   # deep asynchrony

Lag 0 is plain on-policy GRPO (every correction reduces to it) and runs once per seed. Each run uses one
torch thread; ``--workers`` runs that many at once. Writes ``<out>/policy_lag.json`` and
``<out>/policy_lag.png`` and prints a markdown table: final held-out accuracy, the mean of the last three
evaluations, mean training reward over the last 50 steps, and the improvement as a share of lag 0's.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CORRECTIONS = ("behaviour-clip", "decoupled", "m2po")


def run_one(lag: int, correction: str, seed: int, steps: int, eval_every: int) -> dict[str, Any]:
    """One training run with rollouts ``lag`` versions old; returns its evaluations and late reward."""
    import torch

    from coordinator.config import CoordinatorConfig
    from coordinator.core.advantages import group_advantages
    from coordinator.core.jobs import plan_job
    from coordinator.engine.learner import Learner, Sample
    from coordinator.engine.tiny_model import ensure_tiny_model
    from coordinator.tasks.factory import make_task
    from shared.policy import completion_logprobs, generate

    cfg = CoordinatorConfig.model_validate({"learner": {"threads": 1, "seed": seed, "correction": correction}})
    task = make_task(cfg.task)
    learner = Learner(ensure_tiny_model(), cfg.model, cfg.learner, cfg.sampling.temperature)
    behaviour = copy.deepcopy(learner.model).eval()
    versions = collections.deque([copy.deepcopy(learner.model.state_dict())], maxlen=lag + 1)
    jobs_per_step = cfg.learner.prompts_per_step // cfg.jobs.prompts_per_job
    group = cfg.learner.group_size
    heldout = task.heldout[: cfg.learner.eval_size]
    evals: list[tuple[int, float]] = []
    rewards: list[float] = []
    t0 = time.monotonic()
    for step in range(steps):
        if step % eval_every == 0:
            evals.append((step, learner.evaluate(task, heldout, cfg.sampling.max_tokens)))
        behaviour.load_state_dict(versions[0])  # the policy as it was max(0, step − lag) versions ago
        staleness = min(step, lag)
        samples: list[Sample] = []
        for j in range(jobs_per_step):
            plan = plan_job(seed, step * jobs_per_step + j, len(task.train), cfg.jobs.prompts_per_job)
            prompts = [learner.encode(task.train[i].prompt) for i in plan.prompt_ids]
            with torch.no_grad():
                out = generate(behaviour, prompts, group_size=group, temperature=cfg.sampling.temperature,
                               max_tokens=cfg.sampling.max_tokens, stop_ids=learner.stop_ids, seed=plan.seed,
                               pad_id=learner.pad_id)
                per_prompt = [p for p in prompts for _ in range(group)]
                comps = [o.token_ids for o in out]
                lp, _ = completion_logprobs(behaviour, per_prompt, comps, temperature=cfg.sampling.temperature,
                                            pad_id=learner.pad_id)
            items = [task.train[i] for i in plan.prompt_ids for _ in range(group)]
            rs = [task.reward(it, learner.decode(c)) for it, c in zip(items, comps, strict=True)]
            rewards.append(sum(rs) / len(rs))
            for p, c, row, adv in zip(per_prompt, comps, lp.tolist(), group_advantages(rs, group), strict=True):
                recomputed = row[: len(c)]
                samples.append(Sample(p, c, recomputed, recomputed, adv, staleness, 1.0))
        learner.train_step(samples)
        versions.append(copy.deepcopy(learner.model.state_dict()))
    evals.append((steps, learner.evaluate(task, heldout, cfg.sampling.max_tokens)))
    late = rewards[-50 * jobs_per_step:]
    return {"lag": lag, "correction": correction if lag else "on-policy", "seed": seed, "evals": evals,
            "final": evals[-1][1], "last3": statistics.fmean(a for _, a in evals[-3:]),
            "late_reward": statistics.fmean(late), "initial": evals[0][1], "wall_s": time.monotonic() - t0}


def by_config(runs: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """The runs grouped by (lag, correction), one entry per seed."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        groups[(r["lag"], r["correction"])].append(r)
    return groups


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation per (lag, correction), and improvements as a share of lag 0's."""
    groups = by_config(runs)

    def stats(rs: list[dict[str, Any]], key: str) -> tuple[float, float]:
        xs = [r[key] for r in rs]
        return statistics.fmean(xs), statistics.pstdev(xs)

    base = groups.get((0, "on-policy"))
    rows = []
    for (lag, corr), rs in sorted(groups.items()):
        row: dict[str, Any] = {"lag": lag, "correction": corr, "seeds": len(rs)}
        for key in ("final", "last3", "late_reward"):
            row[key], row[key + "_sd"] = stats(rs, key)
        if base:
            start = statistics.fmean(r["initial"] for r in base)
            for key in ("final", "last3"):
                row[key + "_vs_lag0"] = (row[key] - start) / (stats(base, key)[0] - start)
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    groups = by_config(runs)
    for (lag, corr), rs in sorted(groups.items()):
        steps = [s for s, _ in rs[0]["evals"]]
        mean = [statistics.fmean(r["evals"][i][1] for r in rs) for i in range(len(steps))]
        style = "-" if corr in ("on-policy", "behaviour-clip") else "--"
        ax.plot(steps, mean, style, marker="o", ms=3, label=f"lag {lag}, {corr}" if lag else "lag 0 (on-policy)")
    ax.set_xlabel("learner step (16 × 8 rollouts each)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"GRPO with rollouts k versions old (mean of {max(len(v) for v in groups.values())} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lags", default="0,1,3,4", help="comma-separated policy lags k, in versions")
    ap.add_argument("--corrections", default=",".join(CORRECTIONS), help="comma-separated learner.correction values")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per configuration (learner.seed = 0..N-1)")
    ap.add_argument("--steps", type=int, default=200, help="learner steps per run")
    ap.add_argument("--eval-every", type=int, default=25, help="held-out evaluation every N steps")
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one torch thread each)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/policy_lag"))
    a = ap.parse_args()
    lags = sorted({int(x) for x in a.lags.split(",")})
    corrections = [c for c in a.corrections.split(",") if c]
    unknown = set(corrections) - set(CORRECTIONS)
    if unknown or any(k < 0 for k in lags):
        ap.error(f"corrections must be among {', '.join(CORRECTIONS)} and lags ≥ 0 (got {a.corrections!r}, {a.lags!r})")
    configs = [(k, c) for k in lags for c in (corrections[:1] if k == 0 else corrections)]
    a.out.mkdir(parents=True, exist_ok=True)
    from coordinator.engine.tiny_model import ensure_tiny_model

    ensure_tiny_model()  # built once here, not raced by the workers on a fresh machine
    jobs = [(k, c, s) for s in range(a.seeds) for k, c in configs]
    print(f"{len(jobs)} runs of {a.steps} steps, {a.workers} at a time", flush=True)
    runs: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=a.workers) as pool:
        futures = [pool.submit(run_one, k, c, s, a.steps, a.eval_every) for k, c, s in jobs]
        for n, fut in enumerate(futures, 1):
            r = fut.result()
            runs.append(r)
            print(f"[{n}/{len(jobs)}] lag {r['lag']} {r['correction']} seed {r['seed']}: {r['initial']:.3f} -> "
                  f"{r['final']:.3f} (last 3 {r['last3']:.3f}, late reward {r['late_reward']:.3f}, "
                  f"{r['wall_s']:.0f} s)", flush=True)
    rows = summarise(runs)
    (a.out / "policy_lag.json").write_text(json.dumps({"steps": a.steps, "rows": rows, "runs": runs}, indent=1))
    plot(runs, a.out / "policy_lag.png")
    print("\n| lag | correction | final held-out acc. | last 3 evals | late training reward | "
          "improvement vs lag 0 (final / last 3) |\n|---|---|---|---|---|---|")
    for r in rows:
        share = (f"{100 * r['final_vs_lag0']:.0f} % / {100 * r['last3_vs_lag0']:.0f} %"
                 if "final_vs_lag0" in r and r["lag"] else "—")
        print(f"| {r['lag']} | {r['correction']} | {r['final']:.3f} ± {r['final_sd']:.3f} | "
              f"{r['last3']:.3f} ± {r['last3_sd']:.3f} | {r['late_reward']:.3f} ± {r['late_reward_sd']:.3f} | {share} |")
    print(f"\nwrote {a.out / 'policy_lag.json'} and {a.out / 'policy_lag.png'}")


if __name__ == "__main__":
    main()
