"""`echo-swarm`: join a swarm as a volunteer, serve a coordinator, or run the local demo.

Commands hold no logic: they turn flags into a config object and call the role's ``run``. Heavy imports
(torch, transformers, aiohttp) happen inside the commands so that `--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from echo_swarm.admin_cli import admin_app
from echo_swarm.demo_tasks import DEMO_TASKS

app = typer.Typer(
    name="echo-swarm",
    help="RL post-training of language models on volunteer hardware.\n\n"
    "A coordinator hosts the GRPO learner and hands out signed rollout jobs; volunteers run `echo-swarm join` "
    "to generate rollouts on their own CPU or GPU. Start with `echo-swarm demo` to see both on one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(admin_app, name="admin")


JOIN_HELP = """Contribute this machine's compute to a coordinator's training run.

Creates an identity on first use, detects this machine's hardware, runs a few-second self-benchmark,
registers, then loops: lease a signed job, fetch and verify the policy version it names, generate, submit.
Ctrl-C releases the current job and exits. `echo-swarm client pause|resume|status` controls a running client.

Settings come from, highest precedence first: the flags given here, then the config file (TOML; default
client.toml in your user config dir, or $ECHO_SWARM_CONFIG, or --config), then the built-in defaults. Config
keys are the option names with underscores, e.g.:

    url = "http://coordinator.example:8470"\n
    threads = 4\n
    max_memory_gb = 6\n
    window = ["22:00-07:00"]\n
    idle_only = true

