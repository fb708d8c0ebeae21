"""Benchmark: does ``learner.precision = "bf16"`` learn like float32 AdamW? Side by side in one run.

For each seed, the same run twice — the tiny model on the addition task, the coordinator's defaults (16 prompts ×
8 samples per step, lr as the demo's), one mode (co-located by default: the learner generates its own rollouts, so
nothing but the learner's arithmetic differs; ``--mode sequential`` adds two ``join`` clients) — once with float32
weights and torch's AdamW (16 B/param) and once with bfloat16 weights, gradients and moments, stochastically rounded
(8 B/param, coordinator.engine.bf16_adamw). Seeds are outermost, so both precisions of a seed see the same machine
conditions. Reads each run's database: held-out greedy accuracy at every evaluation and the mean rollout reward at
every step; prints a markdown table (per precision: final accuracy, improvement, the last 3 evaluations' mean,
reward over the last 50 steps, seconds per optimisation step) and the paired bf16 − float32 differences beside the
seed-to-seed spread of float32 itself, and writes ``<out>/bf16_learning.json`` and ``<out>/bf16_learning.png``.

    python bench/bf16_learning.py --seeds 2 --steps 200        # ~4 min per run on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_swarm.demo import DemoConfig  # noqa: E402
from echo_swarm.demo import run as run_demo  # noqa: E402

PRECISIONS = ("float32", "bf16")
MODES: dict[str, dict[str, Any]] = {
    "colocated": {"sync_mode": "colocated", "clients": 0, "learner_threads": 2},
    "sequential": {"sync_mode": "sequential-pull", "clients": 2, "learner_threads": 2},
}
LATE_EVALS = 3
LATE_STEPS = 50


def measure(run_dir: Path) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
    try:
        evals = conn.execute("SELECT version, accuracy FROM evals ORDER BY version").fetchall()
        rows = conn.execute("SELECT mean_reward, metrics FROM steps ORDER BY step").fetchall()
    finally:
        conn.close()
    curve = [acc for _, acc in evals]
    rewards = [float(r) for r, _ in rows]
    steps = [json.loads(m) for _, m in rows]
    return {
        "accuracy": [[v, acc] for v, acc in evals],
        "reward": rewards,
        "eval_before": curve[0],
        "eval_after": curve[-1],
        "improvement": curve[-1] - curve[0],
        "late_accuracy": statistics.fmean(curve[-LATE_EVALS:]),
        "late_reward": statistics.fmean(rewards[-LATE_STEPS:]),
        "train_s": statistics.median(float(m["train_s"]) for m in steps[1:]),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per precision (learner.seed = 0..N-1)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--mode", choices=sorted(MODES), default="colocated")
    ap.add_argument("--out", type=Path, default=Path("bench-out/bf16_learning"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PRECISIONS}
    started = time.time()
    for seed in range(args.seeds):
        for precision in PRECISIONS:
            out = args.out / f"{precision}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            code = run_demo(DemoConfig(out=out, steps=args.steps, seed=seed, eval_every=args.eval_every,
                                       timeout_s=3600, learner_precision=precision, **MODES[args.mode]))
            if code != 0:
                print(f"{precision} seed {seed} failed (exit {code}); see {out}/logs", file=sys.stderr)
                return 1
            runs[precision].append(measure(out / "run") | {"seed": seed})
            r = runs[precision][-1]
            print(f"{precision} seed {seed}: {r['eval_before']:.3f} -> {r['eval_after']:.3f}, late reward "
                  f"{r['late_reward']:.3f}, {r['train_s']:.3f} s/step", flush=True)
            shutil.rmtree(out / "run" / "snapshots", ignore_errors=True)  # the database is all the bench reads
    result = {"steps": args.steps, "seeds": args.seeds, "mode": args.mode, "bench_wall_s": time.time() - started,
              "runs": runs, "paired": paired(runs)}
    (args.out / "bf16_learning.json").write_text(json.dumps(result, indent=2))
    plot(runs, args.out / "bf16_learning.png", args.mode)
    print(table(result))
    return 0


def paired(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """bf16 − float32 for each seed, and float32's own seed-to-seed differences as the yardstick."""
    out: dict[str, Any] = {}
    for key in ("eval_after", "improvement", "late_accuracy", "late_reward"):
        diffs = [b[key] - f[key] for b, f in zip(runs["bf16"], runs["float32"], strict=True)]
        f32 = [r[key] for r in runs["float32"]]
        out[key] = {"bf16_minus_float32": diffs, "mean": statistics.fmean(diffs),
                    "float32_seed_spread": max(f32) - min(f32)}
    return out


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = ["| precision | final held-out acc. | improvement | last 3 evals | reward, last 50 steps | s per step |",
             "|---|---|---|---|---|---|"]
    for precision, rs in runs.items():
        cells = [spread([r[k] for r in rs]) for k in ("eval_after", "improvement", "late_accuracy", "late_reward")]
        step_s = statistics.fmean(r["train_s"] for r in rs)
        lines.append(f"| {precision} | " + " | ".join(f"{c['mean']:.3f} ± {c['std']:.3f}" for c in cells)
                     + f" | {step_s:.3f} |")
    lines += ["", "| bf16 − float32, per seed | final acc. | improvement | last 3 evals | reward, last 50 |",
              "|---|---|---|---|---|"]
    p = result["paired"]
    keys = ("eval_after", "improvement", "late_accuracy", "late_reward")
    for i in range(result["seeds"]):
        lines.append(f"| seed {i} | " + " | ".join(f"{p[k]['bf16_minus_float32'][i]:+.3f}" for k in keys) + " |")
    lines.append("| float32 seed-to-seed spread | " + " | ".join(f"{p[k]['float32_seed_spread']:.3f}" for k in keys)
                 + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    colours = {"float32": "#246", "bf16": "#c62"}
    for precision, rs in runs.items():
        for r in rs:
            xs, ys = zip(*r["accuracy"], strict=True)
            ax1.plot(xs, ys, "o-", ms=3, color=colours[precision], alpha=0.8,
                     label=f"{precision}" if r["seed"] == 0 else None)
            window = 10
            rew = r["reward"]
            smooth = [statistics.fmean(rew[i - window : i]) for i in range(window, len(rew) + 1)]
            ax2.plot(range(window, len(rew) + 1), smooth, color=colours[precision], lw=1.5, alpha=0.8,
                     label=f"{precision}" if r["seed"] == 0 else None)
    ax1.set_xlabel("learner step")
    ax1.set_ylabel("held-out greedy accuracy")
    ax2.set_xlabel("learner step")
    ax2.set_ylabel("mean rollout reward (10-step mean)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"learner.precision: float32 AdamW vs bf16 with stochastic rounding (tiny model, {mode}, "
                 f"{len(runs['float32'])} seeds)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
