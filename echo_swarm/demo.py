"""`echo-swarm demo`: the whole system on one machine, as separate OS processes talking HTTP on 127.0.0.1.

Starts one coordinator (learner + job server) and N `join` clients, follows the run through the
coordinator's status API with a progress bar, then writes ``summary.json`` and ``reward_curve.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.engine.family_models import BY_NAME as FAMILY_NAMES
from coordinator.engine.family_models import unknown_family
from coordinator.engine.tiny_model import TinyRecipe, ensure_tiny_model, is_shipped
from coordinator.store.db import is_postgres_url
from coordinator.store.readmodels import rejection_counts
from coordinator.store.store import Store
from echo_swarm.demo_tasks import DEMO_TASKS
from echo_swarm.pgserver import LocalPostgres, PostgresUnavailable
from shared.endpoints import STATUS
from swarm_client.identity import load_identity

console = Console()


@dataclass
class DemoConfig:
    clients: int = 2
    out: Path = Path("demo-out")
    steps: int = 200
    port: int = 0
    timeout_s: float = 840.0
    learner_threads: int = 2
    client_threads: int = 1
    lr: float | None = None  # None: the task's own (DEMO_TASKS)
    sync_mode: str = "sequential-pull"
    max_staleness: int = 2
    seed: int = 0
    eval_every: int = 25
    backend: str = "torch"  # torch | llama | auto | mixed (clients alternate torch, llama, torch, ...)
    snapshot_dtype: str = "training"  # snapshots.dtype ("bfloat16": what bench/sync_modes.py's bf16 rows publish)
    lag_tolerance: float | None = None  # snapshots.lag_tolerance (None: the default; coordinator/publish/lazy.py)
    store: str = "sqlite"  # sqlite | postgresql (a private server the demo starts) | a postgresql:// URL
    task: str = "addition"  # a key of DEMO_TASKS
    p2p: bool = False  # clients fetch snapshots from each other over libp2p (the p2p extra; docs/protocol.md §6a)
    learner_precision: str = "float32"  # learner.precision: "bf16" trains bf16 weights and moments (bench/bf16_learning.py)
    gguf: str | None = None  # snapshots.gguf for llama.cpp clients (None: the default, f16; bench/quantised_learning.py)
    correction: str | None = None  # learner.correction (None: the default, behaviour-clip)
    m2_threshold: float | None = None  # learner.m2_threshold, m2po's τ (None: the default)
    model: str = "tiny"  # model.path: the built-in tiny model, or a model folder (bench/quantised_learning.py's wider one)
    model_family: str | None = None  # a family's warm-started model instead (coordinator.engine.family_warm)
    final_eval_wait_s: float = 600.0  # longest wait, once trained, for the final version's held-out evaluation
    # the last client joins with --max-cpu-percent N: a volunteer ~100/N times slower beside the others (issue 32's
    # slow-client rows of bench/sync_modes.py); None: every client at full speed
    slow_cpu_percent: int | None = None

    def client_backend(self, k: int) -> str:
        if self.backend == "mixed":
            return ("torch", "llama")[k % 2]
        return self.backend


def build_model_with_progress(cache_dir: Path | None = None) -> Path:
    recipe = TinyRecipe()
    if is_shipped(recipe):  # copied from the package in a moment: nothing to show
        return ensure_tiny_model(cache_dir, recipe)
    with Progress(TextColumn("[bold]building tiny model[/] (cached after the first run)"), BarColumn(),
                  TextColumn("step {task.completed}/{task.total}  warm-start accuracy {task.fields[acc]:.2f}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("sft", total=recipe.max_sft_steps, acc=0.0)
        path = ensure_tiny_model(cache_dir, recipe, lambda s, n, a: bar.update(task, completed=s, acc=a))
    return path


def build_family_with_progress(name: str, cache_dir: Path | None = None) -> Path:
    """Family ``name``'s warm-started model (coordinator.engine.family_warm), with a progress bar while it is built
    (a minute or a few the first time; cached after)."""
    # lazy: family_warm brings in the family models' builders, which only a --model-family demo needs
    from coordinator.engine.family_warm import ensure_family_model, family_recipe

    recipe = family_recipe(name)
    with Progress(TextColumn(f"[bold]building the {name} model[/] (cached after the first run)"), BarColumn(),
                  TextColumn("step {task.completed}/{task.total}  warm-start accuracy {task.fields[acc]:.2f}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("sft", total=recipe.max_sft_steps, acc=0.0)
        return ensure_family_model(name, cache_dir, lambda s, n, a: bar.update(task, completed=s, acc=a), recipe)


class _Proc:
    """A child process whose stdout is copied to a log file by a thread, watching for one line."""

    def __init__(self, name: str, argv: list[str], log: Path, watch: str | None = None) -> None:
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115 — closed in wait()
        self.found = threading.Event()
        self.line = ""
        self.watch = watch
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.thread = threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True)
        self.thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.log.write(line)
            self.log.flush()
            if self.watch and not self.found.is_set() and self.watch in line:
                self.line = line.strip()
                self.found.set()

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.thread.join(timeout=5)
        self.log.close()
        return code


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _write_config(cfg: DemoConfig, run_dir: Path, store_url: str | None = None) -> Path:
    path = cfg.out / "run.toml"
    task = DEMO_TASKS[cfg.task]
    path.write_text(
        f'run_dir = "{run_dir}"\nsync_mode = "{cfg.sync_mode}"\nmax_staleness = {cfg.max_staleness}\n\n'
        f'[snapshots]\nkeep_last = {cfg.max_staleness + 2}\n'
        + (f'dtype = "{cfg.snapshot_dtype}"\n' if cfg.snapshot_dtype != "training" else "")
        + (f"lag_tolerance = {cfg.lag_tolerance}\n" if cfg.lag_tolerance is not None else "")
        # GGUF only for llama.cpp clients: with torch clients alone (or none) nobody would download it
        + ('gguf = "off"\n' if cfg.clients == 0 or cfg.backend == "torch" else
           f'gguf = "{cfg.gguf}"\n' if cfg.gguf is not None else "") + "\n"
        # a local demonstration: its clients are the project's own, and one seed should draw the same jobs run
        # after run (bench/sync_modes.py compares modes seed by seed)
        f'[jobs]\nsecret_plans = false\n\n[model]\npath = {json.dumps(cfg.model)}\n\n[server]\nhost = "127.0.0.1"\nport = {cfg.port}\n\n'
        f"[learner]\nmax_steps = {cfg.steps}\neval_every = {cfg.eval_every}\nthreads = {cfg.learner_threads}\n"
        f"lr = {task.lr if cfg.lr is None else cfg.lr}\nseed = {cfg.seed}\n"
        + (f'precision = "{cfg.learner_precision}"\n' if cfg.learner_precision != "float32" else "")
        + (f'correction = "{cfg.correction}"\n' if cfg.correction is not None else "")
        + (f"m2_threshold = {cfg.m2_threshold}\n" if cfg.m2_threshold is not None else "")
        + "".join(f"{k} = {v}\n" for k, v in task.learner.items())
        + (f"\n[store]\nurl = {json.dumps(store_url)}\n" if store_url else "")
        + ("\n[p2p]\nenabled = true\n" if cfg.p2p else "")
        + f"\n{task.toml}"
    )
    return path


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    curve = summary["reward_curve"]
    ax.plot(range(1, len(curve) + 1), curve, color="#9ab", lw=1, label="mean rollout reward (per step)")
    window = 10
    if len(curve) >= window:
        smooth = [sum(curve[i - window:i]) / window for i in range(window, len(curve) + 1)]
        ax.plot(range(window, len(curve) + 1), smooth, color="#246", lw=2, label=f"reward, {window}-step mean")
    evals = summary["eval_curve"]
    ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "o-", color="#c52",
            label="held-out greedy accuracy")
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"echo-swarm demo ({summary['task']}): {summary['clients_count']} clients, {summary['accepted']} accepted results")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(cfg: DemoConfig) -> int:
    t0 = time.monotonic()
    if cfg.task not in DEMO_TASKS:
        console.print(f"[red]--task {cfg.task!r} is not a demo task; choose one of {', '.join(DEMO_TASKS)}[/]")
        return 2
    if cfg.model_family is not None and cfg.model_family not in FAMILY_NAMES:
        console.print(f"[red]--model-family {unknown_family(cfg.model_family)}[/]")
        return 2
    cfg.out.mkdir(parents=True, exist_ok=True)
    run_dir = (cfg.out / "run").resolve()
    for stale in (run_dir, cfg.out / "clients", cfg.out / "logs"):
        shutil.rmtree(stale, ignore_errors=True)
    (cfg.out / "logs").mkdir()
    if cfg.model_family is not None:
        cfg = replace(cfg, model=str(build_family_with_progress(cfg.model_family)))
    else:
        build_model_with_progress()
    try:
        with _demo_store(cfg) as store_url:
            return _run(cfg, run_dir, store_url, t0)
    except PostgresUnavailable as exc:
        console.print(f"[red]{exc}[/]")
        return 1


@contextlib.contextmanager
def _demo_store(cfg: DemoConfig) -> Iterator[str | None]:
    """The run's store: the run directory's SQLite file (None), the URL given, or a private PostgreSQL server
    the demo starts in --out/postgres (a fresh database each time) and stops at the end."""
    if cfg.store == "sqlite":
        yield None
    elif cfg.store in ("postgresql", "postgres"):
        shutil.rmtree(cfg.out / "postgres", ignore_errors=True)
        with LocalPostgres(cfg.out / "postgres") as server:
            url = server.create_database("echo_swarm_demo")
            console.print(f"PostgreSQL store at {url} (a private server in {server.root})")
            yield url
    elif is_postgres_url(cfg.store):
        yield cfg.store
    else:
        raise PostgresUnavailable(f"--store {cfg.store!r}: use sqlite, postgresql (the demo starts a private "
                                  f"server) or a postgresql://USER@HOST:PORT/DB URL")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cfg: DemoConfig, run_dir: Path, store_url: str | None, t0: float) -> int:
    cfg = replace(cfg, port=cfg.port or _free_port())  # known before it listens: the clients start with it
    config_path = _write_config(cfg, run_dir, store_url)
    py = [sys.executable, "-m", "echo_swarm"]
    coord = _Proc("coordinator", py + ["coordinator", "--config", str(config_path)],
                  cfg.out / "logs" / "coordinator.log", watch="listening on ")
    procs: list[_Proc] = []
    # a loaded machine can take minutes to start the roles and publish version 0
    start_s = min(600.0, cfg.timeout_s)
    try:
        # The clients start with the coordinator, as volunteers already running when a run begins: their seconds of
        # torch and transformers imports overlap its start-up, and they look for it until it listens
        url = f"http://127.0.0.1:{cfg.port}"
        for k in range(cfg.clients):
            home = (cfg.out / "clients" / f"client{k}").resolve()
            procs.append(_Proc(f"client{k}", py + ["join", url, "--home", str(home), "--threads",
                                                   str(cfg.client_threads), "--name", f"demo-{k}",
                                                   "--exit-when-finished", "--backend", cfg.client_backend(k),
                                                   "--wait-for-coordinator", f"{start_s:g}",
                                                   *(["--p2p"] if cfg.p2p else []),
                                                   *(["--max-cpu-percent", str(cfg.slow_cpu_percent)]
                                                     if cfg.slow_cpu_percent and k == cfg.clients - 1 else [])],
                               cfg.out / "logs" / f"client{k}.log"))
        if not coord.found.wait(start_s) or coord.proc.poll() is not None:
            console.print(f"[red]coordinator did not start; see {cfg.out / 'logs' / 'coordinator.log'}[/]")
            return 1
        console.print(f"coordinator up at {url} (live status page: {url}/) with {cfg.clients} clients")
        status = _follow(url, cfg, coord, procs, t0)
        if status is None:
            return 1
        for p in procs:
            p.wait(60)
        status = _get_json(url + STATUS.path)
    finally:
        for p in procs:
            p.interrupt()
        for p in procs:
            if not p.log.closed:
                p.wait(30)
        coord.interrupt()
        coord_code = coord.wait(60)
    summary = _summarise(cfg, status, procs, time.monotonic() - t0, store_url)
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(summary, cfg.out / "reward_curve.png")
    _print(summary, cfg.out)
    return 0 if coord_code == 0 and summary["final_version"] == cfg.steps else 1


def _follow(url: str, cfg: DemoConfig, coord: _Proc, procs: list[_Proc], t0: float) -> dict[str, Any] | None:
    status: dict[str, Any] = {}
    with Progress(TextColumn("[bold]training[/]"), BarColumn(), TextColumn("v{task.completed}/{task.total}"),
                  TextColumn("reward {task.fields[reward]:.2f}  held-out {task.fields[acc]}  accepted {task.fields[acc_n]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("train", total=cfg.steps, reward=0.0, acc="-", acc_n=0)
        finished_at: float | None = None  # when the run was first seen finished
        told = False
        stop = threading.Event()
        while not stop.wait(1.0):
            if time.monotonic() - t0 > cfg.timeout_s:
                console.print(f"[red]demo timed out after {cfg.timeout_s:.0f}s[/]")
                return None
            if coord.proc.poll() is not None:
                console.print(f"[red]coordinator exited with code {coord.proc.returncode}; see its log[/]")
                return None
            if procs and all(p.proc.poll() not in (None, 0) for p in procs):
                console.print("[red]every client has failed; see the client logs[/]")
                return None
            try:
                status = _get_json(url + STATUS.path)
            except (urllib.error.URLError, OSError):
                continue
            curve = status["reward_curve"]
            recent = curve[-10:]
            evals = status["evals"]
            bar.update(task, completed=status["version"], reward=sum(recent) / len(recent) if recent else 0.0,
                       acc=f"{evals[-1]['accuracy']:.3f}" if evals else "-", acc_n=status["totals"]["accepted"])
            if status["finished"]:
                finished_at = finished_at or time.monotonic()
                wait = final_evaluation(status, time.monotonic() - finished_at, cfg.final_eval_wait_s)
                if wait.done:
                    if wait.message:
                        console.print(f"[yellow]{wait.message}[/]")
                    return status
                if not told:
                    console.print(f"trained to v{status['version']}; waiting for its held-out evaluation "
                                  f"(at most {cfg.final_eval_wait_s:.0f}s: the verifier may be busy)")
                    told = True
    return None


@dataclass(frozen=True)
class FinalWait:
    """Whether the demo stops waiting for the final version's held-out evaluation, and what it says if it got none."""

    done: bool
    message: str = ""


