"""`echo-swarm`: join a swarm as a volunteer, serve a coordinator, or run the local demo.

Commands hold no logic: they turn flags into a config object and call the role's ``run``. Heavy imports
(torch, transformers, aiohttp) happen inside the commands so that `--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="echo-swarm",
    help="RL post-training of language models on volunteer hardware.\n\n"
    "A coordinator hosts the GRPO learner and hands out signed rollout jobs; volunteers run `echo-swarm join` "
    "to generate rollouts on their own CPU or GPU. Start with `echo-swarm demo` to see both on one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def join(
    url: Annotated[str, typer.Argument(help="Coordinator URL, e.g. http://127.0.0.1:8470")],
    home: Annotated[Optional[Path], typer.Option(help="Folder for this client's identity key, pinned coordinator "
                                                      "keys and snapshot cache. Default: your user config dir "
                                                      "(or $ECHO_SWARM_HOME).")] = None,
    backend: Annotated[str, typer.Option(help="Generation backend: 'llama' (llama.cpp, fastest per sequence; "
                                              "needs llama-cpp-python, built for Metal/CUDA/CPU as the README "
                                              "explains), 'torch', or 'auto' (llama where installed, else torch).")] = "auto",
    n_gpu_layers: Annotated[Optional[int], typer.Option(help="llama backend: layers to offload to the GPU "
                                                             "(-1: all). Default: all, or none with --device cpu.")] = None,
    device: Annotated[str, typer.Option(help="'auto' picks CUDA, then Apple MPS, then CPU.")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for generation (default: torch's choice).")] = None,
    name: Annotated[str, typer.Option(help="Display name shown on the coordinator's leaderboard.")] = "",
    max_jobs: Annotated[Optional[int], typer.Option(help="Exit after this many accepted results.")] = None,
    exit_when_finished: Annotated[bool, typer.Option(help="Exit once the coordinator's run has finished.")] = False,
    max_cpu_percent: Annotated[float, typer.Option(min=1, max=100, help="Use at most this share of time for generation "
                                                        "(1-100): the client idles between decoding steps.")] = 100.0,
    retries: Annotated[int, typer.Option(min=1, max=100, help="Attempts per request when the coordinator is unreachable, with "
                                              "exponential backoff from 0.5 s to 30 s, before giving up.")] = 8,
    coordinator_key: Annotated[Optional[str], typer.Option(help="The coordinator's public key (hex) as published "
                                                                "by its operator. Without it, the key seen on "
                                                                "first contact is pinned (trust on first use).")] = None,
) -> None:
    """Contribute this machine's compute to a coordinator's training run.

    Creates an identity on first use, registers, then loops: lease a signed job, fetch and verify the policy
    version it names, generate, submit. Ctrl-C releases the current job and exits.
    """
    from swarm_client.identity import default_home
    from swarm_client.runner import JoinConfig, run

    cfg = JoinConfig(url=url, home=home or default_home(), backend=backend, device=device, threads=threads, name=name,
                     max_jobs=max_jobs, exit_when_finished=exit_when_finished, max_cpu_percent=max_cpu_percent,
                     retries=retries, coordinator_key=coordinator_key, n_gpu_layers=n_gpu_layers)
    raise typer.Exit(run(cfg))


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
) -> None:
    """Serve a training run: the learner, job leasing, result verification and snapshot downloads.

    Restarting with the same run directory resumes at the last published policy version.
    """
    from coordinator.config import ConfigError, load_config
    from coordinator.main import run

    try:
        cfg = load_config(config, {
            "run_dir": str(run_dir) if run_dir else None, "model.path": model, "server.host": host,
            "sync_mode": sync_mode, "max_staleness": max_staleness,
            "server.port": port, "learner.max_steps": max_steps, "learner.lr": lr,
            "jobs.lease_timeout_s": lease_timeout, "learner.threads": threads,
        })
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(run(cfg))


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
) -> None:
    """Run the whole system on this machine: a coordinator and N clients as separate processes talking HTTP
    on 127.0.0.1, training the built-in tiny model on arithmetic. Prints a summary; writes summary.json and
    a reward-curve plot to --out.
    """
    from echo_swarm.demo import DemoConfig, run

    raise typer.Exit(run(DemoConfig(clients=clients, out=out, steps=steps, port=port, timeout_s=timeout,
                                    sync_mode=sync_mode, max_staleness=max_staleness, backend=backend)))


@app.command("build-tiny-model")
def build_tiny_model(
    cache_dir: Annotated[Optional[Path], typer.Option(help="Cache folder (default: user cache or $ECHO_SWARM_CACHE).")] = None,
) -> None:
    """Build (or find in the cache) the built-in tiny model and print its folder."""
    from echo_swarm.demo import build_model_with_progress

    typer.echo(build_model_with_progress(cache_dir))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