Exit codes: 0 done, 2 coordinator unreachable, 3 refused by the coordinator (e.g. banned), 4 this machine
lacks the memory or disk for the run's model.
"""


@app.command(help=JOIN_HELP)
def join(
    url: Annotated[Optional[str], typer.Argument(help="Coordinator URL, e.g. http://127.0.0.1:8470 (or `url` in "
                                                     "the config file).", show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="Client config file (TOML). Default: "
                                                   "client.toml in your user config dir, or $ECHO_SWARM_CONFIG.")] = None,
    home: Annotated[Optional[Path], typer.Option(help="Folder for this client's identity key, pinned coordinator "
                                                      "keys, snapshot cache and pause/status files. Default: your "
                                                      "user config dir (or $ECHO_SWARM_HOME).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="Generation backend: 'llama' (llama.cpp, fastest per "
                                                        "sequence; needs llama-cpp-python, built for Metal/CUDA/CPU "
                                                        "as the README explains), 'torch', or 'auto' (llama where "
                                                        "installed, else torch). (default: auto)")] = None,
    device: Annotated[Optional[str], typer.Option(help="'auto' picks CUDA, then Apple MPS, then CPU. "
                                                       "(default: auto)")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="CPU threads for generation (default: the "
                                                               "backend's choice).")] = None,
    gpu_layers: Annotated[Optional[int], typer.Option(min=0, help="Model layers to put on the GPU; 0 turns the GPU "
                                                                  "off (CPU only). The torch backend puts all or "
                                                                  "nothing on the GPU. [default: all, if a GPU is "
                                                                  "found]")] = None,
    max_memory_gb: Annotated[Optional[float], typer.Option(help="Memory ceiling in GiB. Before downloading a "
                                                               "model the client estimates its memory need "
                                                               "(file sizes × 1.2 + 0.5 GiB) and refuses one that "
                                                               "does not fit. (default: 80% of RAM)")] = None,
    min_free_disk_gb: Annotated[Optional[float], typer.Option(help="Refuse a download that would leave less free "
                                                                  "disk than this, in GiB. (default: 1)")] = None,
    cache_max_gb: Annotated[Optional[float], typer.Option(help="Cap on the snapshot cache, in GiB; the least "
                                                              "recently used versions are pruned. [default: no cap "
                                                              "beyond keeping the newest two versions]")] = None,
    idle_only: Annotated[Optional[bool], typer.Option("--idle-only/--always", help="Start a job only while the "
                                                      "machine is otherwise idle: at least --idle-min-percent of "
                                                      "CPU time idle over a 1 s sample between jobs (Linux "
                                                      "/proc/stat; elsewhere the load average). [default: "
                                                      "always]", show_default=False)] = None,
    idle_min_percent: Annotated[Optional[float], typer.Option(min=1, max=100, help="CPU idle share that counts as "
                                                                                  "idle. (default: 80)")] = None,
    window: Annotated[Optional[list[str]], typer.Option(help="Daily local-time window HH:MM-HH:MM in which new "
                                                             "jobs may start, e.g. 22:00-07:00 (repeat for "
                                                             "several). (default: any time)")] = None,
    benchmark: Annotated[Optional[bool], typer.Option("--benchmark/--no-benchmark", help="Run a few-second "
                                                      "self-benchmark at startup and report its tokens/s at "
                                                      "registration. (default: on)", show_default=False)] = None,
    panel: Annotated[Optional[bool], typer.Option("--panel/--no-panel", help="Live terminal panel, or plain log "
                                                  "lines. (default: panel when stdout is a terminal)",
                                                  show_default=False)] = None,
    name: Annotated[Optional[str], typer.Option(help="Display name shown on the coordinator's leaderboard.")] = None,
    max_jobs: Annotated[Optional[int], typer.Option(help="Exit after this many accepted results.")] = None,
    exit_when_finished: Annotated[Optional[bool], typer.Option("--exit-when-finished", help="Exit once the "
                                                               "coordinator's run has finished.")] = None,
    max_cpu_percent: Annotated[Optional[float], typer.Option(min=1, max=100, help="Use at most this share of time "
                                                             "for generation (1-100): the client idles between "
                                                             "decoding steps. (default: 100)")] = None,
    retries: Annotated[Optional[int], typer.Option(min=1, max=100, help="Attempts per request when the coordinator "
                                                   "is unreachable, with exponential backoff from 0.5 s to 30 s, "
                                                   "before giving up. (default: 8)")] = None,
    wait_for_coordinator: Annotated[Optional[float], typer.Option(min=0, max=86_400, help="Seconds to keep looking, "
                                                                  "every half second, for a coordinator that is "
                                                                  "not up yet (one being started) before the "
                                                                  "retries begin. (default: 0)")] = None,
    coordinator_key: Annotated[Optional[str], typer.Option(help="The coordinator's public key (hex) as published "
                                                                "by its operator. Without it, the key seen on "
                                                                "first contact is pinned (trust on first use).")] = None,
    invite: Annotated[Optional[str], typer.Option(help="Invite token from the operator of a private swarm (one "
                                                       "whose coordinator runs registration.mode = 'invite'). "
                                                       "Not needed for open swarms.", show_default=False)] = None,
    p2p: Annotated[Optional[bool], typer.Option("--p2p/--no-p2p", help="Fetch snapshot files from other volunteers "
                                                "over libp2p when the coordinator offers it (every piece is checked "
                                                "against the signed manifest; HTTP is the fallback). Needs the p2p "
                                                "extra. [default: off]", show_default=False)] = None,
    serve: Annotated[Optional[bool], typer.Option("--serve/--no-serve", help="With --p2p: serve verified snapshot "
                                                  "files to other volunteers. [default: serve]",
                                                  show_default=False)] = None,
    max_upload_gb: Annotated[Optional[float], typer.Option(help="With --p2p: stop serving peers after this many GB "
                                                           "uploaded in this session. [default: no cap]")] = None,
    p2p_jobs: Annotated[Optional[bool], typer.Option("--p2p-jobs/--no-p2p-jobs", help="With --p2p: send register, "
                                                     "lease, release and results to the coordinator's libp2p peer "
                                                     "(HTTP is the fallback). [default: off]",
                                                     show_default=False)] = None,
    p2p_coordinator: Annotated[Optional[list[str]], typer.Option(help="With --p2p: the coordinator peer's multiaddr, "
                                                                      "ending in /p2p/<peer id> (repeat for several). "
                                                                      "[default: what its GET /v1/p2p says]",
                                                                 show_default=False)] = None,
) -> None:
    from swarm_client.config import ClientConfigError, build
    from swarm_client.runner import run

    flags = dict(url=url, home=home, backend=backend, device=device, threads=threads, gpu_layers=gpu_layers,
                 max_memory_gb=max_memory_gb, min_free_disk_gb=min_free_disk_gb, cache_max_gb=cache_max_gb,
                 idle_only=idle_only, idle_min_percent=idle_min_percent, windows=window, benchmark=benchmark,
                 panel=panel, name=name, max_jobs=max_jobs, exit_when_finished=exit_when_finished,
                 max_cpu_percent=max_cpu_percent, retries=retries, wait_for_coordinator_s=wait_for_coordinator,
                 coordinator_key=coordinator_key,
                 invite=invite, p2p=p2p, p2p_serve=serve, p2p_max_upload_gb=max_upload_gb, p2p_jobs=p2p_jobs,
                 p2p_coordinator=p2p_coordinator)
    try:
        cfg = build(flags, config)
    except ClientConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(run(cfg))


client_app = typer.Typer(help="Control a running `echo-swarm join` on this machine: pause, resume, status.\n\n"
                              "Works through small files in the client home, so it needs no network and works "
                              "whether or not the client is running (a pause set while it is stopped applies "
                              "when it starts).", no_args_is_help=True)
app.add_typer(client_app, name="client")
HomeOption = Annotated[Optional[Path], typer.Option(help="The client home (as given to `join --home`). Default: "
                                                         "`home` in the client config file, else your user config "
                                                         "dir (or $ECHO_SWARM_HOME).")]


def _client_home(home: Optional[Path]) -> Path:
    from swarm_client.config import ClientConfigError, resolve_home

    try:
        return resolve_home(home)
    except ClientConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@client_app.command()
def pause(home: HomeOption = None) -> None:
    """Stop fetching new work within one poll (about a second). The job being generated, if any, is
    finished and submitted first. The pause lasts, across restarts, until `echo-swarm client resume`."""
    from swarm_client.control import set_paused

    set_paused(_client_home(home), True)
    typer.echo("paused: the client fetches no new work (a job in progress is finished first)")


@client_app.command()
def resume(home: HomeOption = None) -> None:
    """Start fetching work again within one poll."""
    from swarm_client.control import set_paused

    set_paused(_client_home(home), False)
    typer.echo("resumed: the client fetches work again")


@client_app.command()
def status(
    home: HomeOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Show whether the client runs, whether it is paused, its state, counters and credit."""
    import json

    from swarm_client.control import describe

    info = describe(_client_home(home))
    if json_out:
        typer.echo(json.dumps(info, indent=2))
        return
    if not info.get("client_id"):
        typer.echo(f"no client has run with home {info['home']} yet" + (" (paused)" if info["paused"] else ""))
        return
    state = info.get("state", "?") if info["running"] else "not running"
    typer.echo(f"client {info['client_id']}: {state}{' (paused)' if info['paused'] else ''}\n"
               f"  policy version {info.get('version')}, last job {info.get('last_job') or '-'}, "
               f"{info.get('tokens_per_s', 0):,.1f} tokens/s\n"
               f"  accepted {info.get('accepted', 0)}, rejected {info.get('rejected', 0)}, "
               f"credit {info.get('credit', 0):,.1f}")