def final_evaluation(status: dict[str, Any], waited_s: float, bound_s: float) -> FinalWait:
    """A finished run's final held-out evaluation: recorded (done), reported skipped by the verifier (done, said),
    past ``bound_s`` seconds of waiting (done, said), or still to wait for."""
    version, evals = status["version"], status["evals"]
    if evals and evals[-1]["version"] == version:
        return FinalWait(True)
    last = f"the last one is v{evals[-1]['version']}'s" if evals else "there is none"
    skipped = status.get("roles", {}).get("verifier-0", {}).get("evaluations_skipped", [])
    if version in skipped:
        return FinalWait(True, f"the held-out evaluation of the final version v{version} was skipped (see the "
                               f"coordinator's log); {last}")
    if waited_s >= bound_s:
        return FinalWait(True, f"no held-out evaluation of the final version v{version} within {bound_s:.0f}s of the "
                               f"end of training (the verifier is busy or stopped); {last}")
    return FinalWait(False)


def _rejection_reasons(db: Path | str) -> dict[str, int]:
    """Refusals by reason code, read from the run's database so a demo says why anything was refused."""
    if isinstance(db, Path) and not db.exists():
        return {}
    store = Store(db)
    try:
        return rejection_counts(store)
    finally:
        store.close()


def _summarise(cfg: DemoConfig, status: dict[str, Any], procs: list[_Proc], wall: float,
               store_url: str | None = None) -> dict[str, Any]:
    by_id = {c["client_id"]: c for c in status["clients"]}
    clients = []
    for k, p in enumerate(procs):
        ident = load_identity((cfg.out / "clients" / p.name).resolve())
        row = by_id.get(ident.client_id, {})
        clients.append({"name": p.name, "backend": cfg.client_backend(k), "pid": p.proc.pid, "client_id": ident.client_id, "exit_code": p.proc.returncode,
                        "accepted": row.get("accepted", 0), "rejected": row.get("rejected", 0),
                        "credit": row.get("credit", 0.0)})
    evals = status["evals"]
    steps = status["steps"]
    return {
        "steps": len(status["reward_curve"]),
        "final_version": status["version"],
        "accepted": status["totals"]["accepted"],
        "rejected": status["totals"]["rejected"],
        "rejections_by_reason": _rejection_reasons(store_url or cfg.out / "run" / "coordinator.sqlite"),
        "store": "sqlite" if store_url is None else "postgresql",
        "reissued_jobs": status["totals"]["reissued_jobs"],
        "replicas": status["totals"].get("replicas", 0),  # credited second results of replicated jobs (in accepted)
        "reward_curve": status["reward_curve"],
        "eval_before": evals[0]["accuracy"] if evals else None,
        "eval_after": evals[-1]["accuracy"] if evals else None,
        "eval_after_version": evals[-1]["version"] if evals else None,  # the final version's, unless it was not done
        "eval_prompts": evals[-1]["n"] if evals else 0,
        "eval_curve": [{"version": e["version"], "accuracy": e["accuracy"]} for e in evals],
        "mean_step_s": sum(s["metrics"]["step_s"] for s in steps) / max(1, len(steps)),
        "learner_busy_s": status["learner"]["busy_s"],
        "wall_s": round(wall, 1),
        "task": cfg.task,
        "clients_count": len(clients),
        "clients": clients,
        "run_dir": str((cfg.out / "run").resolve()),
        # snapshot bytes out of the coordinator (HTTP + libp2p) against bytes clients served each other (p2p)
        "snapshot_egress": status.get("snapshot_egress", {}),
    }


