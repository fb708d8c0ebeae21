"""`echo-swarm`: join a swarm as a volunteer, serve a coordinator, or run the local demo.

Commands hold no logic: they turn flags into a config object and call the role's ``run``. The module a heavy
command runs (the client's runner, the coordinator, the demo: aiohttp, cryptography, numpy, the store) is imported
inside that command, one import each with its reason beside it, so that `--help` and the light commands start at
once; what this module imports at its top loads only the standard library, typer, rich and pydantic.
"""

from __future__ import annotations

import typing
from functools import reduce
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic.fields import FieldInfo
from typer.core import TyperCommand, TyperGroup, TyperOption

from coordinator.engine.family_models import BY_NAME as FAMILY_NAMES
from coordinator.engine.family_models import unknown_family
from echo_swarm.admin_cli import admin_app
from echo_swarm.argv import hoist_group_options
from echo_swarm.demo_tasks import DEMO_TASKS
from echo_swarm.flags import field_metavar, field_parser, value_type
from shared.exit_codes import MEANING, ExitCode, codes_text
from shared.safe_text import configure_logging, escape
from swarm_client.config import ClientConfigError, build, client_paths, resolve_home
from swarm_client.control import describe, parse_duration, pid_alive, set_paused, update_controls
from swarm_client.control import snooze as set_snooze
from swarm_client.panel import software_version
from swarm_client.service import ServiceNotStarted, ServiceSpec, install, join_argv, render, uninstall
from swarm_client.settings import FLAG_FIELDS, JoinConfig


def _bare_flags(command: Any, ctx: Any) -> None:
    """typer's rich help prints a flag's value type as if it took a value (`--p2p/--no-p2p <bool>`, `--help
    <bool>`): every flag of ``command`` and of the commands under it gets an empty metavar, printed instead."""
    for param in [*command.params, command.get_help_option(ctx)]:
        if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _bare_flags(sub, ctx)


class _Commands(TyperGroup):
    """The root command group: whatever it hands out (a command, the `client` or `admin` group and theirs) shows
    its flags as flags in --help."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _bare_flags(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _bare_flags(self, ctx)
        super().format_help(ctx, formatter)


app = typer.Typer(
    cls=_Commands,
    name="echo-swarm",
    help="RL post-training of language models on volunteer hardware.\n\n"
    "A coordinator hosts the GRPO learner and hands out signed rollout jobs; volunteers run `echo-swarm join` "
    "to generate rollouts on their own CPU or GPU. Start with `echo-swarm demo` to see both on one machine.\n\n"
    "Exit codes: " + codes_text() + ".",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(admin_app, name="admin")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"echo-swarm {software_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_show_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """RL post-training of language models on volunteer hardware."""


def _h(name: str) -> str:
    """A `join` flag's --help: the description of its JoinConfig field, the one source of the config file's keys,
    the flags and the options table in docs/client.md."""
    field = JoinConfig.model_fields[name]
    text = (field.description or "").replace("None = ", "unset: ").replace("None: ", "unset: ")
    default = field.get_default(call_default_factory=True)
    if field.is_required() or default in (None, "", []) or isinstance(default, bool) \
            or "default" in text.lower():
        return text  # a required or unset one says itself what happens
    return _with_default(text, default)


def _setting(flag: str, *decls: str, **options: Any) -> Any:
    """The `join` option ``--flag``, made from the JoinConfig field it sets (FLAG_FIELDS where the names differ):
    its help and, for a value, its type, bounds and choices (echo_swarm.flags), so that each is written once."""
    name = FLAG_FIELDS.get(flag, flag)
    field = JoinConfig.model_fields[name]
    kind = value_type(field)
    if kind is bool or typing.get_origin(kind) is list:  # a switch, or a repeated option checked with the model
        return typer.Option(*decls, help=_h(name), **options)
    return typer.Option(*decls, help=_h(name), parser=field_parser(lambda: field), metavar=field_metavar(field),
                        **options)


def _with_default(help_text: str, default: object) -> str:
    """``help_text`` ending in ``[default: …]`` as --help shows it: the bracket escaped, or rich (typer's help
    renderer) takes ``[default: 5]`` for a style tag and prints nothing."""
    return f"{help_text} \\[default: {default}]"


JOIN_HELP = f"""Contribute this machine's compute to a coordinator's training run.

