"""Benchmark: Echo's synchronisation protocols against a co-located baseline, side by side in one run.

For each configuration (co-located; sequential pull; async push-pull at S ∈ {1, 2, 4}) and seed, runs the
full system on this machine — a coordinator and N `join` clients as separate processes on 127.0.0.1 (the
co-located baseline has no clients) — with the same task, model, hyper-parameters and sample budget, then
reads the run's database for held-out accuracy against samples consumed and against wall-clock, the learner
busy fraction (time in optimisation ÷ wall time) and the staleness of every trained batch.

The ``trl`` row is a peer, not an echo-swarm mode: Hugging Face TRL's GRPOTrainer on the same model, task, reward
and hyper-parameters, in a child process with the co-located row's thread count, evaluated by the same held-out code
(``bench/trl_peer.py``; needs the ``bench`` extra). Leave it out with ``--modes`` when TRL is not installed.

    python bench/sync_modes.py --seeds 3 --steps 200            # the full comparison (about an hour on 2 cores)
    python bench/sync_modes.py --seeds 1 --steps 60 --modes sequential,async2   # a quick look

Writes ``<out>/sync_modes.json`` and ``<out>/sync_modes.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_swarm.demo import DemoConfig  # noqa: E402
from echo_swarm.demo import run as run_demo  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "colocated": {"sync_mode": "colocated", "clients": 0, "max_staleness": 1, "learner_threads": 2},
    # the clients sample with the co-located learner's thread count: a job's generation is then the same computation
    # in both rows, to the last bit (torch's CPU kernels split work by thread count), so the rows are equal seed by seed
    "sequential": {"sync_mode": "sequential-pull", "clients": 2, "max_staleness": 1, "learner_threads": 2,
                   "client_threads": 2},
    "async1": {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": 1, "learner_threads": 1},
    "async2": {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": 2, "learner_threads": 1},
    "async4": {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": 4, "learner_threads": 1},
    # async2 publishing bf16 snapshots with patches: every rounding (exact), or lazily (snapshots.lag_tolerance 0.5)
    "async2-bf16": {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": 2, "learner_threads": 1,
                    "snapshot_dtype": "bfloat16", "lag_tolerance": 0.0},
    "async2-bf16-lazy": {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": 2, "learner_threads": 1,
                         "snapshot_dtype": "bfloat16", "lag_tolerance": 0.5},
    "trl": {"peer": "trl.GRPOTrainer", "clients": 0, "learner_threads": 2},  # see bench/trl_peer.py
}
# Issue 32's deep staleness with slow clients rather than a forced lag: one client at full speed and one held to a
# share of its CPU (join --max-cpu-percent; 10 % ≈ 10× slower, 3 % ≈ 30×), whose results come back many versions
# old; the behaviour-anchored clip and M2PO (its second-moment trust region) at the same S, side by side.
for _s, _pct in ((16, 10), (64, 3)):
    # -t01: M2PO with a tighter second-moment bound than the paper's τ = 0.04 (which masks under 1 % of tokens here)
    for _corr, _tag, _extra in (("behaviour-clip", "clip", {}), ("m2po", "m2po", {}),
                                ("m2po", "m2po-t01", {"m2_threshold": 0.01})):
        MODES[f"async{_s}-slow-{_tag}"] = {"sync_mode": "async-push-pull", "clients": 2, "max_staleness": _s,
                                           "learner_threads": 1, "correction": _corr, **_extra,
                                           "slow_cpu_percent": _pct}
SAMPLES_PER_STEP = 16 * 8  # learner.prompts_per_step × learner.group_size (coordinator defaults)


def measure(run_dir: Path) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
    try:
        t0 = conn.execute("SELECT created_at FROM versions WHERE version = 0").fetchone()[0]
        evals = conn.execute("SELECT version, accuracy, at FROM evals ORDER BY version").fetchall()
        steps = [(at, json.loads(m)) for at, m in conn.execute("SELECT at, metrics FROM steps ORDER BY step")]
        # per client (by its demo name): results trained, their staleness when trained, results set aside
        per_client: dict[str, dict[str, Any]] = {}
        for name, version, step, stale_at in conn.execute(
                "SELECT json_extract(c.profile, '$.name'), r.version, r.ingested_step, r.stale_at FROM results r "
                "JOIN clients c ON c.client_id = r.client_id"):
            row = per_client.setdefault(str(name), {"trained": 0, "set_aside": 0, "staleness": []})
            if step is not None:
                row["trained"] += 1
                row["staleness"].append(step - 1 - version)
            elif stale_at is not None:
                row["set_aside"] += 1
    finally:
        conn.close()
    wall = steps[-1][0] - t0
    hist: dict[str, int] = {}
    for _, m in steps:
        for k, v in m["staleness_histogram"].items():
            hist[k] = hist.get(k, 0) + v
    return {
        "accuracy_by_samples": [[v * SAMPLES_PER_STEP, acc] for v, acc, _ in evals],
        "accuracy_by_wall_s": [[at - t0, acc] for _, acc, at in evals],
        "eval_before": evals[0][1],
        "eval_after": evals[-1][1],
        "improvement": evals[-1][1] - evals[0][1],
        "wall_s": wall,
        "learner_busy_fraction": sum(m["train_s"] for _, m in steps) / wall,
        "staleness_max": max(int(m["staleness_max"]) for _, m in steps),
        "staleness_histogram": hist,
        "mean_is_ratio_max": statistics.fmean(m.get("is_ratio_max", 1.0) for _, m in steps),
        "mean_is_truncated_fraction": statistics.fmean(m.get("is_truncated_fraction", 0.0) for _, m in steps),
        # each step's loss and gradient norm, to the bit: equal only if the step trained on the same tokens, with the
        # same π_b, from the same weights (the sequential-pull vs co-located check compares these, not only rewards)
        "step_fingerprint": [[m["loss"], m["grad_norm"]] for _, m in steps],
        "clients": {name: {"trained": c["trained"], "set_aside": c["set_aside"],
                           "staleness_mean": statistics.fmean(c["staleness"]) if c["staleness"] else None,
                           "staleness_max": max(c["staleness"], default=None)} for name, c in per_client.items()},
        "m2po_masked_fraction": statistics.fmean(m.get("m2po_masked_fraction", 0.0) for _, m in steps),
    }


def run_peer(out: Path, seed: int, steps: int, eval_every: int, threads: int) -> dict[str, Any] | None:
    """The TRL peer row in a child process (its own torch threads, RNG and accelerate state); None on failure."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).with_name("trl_peer.py")), "--seed", str(seed), "--steps", str(steps),
            "--eval-every", str(eval_every), "--threads", str(threads), "--out", str(out)]
    with open(out / "trl.log", "w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False).returncode
    if code != 0:
        return None
    result: dict[str, Any] = json.loads((out / "trl_peer.json").read_text())
    return result


LATE_EVALS = 3


def late_improvement(run: dict[str, Any]) -> float:
    """Mean held-out accuracy over the last LATE_EVALS evaluations minus the starting accuracy: the same
    endpoint as ``improvement`` with a third of its evaluation noise (each evaluation is ±0.02 on 512 prompts
    and RL curves wobble by more between neighbouring evaluations)."""
    curve = [acc for _, acc in run["accuracy_by_samples"]]
    return statistics.fmean(curve[-LATE_EVALS:]) - curve[0]


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds per configuration (learner.seed = 0..N-1)")
    ap.add_argument("--steps", type=int, default=200, help="learner steps per run (same sample budget for all)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("bench-out/sync_modes"))
    ap.add_argument("--resume", action="store_true",
                    help="reuse every run that already finished under --out (its result.json) instead of rerunning it")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - MODES.keys()
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    if "trl" in modes and importlib.util.find_spec("trl") is None:
        ap.error("mode 'trl' needs Hugging Face TRL: install the 'bench' extra (see pyproject.toml; keep torch as it "
                 "is with pip install 'trl>=1.16,<2' --no-deps), or leave 'trl' out of --modes")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    started = time.time()
    for seed in range(args.seeds):  # seeds outermost: every configuration sees the same machine conditions
        for mode in modes:
            out = args.out / f"{mode}-seed{seed}"
            spec = MODES[mode]
            done = out / "result.json"
            if args.resume and done.exists():
                earlier = json.loads(done.read_text())
                if "step_fingerprint" not in earlier and (out / "run" / "coordinator.sqlite").exists():
                    earlier = measure(out / "run") | {"seed": seed}  # a run from before the fingerprint: re-read it
                    done.write_text(json.dumps(earlier))
                runs[mode].append(earlier)
                continue
            if out.exists():  # a run from an earlier invocation: start it afresh, never mix two runs' databases
                shutil.rmtree(out)
            if "peer" in spec:
                peer = run_peer(out, seed, args.steps, args.eval_every, spec["learner_threads"])
                if peer is None:
                    print(f"{mode} seed {seed} failed; see {out}/trl.log", file=sys.stderr)
                    return 1
                runs[mode].append(peer | {"seed": seed})
                done.write_text(json.dumps(runs[mode][-1]))
                continue
            code = run_demo(DemoConfig(out=out, steps=args.steps, seed=seed, eval_every=args.eval_every,
                                       timeout_s=3600, **spec))
            if code != 0:
                print(f"{mode} seed {seed} failed (exit {code}); see {out}/logs", file=sys.stderr)
                return 1
            runs[mode].append(measure(out / "run") | {"seed": seed})
            done.write_text(json.dumps(runs[mode][-1]))  # kept per run, so an interrupted bench can --resume
            print(f"{mode} seed {seed}: {runs[mode][-1]['eval_before']:.3f} -> {runs[mode][-1]['eval_after']:.3f}, "
                  f"busy {runs[mode][-1]['learner_busy_fraction']:.2f}, {runs[mode][-1]['wall_s']:.0f} s", flush=True)
    summary = {
        mode: {
            "config": MODES[mode],
            "runs": rs,
            "final_accuracy": spread([r["eval_after"] for r in rs]),
            "improvement": spread([r["improvement"] for r in rs]),
            "late_improvement": spread([late_improvement(r) for r in rs]),
            "learner_busy_fraction": spread([r["learner_busy_fraction"] for r in rs]),
            "wall_s": spread([r["wall_s"] for r in rs]),
            # the peer has no staleness: it generates and trains in one loop
            "staleness_max": max(r["staleness_max"] for r in rs) if all("staleness_max" in r for r in rs) else None,
        }
        for mode, rs in runs.items()
    }
    result = {"steps": args.steps, "seeds": args.seeds, "samples_per_step": SAMPLES_PER_STEP,
              "bench_wall_s": time.time() - started, "modes": summary, "checks": checks(summary)}
    (args.out / "sync_modes.json").write_text(json.dumps(result, indent=2))
    plot(summary, args.out / "sync_modes.png")
    print(table(result))
    print(json.dumps(result["checks"], indent=2))
    return 0


def checks(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's claims, computed from the runs so that the JSON states each one and whether it held.

    "Within seed noise" is judged per seed pair (both modes share seed k's prompts and checkpoint): the mean of
    the paired differences must lie within two standard errors of that mean, or be exactly zero.
    """
    out: dict[str, Any] = {}
    base = summary.get("colocated")
    if base is None:
        return out
    base_imp, base_late = base["improvement"]["mean"], base["late_improvement"]["mean"]
    if "sequential" in summary:
        diffs = [s["eval_after"] - c["eval_after"] for s, c in
                 zip(summary["sequential"]["runs"], base["runs"], strict=True)]
        mean = statistics.fmean(diffs)
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
        out["sequential_vs_colocated_final_accuracy"] = {
            "paired_differences": diffs, "mean": mean, "standard_error": se,
            "within_seed_noise": mean == 0.0 or abs(mean) <= 2 * se}
        same = []  # per seed: how many steps, from the first, have the very same loss and gradient norm in both runs
        for sq, co in zip(summary["sequential"]["runs"], base["runs"], strict=True):
            a, b = sq.get("step_fingerprint"), co.get("step_fingerprint")
            if a is None or b is None:
                continue
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            same.append({"seed": sq["seed"], "identical_steps": n, "steps": min(len(a), len(b))})
        if same:
            out["sequential_equals_colocated_step_by_step"] = {
                "per_seed": same, "holds": all(x["identical_steps"] == x["steps"] for x in same)}
    for mode, s in summary.items():
        if s["config"].get("sync_mode") == "async-push-pull":
            ratio = s["improvement"]["mean"] / base_imp if base_imp > 0 else None
            late = s["late_improvement"]["mean"] / base_late if base_late > 0 else None
            out[f"{mode}_improvement_vs_colocated"] = {
                "ratio": ratio, "at_least_0.95": ratio is not None and ratio >= 0.95,
                f"ratio_last{LATE_EVALS}_evals": late,
                f"at_least_0.95_last{LATE_EVALS}_evals": late is not None and late >= 0.95,
                "staleness_max": s["staleness_max"], "max_staleness_S": s["config"]["max_staleness"],
                "staleness_within_S": s["staleness_max"] is not None
                and s["staleness_max"] <= s["config"]["max_staleness"]}
            if "sequential" in summary:
                out[f"{mode}_busier_than_sequential"] = (
                    s["learner_busy_fraction"]["mean"] > summary["sequential"]["learner_busy_fraction"]["mean"])
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| mode | final held-out acc. | improvement | improvement, last 3 evals | learner busy | wall (s) | "
             "max staleness |", "|---|---|---|---|---|---|---|"]
    for mode, s in result["modes"].items():
        fa, im, busy, wall = s["final_accuracy"], s["improvement"], s["learner_busy_fraction"], s["wall_s"]
        la = s["late_improvement"]
        lines.append(f"| {mode} | {fa['mean']:.3f} ± {fa['std']:.3f} | {im['mean']:+.3f} ± {im['std']:.3f} | "
                     f"{la['mean']:+.3f} ± {la['std']:.3f} | "
                     f"{busy['mean']:.2f} | {wall['mean']:.0f} | {'–' if s['staleness_max'] is None else s['staleness_max']} |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    for mode, s in summary.items():
        for key, ax in (("accuracy_by_samples", ax1), ("accuracy_by_wall_s", ax2)):
            curves = [r[key] for r in s["runs"]]
            n = min(len(c) for c in curves)
            xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
            ys = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
            ax.plot(xs, ys, "o--" if "peer" in s["config"] else "o-", ms=3,
                    label=f"{mode} (peer)" if "peer" in s["config"] else mode)
    ax1.set_xlabel("rollout samples consumed")
    ax2.set_xlabel("wall-clock seconds")
    ax1.set_ylabel("held-out greedy accuracy (mean over seeds)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(loc="lower right")
    fig.suptitle("echo-swarm: synchronisation modes vs co-located baseline and TRL peer (tiny model, 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