@app.command()
def coordinator(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML run config (see docs/run-dir.md). "
                                                                         "Flags below override its keys.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Run directory: database, keys, snapshots, checkpoints.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Local Hugging Face model folder, or 'tiny'.")] = None,
    sync_mode: Annotated[Optional[str], typer.Option(help="sequential-pull (every rollout from the current policy), "
                                                          "async-push-pull (clients never wait; rollouts up to "
                                                          "--max-staleness versions old, importance-corrected), or "
                                                          "colocated (the learner generates its own rollouts).")] = None,
    max_staleness: Annotated[Optional[int], typer.Option(help="S for async-push-pull, in policy versions.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Listen address (0.0.0.0 to accept remote volunteers).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (0: any free port).")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Learner steps (policy versions) to train.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Learner learning rate.")] = None,
    lease_timeout: Annotated[Optional[float], typer.Option(help="Seconds before an unreturned job is reissued.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads for the learner.")] = None,
    layout: Annotated[Optional[str], typer.Option(help="processes (each role its own process, restarted if it "
                                                       "dies) or one-process.")] = None,
    verifiers: Annotated[Optional[int], typer.Option(help="Verifier processes to start (layout processes).")] = None,
    learner_ranks: Annotated[Optional[int], typer.Option(help="learner.world_size: FSDP ranks of the learner (one per "
                                                              "GPU; gloo processes on CPU).")] = None,
    verifier_placement: Annotated[Optional[str], typer.Option(help="verification.placement: replicas (each verifier "
                                                                   "one process with a whole replica) or fsdp "
                                                                   "(each verifier a group of --verifier-ranks "
                                                                   "FSDP ranks).")] = None,
    verifier_ranks: Annotated[Optional[int], typer.Option(help="verification.world_size: ranks of each verifier "
                                                               "with --verifier-placement fsdp.")] = None,
    role: Annotated[str, typer.Option(help="Run only this role of the run: api, learner, verifier or p2p (e.g. another "
                                           "verifier on another GPU: --role verifier --index 1 with "
                                           "verification.device set); 'all' runs every role.")] = "all",
    index: Annotated[int, typer.Option(help="With --role verifier: which verifier this is (0 runs the held-out "
                                            "evaluations). With --role api: which API process this is (several "
                                            "share one PostgreSQL store.url, each on its own port).")] = 0,
    store_url: Annotated[Optional[str], typer.Option(help="store.url: a postgresql://USER@HOST:PORT/DB "
                                                                 "database the roles share across hosts (unset: "
                                                                 "the run directory's SQLite file).")] = None,
    p2p: Annotated[Optional[bool], typer.Option("--p2p/--no-p2p", help="Run a libp2p peer: publish versions in a DHT "
                                                "and seed snapshot files to volunteers, who then serve each other "
                                                "(p2p.enabled; needs the p2p extra). [default: off]",
                                                show_default=False)] = None,
) -> None:
    """Serve a training run: the learner, job leasing, result verification and snapshot downloads.

    Restarting with the same run directory resumes at the last published policy version.
    """
    from coordinator.config import ConfigError, load_config
    from coordinator.launch.main import run

    try:
        cfg = load_config(config, {
            "run_dir": str(run_dir) if run_dir else None, "model.path": model, "server.host": host,
            "sync_mode": sync_mode, "max_staleness": max_staleness,
            "server.port": port, "learner.max_steps": max_steps, "learner.lr": lr,
            "jobs.lease_timeout_s": lease_timeout, "learner.threads": threads, "layout": layout,
            "verification.workers": verifiers, "store.url": store_url, "learner.world_size": learner_ranks,
            "verification.placement": verifier_placement, "verification.world_size": verifier_ranks,
            "p2p.enabled": p2p,
        })
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if role not in ("all", "api", "learner", "verifier", "p2p"):
        typer.echo(f"error: --role {role!r} is not a role; use all, api, learner, verifier or p2p", err=True)
        raise typer.Exit(2)
    raise typer.Exit(run(cfg, role, index))