Checks the coordinator first (a wrong URL fails at once, with a message that says what answered), creates an
identity on first use, detects this machine's hardware, runs a few-second self-benchmark, registers, then loops:
lease a signed job, fetch and verify the policy version it names, generate, submit. Once joined it waits out a
coordinator restart or a network outage (one line when lost, one when back), and when the run finishes it waits
for the operator's next run at the same URL. Ctrl-C releases the current job and exits. `echo-swarm client
pause|resume|snooze|finish|status|open` control a running client; `echo-swarm client install-service` runs it at
login.

Settings come from, highest precedence first: the flags given here, then the config file (TOML; default
client.toml in your user config dir, or $ECHO_SWARM_CONFIG, or --config), then the built-in defaults. Config
keys are the option names with underscores (a flag's own name or its setting's, e.g. wait_for_coordinator or
wait_for_coordinator_s), e.g.:

    url = "http://coordinator.example:8470"\n
    threads = 4\n
    max_memory_gb = 6\n
    window = ["22:00-07:00"]\n
    idle_only = true

Exit codes: {codes_text((ExitCode.OK, ExitCode.USAGE, ExitCode.REFUSED, ExitCode.RESOURCES, ExitCode.UNREACHABLE,
                        ExitCode.NOT_A_COORDINATOR))}.
"""


# The flags of `join`, declared here and nowhere else; their help comes from JoinConfig (swarm_client/settings.py)
@app.command(help=JOIN_HELP)
def join(
    url: Annotated[Optional[str], typer.Argument(help=_h("url"), show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="Client config file (TOML). Default: "
                                                   "client.toml in your user config dir, or $ECHO_SWARM_CONFIG.")] = None,
    home: Annotated[Optional[Path], _setting("home")] = None,
    backend: Annotated[Optional[str], _setting("backend")] = None,
    device: Annotated[Optional[str], _setting("device")] = None,
    precision: Annotated[Optional[str], _setting("precision")] = None,
    torch_dtype: Annotated[Optional[str], _setting("torch_dtype")] = None,
    threads: Annotated[Optional[int], _setting("threads")] = None,
    gpu_layers: Annotated[Optional[int], _setting("gpu_layers")] = None,
    max_memory_gb: Annotated[Optional[float], _setting("max_memory_gb")] = None,
    min_free_disk_gb: Annotated[Optional[float], _setting("min_free_disk_gb")] = None,
    cache_max_gb: Annotated[Optional[float], _setting("cache_max_gb")] = None,
    cache_dir: Annotated[Optional[Path], _setting("cache_dir")] = None,
    idle_only: Annotated[Optional[bool], _setting("idle_only", "--idle-only/--always", show_default=False)] = None,
    idle_min_percent: Annotated[Optional[float], _setting("idle_min_percent")] = None,
    idle_input_minutes: Annotated[Optional[float], _setting("idle_input_minutes")] = None,
    window: Annotated[Optional[list[str]], _setting("window")] = None,
    attach: Annotated[Optional[list[str]], _setting("attach")] = None,
    share: Annotated[Optional[float], _setting("share")] = None,
    keep_models: Annotated[Optional[bool], _setting("keep_models", "--keep-models/--unload-models",
                                                    show_default=False)] = None,
    pause_on_battery: Annotated[Optional[bool], _setting("pause_on_battery", "--pause-on-battery/--run-on-battery",
                                                         show_default=False)] = None,
    max_mbps: Annotated[Optional[float], _setting("max_mbps")] = None,
    max_gb_per_month: Annotated[Optional[float], _setting("max_gb_per_month")] = None,
    benchmark: Annotated[Optional[bool], _setting("benchmark", "--benchmark/--no-benchmark", show_default=False)] = None,
    panel: Annotated[Optional[bool], _setting("panel", "--panel/--no-panel", show_default=False)] = None,
    control_page: Annotated[Optional[bool], _setting("control_page", "--control-page/--no-control-page",
                                                     show_default=False)] = None,
    control_port: Annotated[Optional[int], _setting("control_port")] = None,
    log_level: Annotated[Optional[str], _setting("log_level")] = None,
    log_dir: Annotated[Optional[Path], _setting("log_dir")] = None,
    name: Annotated[Optional[str], _setting("name")] = None,
    team: Annotated[Optional[str], _setting("team")] = None,
    max_jobs: Annotated[Optional[int], _setting("max_jobs")] = None,
    exit_when_finished: Annotated[Optional[bool], _setting("exit_when_finished", "--exit-when-finished")] = None,
    max_cpu_percent: Annotated[Optional[float], _setting("max_cpu_percent")] = None,
    retries: Annotated[Optional[int], _setting("retries")] = None,
    give_up_after: Annotated[Optional[float], _setting("give_up_after")] = None,
    wait_for_coordinator: Annotated[Optional[float], _setting("wait_for_coordinator")] = None,
    coordinator_key: Annotated[Optional[str], _setting("coordinator_key")] = None,
    invite: Annotated[Optional[str], _setting("invite", show_default=False)] = None,
    p2p: Annotated[Optional[bool], _setting("p2p", "--p2p/--no-p2p", show_default=False)] = None,
    serve: Annotated[Optional[bool], _setting("serve", "--serve/--no-serve", show_default=False)] = None,
    max_upload_gb: Annotated[Optional[float], _setting("max_upload_gb")] = None,
    p2p_jobs: Annotated[Optional[bool], _setting("p2p_jobs", "--p2p-jobs/--no-p2p-jobs", show_default=False)] = None,
    p2p_coordinator: Annotated[Optional[list[str]], _setting("p2p_coordinator", show_default=False)] = None,
) -> None:
    flags = _join_flags(locals())  # first, so that it holds the parameters only
    from swarm_client.multirun import join  # lazy: the runner loads aiohttp, numpy and cryptography (~0.6 s)

    try:
        cfg = build(flags, config)
    except ClientConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    raise typer.Exit(join(cfg))


def _join_flags(params: dict[str, object]) -> dict[str, object]:
    """`join`'s parameters (by their Python names) as JoinConfig fields: a flag named differently from its field
    maps through FLAG_FIELDS, repeated options become lists; ``config`` (the file, not a setting) is left out. One
    mapping for `join` itself and for `client install-service`, which checks its --join-arg flags with it."""
    return {FLAG_FIELDS.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in params.items()
            if k != "config"}


client_app = typer.Typer(help="Control a running `echo-swarm join` on this machine: pause, resume, snooze, finish, "
                              "status, its control page, and the service that starts it at login.\n\n"
                              "Works through small files in the client home, so it needs no network and works "
                              "whether or not the client is running (a pause set while it is stopped applies "
                              "when it starts).", no_args_is_help=True)
app.add_typer(client_app, name="client")
HomeOption = Annotated[Optional[Path], typer.Option(help="The client home (as given to `join --home`). Default: "
                                                         "`home` in the client config file, else your user config "
                                                         "dir (or $ECHO_SWARM_HOME).")]
ConfigOption = Annotated[Optional[Path], typer.Option("--config", help="Client config file (TOML), as given to "
                                                      "`join --config`.")]


def _client_home(home: Optional[Path], config: Optional[Path] = None) -> Path:
    try:
        return resolve_home(home, config)
    except ClientConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None


@client_app.command()
def pause(home: HomeOption = None, config: ConfigOption = None) -> None:
    """Stop fetching new work within one poll (about a second). The job being generated, if any, is
    finished and submitted first. The pause lasts, across restarts, until `echo-swarm client resume`."""
    set_paused(_client_home(home, config), True)
    typer.echo("paused: the client fetches no new work (a job in progress is finished first)")


@client_app.command()
def resume(home: HomeOption = None, config: ConfigOption = None) -> None:
    """Start fetching work again within one poll (also ends a snooze)."""
    set_paused(_client_home(home, config), False)
    typer.echo("resumed: the client fetches work again")


@client_app.command()
def snooze(
    duration: Annotated[str, typer.Argument(help="How long: 30m, 2h, 1h30m, 90s (a bare number is minutes); at "
                                                 "most 7 days.")],
    home: HomeOption = None,
    config: ConfigOption = None,
) -> None:
    """No new work for a while (the job in hand is finished first), then work resumes by itself.
    `echo-swarm client resume` ends it early."""
    import datetime as dt

    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    until = set_snooze(_client_home(home, config), seconds)
    typer.echo(f"snoozed until {dt.datetime.fromtimestamp(until):%Y-%m-%d %H:%M}: no new work before then")


@client_app.command()
def finish(home: HomeOption = None, config: ConfigOption = None) -> None:
    """Finish the job in hand, submit its result, then exit (exit code 0: a service is not restarted)."""
    where = _client_home(home, config)
    if not describe(where)["running"]:
        typer.echo(f"error: no client is running with home {where}; nothing to finish", err=True)
        raise typer.Exit(ExitCode.FAILED)
    update_controls(where, finish=True)
    typer.echo("finishing: the client submits the job in hand, then exits")


@client_app.command()
def status(
    home: HomeOption = None,
    config: ConfigOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Show whether the client runs, whether it is paused or snoozed, its state, counters and credit."""
    import datetime as dt
    import json

    info = describe(_client_home(home, config))
    if json_out:
        typer.echo(json.dumps(info, indent=2))
        return
    if not info.get("client_id"):
        typer.echo(f"no client has run with home {info['home']} yet" + (" (paused)" if info["paused"] else ""))
        return
    state = info.get("state", "?") if info["running"] else "not running"
    # the controls in force, each said once: a running client that obeyed a pause or snooze already says so in its
    # state ("paused", "snoozed until 14:00"); before it has, or while it finishes a job, the note says what comes
    held = ""
    if info["paused"] and not state.startswith("paused"):
        held += " (paused: no new job after this one)" if info["running"] else " (paused)"
    if info.get("snoozed_until"):
        snooze = f"snoozed until {dt.datetime.fromtimestamp(info['snoozed_until']):%H:%M}"
        held += "" if state.startswith(snooze) else f" ({snooze})"
    if info.get("finishing") and info["running"]:
        held += " (finishing)"
    typer.echo(f"client {info['client_id']}: {state}{held}\n"
               f"  coordinator {info.get('url') or '-'}, run {info.get('run_id') or '-'}\n"
               f"  policy version {info.get('version')}, last job {info.get('last_job') or '-'}, "
               f"{info.get('tokens_per_s', 0):,.1f} tokens/s\n"
               f"  accepted {info.get('accepted', 0)}, rejected {info.get('rejected', 0)}, "
               f"credit {info.get('credit', 0):,.1f}" + (f"\n  data {info['bandwidth']}" if info.get("bandwidth") else ""))
    for run in info.get("runs") or []:  # with --attach: every run of this client, by share
        if isinstance(run, dict):
            typer.echo(f"  run at {escape(str(run.get('url', '?')))}: share {run.get('share', 1):g} "
                       f"({100 * float(run.get('work_fraction', 0) or 0):.0f} % of the work so far), "
                       f"{escape(str(run.get('state', '?')))}, accepted {run.get('accepted', 0)}, credit "
                       f"{float(run.get('credit', 0) or 0):,.1f}")
    typer.echo(_lifetime_text(info.get("lifetime") or {}))
    for notice in info.get("notices") or []:  # the coordinator's notices in force, as the client last saw them
        if isinstance(notice, dict):
            typer.echo(f"  {escape(str(notice.get('line', '')))}")
    if not info["running"]:  # how the last run ended: a service client stopped by a ban has only this to say it
        typer.echo(_stop_text(info))


def _lifetime_text(life: dict[str, Any]) -> str:
    """``lifetime: 12,345 credit, 67 results accepted over 3 runs since 2026-11-02`` and the latest runs, one a
    line (swarm_client/lifetime.py)."""
    import datetime as dt

    total = life.get("total") or {}
    if not total.get("runs"):
        return "  lifetime: no run yet"
    since = f" since {dt.datetime.fromtimestamp(total['since']):%Y-%m-%d}" if total.get("since") else ""
    runs = total["runs"]
    lines = [f"  lifetime: {total.get('credit', 0):,.0f} credit, {total.get('accepted', 0):,} results accepted over "
             f"{runs} run{'s' if runs != 1 else ''}{since}"]
    for run in life.get("runs") or []:
        lines.append(f"    run {escape(str(run.get('run_id', '?')))} at {escape(str(run.get('url', '?')))}: "
                     f"{run.get('accepted', 0):,} accepted, {run.get('rejected', 0):,} refused, credit "
                     f"{run.get('credit', 0):,.0f} (last {dt.datetime.fromtimestamp(run.get('last_at', 0)):%Y-%m-%d %H:%M})")
    return "\n".join(lines)


def _stop_text(info: dict[str, Any]) -> str:
    """``last stop: exit 3 (refused by the coordinator …)`` and the reason the client gave, indented."""
    code = info.get("exit_code")
    try:
        meaning = MEANING[ExitCode(code)].removeprefix("join: ") if isinstance(code, int) else ""
    except ValueError:
        meaning = ""
    head = f"  last stop: exit {code}" + (f" ({meaning})" if meaning else "") if code is not None else \
        "  last stop: unknown (the client did not record how it ended: killed, or an older version)"
    reason = str(info.get("stop_reason") or "")
    return head + "".join(f"\n    {escape(line)}" for line in reason.split("\n") if line.strip())


@client_app.command("open")
def open_page(
    home: HomeOption = None,
    config: ConfigOption = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the URL (with its token) instead of opening a "
                                                             "browser.")] = False,
) -> None:
    """Open the running client's control page (127.0.0.1 only) in your browser."""
    import webbrowser

    # lazy: the control page's module loads aiohttp (~0.3 s), which no other light command needs
    from swarm_client.webcontrol import load_or_create_token, page_info

    where = _client_home(home, config)
    info = page_info(where)
    if info is None or not pid_alive(info.get("pid")):
        typer.echo(f"error: no client with a control page is running with home {where}: start `echo-swarm join` "
                   f"(without --no-control-page)", err=True)
        raise typer.Exit(ExitCode.FAILED)
    url = f"{info['url']}?token={load_or_create_token(where)}"
    if print_only or not webbrowser.open(url):
        typer.echo(url)
    else:
        typer.echo(f"opened {info['url']} in your browser")


@client_app.command("install-service")
def install_service(
    url: Annotated[Optional[str], typer.Argument(help="Coordinator URL (default: `url` in the config file).",
                                                 show_default=False)] = None,
    home: HomeOption = None,
    config: ConfigOption = None,
    start: Annotated[bool, typer.Option("--start/--no-start", help="Enable and start it now (else only write "
                                                                   "it).")] = True,
    print_only: Annotated[bool, typer.Option("--print", help="Print the unit (or agent) instead of installing "
                                                             "it.")] = False,
    extra: Annotated[Optional[list[str]], typer.Option("--join-arg", help="A further argument for `join` (repeat), "
                                                       "e.g. --join-arg=--idle-only.")] = None,
) -> None:
    """Run `echo-swarm join` at login, restarted after a failure: a systemd user unit (Linux) or a launchd agent
    (macOS), with this installation's Python and your client settings."""
    # the settings must be valid now, not at the first boot: the --join-arg flags are parsed as `join` parses
    # them and, with the URL, home and config file, validated as `join` validates them
    join_args = [*([url] if url else []), *(["--home", str(home)] if home is not None else []), *(extra or [])]
    try:
        params = typer.main.get_group(app).commands["join"].make_context("join", join_args).params
        build(_join_flags(params), params.get("config") or config)
    except typer.TyperException as exc:  # click's parse errors (an unknown flag, a bad value), which name the flag
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)  # in their format_message
        typer.echo(f"error: --join-arg: {message}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    except ClientConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    paths = client_paths(home, config)
    spec = ServiceSpec(join_argv(url, config, home, list(extra or [])), paths.home, paths.logs)
    if print_only:
        typer.echo(render(spec).decode(), nl=False)
        return
    paths.logs.mkdir(parents=True, exist_ok=True)
    try:
        done, problem = install(spec, start=start), None
    except ServiceNotStarted as exc:  # the unit is written, but nothing runs it: say so, and fail
        done, problem = exc.done, exc
    for line in done:
        typer.echo(line)
    if problem is not None:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(ExitCode.FAILED)


@client_app.command("uninstall-service")
def uninstall_service() -> None:
    """Stop the service `install-service` set up and remove its unit (or agent). Settings, identity and credit
    stay."""
    for line in uninstall():
        typer.echo(line)


@app.command()
def env(
    home: HomeOption = None,
    config: ConfigOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """What to paste into a bug report: versions, backends, devices and paths (imports no heavy library)."""
    import json

    # lazy: the report imports the backends and the control page (numpy, aiohttp), which --help never needs
    from echo_swarm import envreport

    data = envreport.report(home, config)
    typer.echo(json.dumps(data, indent=2) if json_out else envreport.render(data))


def _needs_coordinator_extra(command: str) -> None:
    """`coordinator` and `demo` need the learner's libraries, which a client-only install lacks: say so."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        typer.echo(f"error: `echo-swarm {command}` needs the coordinator's libraries ({', '.join(missing)} missing): "
                   f"pip install 'echo-swarm[coordinator]'", err=True)
        raise typer.Exit(ExitCode.USAGE)


# `coordinator`'s flags, each the run-config key it sets (coordinator/config/): flags override the config file
COORDINATOR_KEYS = {
    "run_dir": "run_dir", "model": "model.path", "sync_mode": "sync_mode", "max_staleness": "max_staleness",
    "host": "server.host", "port": "server.port", "max_steps": "learner.max_steps", "lr": "learner.lr",
    "lease_timeout": "jobs.lease_timeout_s", "threads": "learner.threads", "layout": "layout",
    "verifiers": "verification.workers", "store_url": "store.url", "learner_ranks": "learner.world_size",
    "verifier_placement": "verification.placement", "verifier_ranks": "verification.world_size",
    "p2p": "p2p.enabled", "correction": "learner.correction",
}


def _run_config() -> Any:
    """The run config's model, CoordinatorConfig."""
    # lazy: the run config's models (~0.2 s to import), which no command but `coordinator` needs
    from coordinator.config import CoordinatorConfig

    return CoordinatorConfig


def run_field(key: str) -> FieldInfo:
    """The run-config field a dotted key names ('learner.lr'), through the sections' models."""
    model = _run_config()
    *sections, name = key.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    return model.model_fields[name]  # type: ignore[no-any-return]


def _run_option(flag: str, *decls: str, **options: Any) -> Any:
    """The `coordinator` option ``--flag`` for the run-config key it sets (COORDINATOR_KEYS): its value validated as
    that key's field validates it (type, bounds, choices; echo_swarm.flags), resolved only when a value is given."""
    return typer.Option(*decls, parser=field_parser(lambda: run_field(COORDINATOR_KEYS[flag])), **options)


class _CoordinatorCommand(TyperCommand):
    """`coordinator --help` shows each flag's help, value type, bounds and default from the run-config field it sets
    (a flag's Python default is None, so that an unset flag leaves the config file's key alone). Read when help is
    shown, since loading coordinator.config costs ~0.2 s that no other use of the command line should pay."""

    _from_fields = False

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if not self._from_fields:
            built_in = _run_config()()  # every key at its built-in default
            for param in self.params:
                if not isinstance(param, TyperOption) or param.name not in COORDINATOR_KEYS:
                    continue
                key = COORDINATOR_KEYS[param.name]
                field = run_field(key)
                param.help = (field.description or "").replace("[", "\\[") + f" (config key {key})"
                if not param.is_flag:
                    param.metavar = field_metavar(field)
                value = reduce(getattr, key.split("."), built_in)
                if isinstance(value, bool):
                    value = param.opts[0] if value else param.secondary_opts[0]
                if value is not None:
                    param.help = _with_default(param.help, value)
            self._from_fields = True
        super().format_help(ctx, formatter)


@app.command(cls=_CoordinatorCommand)
def coordinator(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML run config (see docs/run-dir.md). "
                                                                         "Flags below override its keys.")] = None,
    run_dir: Annotated[Optional[Path], _run_option("run_dir")] = None,
    model: Annotated[Optional[str], _run_option("model")] = None,
    sync_mode: Annotated[Optional[str], _run_option("sync_mode")] = None,
    max_staleness: Annotated[Optional[int], _run_option("max_staleness")] = None,
    correction: Annotated[Optional[str], _run_option("correction")] = None,
    host: Annotated[Optional[str], _run_option("host")] = None,
    port: Annotated[Optional[int], _run_option("port")] = None,
    max_steps: Annotated[Optional[int], _run_option("max_steps")] = None,
    lr: Annotated[Optional[float], _run_option("lr")] = None,
    lease_timeout: Annotated[Optional[float], _run_option("lease_timeout")] = None,
    threads: Annotated[Optional[int], _run_option("threads")] = None,
    layout: Annotated[Optional[str], _run_option("layout")] = None,
    verifiers: Annotated[Optional[int], _run_option("verifiers")] = None,
    learner_ranks: Annotated[Optional[int], _run_option("learner_ranks")] = None,
    verifier_placement: Annotated[Optional[str], _run_option("verifier_placement")] = None,
    verifier_ranks: Annotated[Optional[int], _run_option("verifier_ranks")] = None,
    role: Annotated[str, typer.Option(help="Run only this role of the run: api, learner, verifier or p2p (e.g. another "
                                           "verifier on another GPU: --role verifier --index 1 with "
                                           "verification.device set); 'all' runs every role.")] = "all",
    index: Annotated[int, typer.Option(help="With --role verifier: which verifier this is (0 runs the held-out "
                                            "evaluations). With --role api: which API process this is (several "
                                            "share one PostgreSQL store.url, each on its own port).")] = 0,
    store_url: Annotated[Optional[str], _run_option("store_url")] = None,
    p2p: Annotated[Optional[bool], typer.Option("--p2p/--no-p2p", show_default=False)] = None,
) -> None:
    """Serve a training run: the learner, job leasing, result verification and snapshot downloads.

    Restarting with the same run directory resumes at the last published policy version. Before any role starts,
    the port, the model folder, the run directory and the free disk are checked; a problem is one line on stderr
    and its own exit code (see `echo-swarm --help`), and nothing is written.
    """
    _needs_coordinator_extra("coordinator")
    # lazy: serve loads the whole coordinator (aiohttp, the store, prometheus_client; ~0.6 s)
    from echo_swarm.serve import serve

    flags = {"run_dir": str(run_dir) if run_dir else None, "model": model, "sync_mode": sync_mode,
             "max_staleness": max_staleness, "correction": correction, "host": host, "port": port, "max_steps": max_steps, "lr": lr,
             "lease_timeout": lease_timeout, "threads": threads, "layout": layout, "verifiers": verifiers,
             "store_url": store_url, "learner_ranks": learner_ranks, "verifier_placement": verifier_placement,
             "verifier_ranks": verifier_ranks, "p2p": p2p}
    raise typer.Exit(serve(config, {COORDINATOR_KEYS[name]: value for name, value in flags.items()}, role, index))


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
    lr: Annotated[Optional[float], typer.Option(help="The learner's learning rate (default: the task's own, "
                                                     "sized for the tiny model).", show_default=False)] = None,
    model_family: Annotated[Optional[str], typer.Option(help="Train a small model of this family instead of the "
                                                             "tiny one, warm-started on addition like it (built "
                                                             "and cached on first use): " + ", ".join(FAMILY_NAMES)
                                                             + ".", show_default=False)] = None,
) -> None:
    """Run the whole system on this machine: a coordinator and N clients as separate processes talking HTTP
    on 127.0.0.1, training the built-in tiny model on one of the built-in task types (--task). Prints a summary;
    writes summary.json and a reward-curve plot to --out.
    """
    _needs_coordinator_extra("demo")
    from echo_swarm.demo import DemoConfig, run  # lazy: the demo loads the store and the tiny model's numpy

    if task not in DEMO_TASKS:
        typer.echo(f"error: --task {task!r} is not a demo task; choose one of {', '.join(DEMO_TASKS)}", err=True)
        raise typer.Exit(ExitCode.USAGE)
    if model_family is not None and model_family not in FAMILY_NAMES:
        typer.echo(f"error: --model-family {unknown_family(model_family)}", err=True)
        raise typer.Exit(ExitCode.USAGE)
    raise typer.Exit(run(DemoConfig(clients=clients, out=out, steps=steps, port=port, timeout_s=timeout,
                                    sync_mode=sync_mode, max_staleness=max_staleness, backend=backend,
                                    store=store, task=task, p2p=p2p, model_family=model_family, lr=lr)))


@app.command("build-tiny-model")
def build_tiny_model(
    cache_dir: Annotated[Optional[Path], typer.Option(help="Cache folder (default: user cache or $ECHO_SWARM_CACHE).")] = None,
) -> None:
    """Build (or find in the cache) the built-in tiny model and print its folder."""
    from echo_swarm.demo import build_model_with_progress  # lazy: as in `demo` (numpy, the store)

    typer.echo(build_model_with_progress(cache_dir))


def main() -> None:
    import logging
    import sys

    # escaped, one line per record; the coordinator and join reconfigure it with their own level and format
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    # a group's options may come after its subcommand (`admin status --run-dir X`), as people type them
    app(args=hoist_group_options(typer.main.get_command(app), sys.argv[1:]), prog_name="echo-swarm")


if __name__ == "__main__":
    main()