def _print(summary: dict[str, Any], out: Path) -> None:
    table = Table(title=f"echo-swarm demo: {summary['task']}", show_header=False)
    table.add_row("learner steps", str(summary["steps"]))
    table.add_row("held-out accuracy", f"{summary['eval_before']:.3f} → {summary['eval_after']:.3f} "
                                       f"({summary['eval_prompts']} prompts never trained on)")
    curve = summary["reward_curve"]
    if curve:
        head, tail = curve[:10], curve[-10:]
        table.add_row("mean rollout reward", f"{sum(head) / len(head):.3f} (first 10 steps) → "
                                             f"{sum(tail) / len(tail):.3f} (last 10)")
    table.add_row("results accepted / refused", f"{summary['accepted']} / {summary['rejected']}")
    for c in summary["clients"]:
        table.add_row(f"  {c['name']} ({c['backend']}, pid {c['pid']})", f"{c['accepted']} accepted, credit {c['credit']:,.0f}")
    egress = summary.get("snapshot_egress") or {}
    if egress:
        table.add_row("snapshot bytes", f"{egress.get('coordinator_bytes', 0) / 1e6:,.1f} MB from the coordinator "
                                        f"(HTTP {egress.get('http_bytes', 0) / 1e6:,.1f}, libp2p "
                                        f"{egress.get('p2p_bytes', 0) / 1e6:,.1f}), "
                                        f"{egress.get('peer_bytes', 0) / 1e6:,.1f} MB served by peers")
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    console.print(table)
    console.print(f"wrote {out / 'summary.json'} and {out / 'reward_curve.png'}")