@app.command()
def demo(
    clients: Annotated[int, typer.Option(help="Volunteer client processes to start.")] = 2,
    out: Annotated[Path, typer.Option(help="Output folder: summary.json, reward_curve.png, logs, run dir.")] = Path("demo-out"),
    steps: Annotated[int, typer.Option(help="Learner steps (policy versions) to train.")] = 200,
    port: Annotated[int, typer.Option(help="Coordinator port on 127.0.0.1 (0: any free port).")] = 0,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 840.0,
    sync_mode: Annotated[str, typer.Option(help="sequential-pull, async-push-pull or colocated (see `echo-swarm "
                                                "coordinator --help`).")] = "sequential-pull",
    max_staleness: Annotated[int, typer.Option(help="S for async-push-pull, in policy versions.")] = 2,
    backend: Annotated[str, typer.Option(help="Client backend: torch, llama (llama.cpp on GGUF snapshots), auto, "
                                              "or mixed (clients alternate torch and llama).")] = "torch",
    store: Annotated[str, typer.Option(help="The run's database: sqlite (a file in the run dir), postgresql (the "
                                            "demo starts a private PostgreSQL server; needs its OS package and "
                                            "echo-swarm[postgres]), or a postgresql://USER@HOST:PORT/DB URL.")
                     ] = "sqlite",
    task: Annotated[str, typer.Option(help="The task to train on: " + "; ".join(
        f"{name}: {row.help}" for name, row in DEMO_TASKS.items()) + ".")] = "addition",
    p2p: Annotated[bool, typer.Option("--p2p", help="Clients fetch snapshots from each other over libp2p (needs the "
                                                    "p2p extra); the summary reports coordinator egress against "
                                                    "bytes served by peers.")] = False,
) -> None:
    """Run the whole system on this machine: a coordinator and N clients as separate processes talking HTTP
    on 127.0.0.1, training the built-in tiny model on one of the built-in task types (--task). Prints a summary;
    writes summary.json and a reward-curve plot to --out.
    """
    from echo_swarm.demo import DemoConfig, run

    if task not in DEMO_TASKS:
        typer.echo(f"error: --task {task!r} is not a demo task; choose one of {', '.join(DEMO_TASKS)}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(run(DemoConfig(clients=clients, out=out, steps=steps, port=port, timeout_s=timeout,
                                    sync_mode=sync_mode, max_staleness=max_staleness, backend=backend,
                                    store=store, task=task, p2p=p2p)))


@app.command("build-tiny-model")
def build_tiny_model(
    cache_dir: Annotated[Optional[Path], typer.Option(help="Cache folder (default: user cache or $ECHO_SWARM_CACHE).")] = None,
) -> None:
    """Build (or find in the cache) the built-in tiny model and print its folder."""
    from echo_swarm.demo import build_model_with_progress

    typer.echo(build_model_with_progress(cache_dir))


def main() -> None:
    import logging

    from shared.safe_text import configure_logging

    # escaped, one line per record; the coordinator and join reconfigure it with their own level and format
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
