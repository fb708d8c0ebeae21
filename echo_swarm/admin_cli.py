"""`echo-swarm admin ...`: the operator's console for a running coordinator.

Every command signs its request with an operator key (see `echo-swarm admin --help`) and prints a rich table,
or the coordinator's JSON reply with ``--json`` (for scripts). Commands only parse flags and render; the
protocol lives in :mod:`echo_swarm.admin_client`.

Every string in a reply is data, never markup: names, devices and platforms come from volunteers (an old database
may hold any text), so each value is rendered as a rich ``Text`` (markup such as ``[/]`` or ``[link=...]`` is
printed as written) with control characters shown escaped (shared.safe_text), so that no escape sequence from a
reply reaches the terminal. ``--json`` output is JSON-escaped by ``json.dumps``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shared.exit_codes import ExitCode, codes_text
from shared.safe_text import escape

console = Console()
# errors on stderr, so a script reading --json output never parses one; soft-wrapped (no line breaks of rich's
# own: the terminal wraps), so a path or URL in a message stays whole in a log or a pipe
errors = Console(stderr=True, soft_wrap=True)

admin_app = typer.Typer(
    name="admin",
    help="Administer a running coordinator: status, clients, bans, versions, jobs, the results audit, "
    "checkpoints, pausing job issue, and operator keys.\n\n"
    "Requests are signed with an operator key listed in the run directory's `admin_keys` file. On the "
    "coordinator's machine `--run-dir DIR` is enough (the URL comes from DIR/endpoint.json, the key from "
    "DIR/admin.key, both created by the coordinator). From elsewhere pass --url and --key.\n\n"
    "Exit codes: " + codes_text((ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE)) + ".",
    no_args_is_help=True,
)
keys_app = typer.Typer(help="Operator keys: list them (and the coordinator's own signing key), add, remove, "
                            "rotate, or generate a key file for a new operator.", no_args_is_help=True)
admin_app.add_typer(keys_app, name="keys")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the coordinator's reply as JSON instead of a table "
                                                      "(stable field names, for scripts).")]
LimitOpt = Annotated[int, typer.Option(min=1, max=10_000, help="Show at most this many rows.")]


@dataclass
class _Target:
    url: Optional[str]
    run_dir: Optional[Path]
    key: Optional[Path]
    timeout: float


def _fail(message: str, code: ExitCode = ExitCode.FAILED) -> NoReturn:
    """One line on stderr and the exit code: USAGE (2) when the command line is wrong and nothing was sent (the
    README's table of codes), FAILED (1) when the coordinator refused or could not be reached."""
    errors.print(Text.assemble(("error:", "red"), " ", _text(message)), highlight=False)
    raise typer.Exit(code)


def _text(value: Any, style: str = "") -> Text:
    """A value from a reply as a rich Text: never parsed as markup, control characters escaped."""
    return Text(escape("-" if value is None else str(value)), style=style)


def _say(message: str) -> None:
    """One line of output built from reply values: printed as plain text, never as markup."""
    console.print(_text(message), soft_wrap=True)


def _row(table: Table, *cells: Any) -> None:
    table.add_row(*(c if isinstance(c, Text) else _text(c) for c in cells))


@admin_app.callback()
def _options(
    ctx: typer.Context,
    run_dir: Annotated[Optional[Path], typer.Option(help="The coordinator's run directory (on its machine): the "
                                                         "URL is read from DIR/endpoint.json and the operator key "
                                                         "from DIR/admin.key.")] = None,
    url: Annotated[Optional[str], typer.Option(help="Coordinator URL, e.g. http://10.0.0.5:8470 (overrides "
                                                    "--run-dir; or set $ECHO_SWARM_ADMIN_URL).")] = None,
    key: Annotated[Optional[Path], typer.Option(help="Operator private key file (mode 0600) whose public key is "
                                                     "listed in the run's admin_keys (overrides --run-dir; or set "
                                                     "$ECHO_SWARM_ADMIN_KEY).")] = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for each reply (a checkpoint of a large "
                                                       "model can take a while).")] = 60.0,
) -> None:
    ctx.obj = _Target(url, run_dir, key, timeout)


def _run(ctx: typer.Context, fn: str, *args: Any, **kwargs: Any) -> Any:
    """Open a client for the target the group's options name, make one call (``fn``: a method of the client, or of
    one of its parts, e.g. "keys.rotate"), return its reply. Each failure is one line on stderr: a wrong command
    line (no coordinator named, an unreadable key, a bad argument) exits 2 and sends nothing; a refusal or an
    unreachable coordinator exits 1."""
    # lazy: admin_client signs with cryptography (~0.3 s), which `echo-swarm --help` and `join` never load
    from echo_swarm.admin_client import AdminClient, AdminError, AdminUsageError

    target: _Target = ctx.obj
    try:
        client = AdminClient.open(target.url, target.run_dir, target.key, target.timeout)
        call: Any = client
        for part in fn.split("."):
            call = getattr(call, part)
        return call(*args, **kwargs)
    except AdminUsageError as exc:
        _fail(str(exc), ExitCode.USAGE)
    except AdminError as exc:
        _fail(str(exc))


def _dump(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _ago(at: Optional[float]) -> str:
    if at is None:
        return "-"
    s = max(0.0, time.time() - at)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _num(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


@admin_app.command()
def status(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """The run at a glance: version, sync mode, learner, jobs, clients, totals, and whether issuing is paused."""
    s = _run(ctx, "status")
    if as_json:
        return _dump(s)
    t = Table(title=_text(f"run {s['run_id']}"), show_header=False)
    _row(t, "policy version", f"{s['version']} / {s['max_steps']}" + ("  (finished)" if s["finished"] else ""))
    _row(t, "sync mode", f"{s['sync_mode']} (max staleness {s['max_staleness']})")
    _row(t, "issuing", _text("PAUSED", "yellow") if s["issuing_paused"] else "running")
    _row(t, "held-out accuracy", _num(s["heldout_accuracy"]))
    if s["last_step"]:
        _row(t, "last step", f"{s['last_step']['step']}: mean reward {s['last_step']['mean_reward']:.3f}, "
                             f"{_ago(s['last_step']['at'])}")
    j = s["jobs"]
    _row(t, "jobs", ", ".join(f"{k} {v}" for k, v in j["counts"].items()) + f"; reissued {j['reissued']}; "
                    f"buffered results {j['buffered_results']}")
    c = s["clients"]
    _row(t, "clients", f"{c['total']} registered: " + ", ".join(f"{k} {v}" for k, v in c["by_state"].items()))
    tot = s["totals"]
    _row(t, "results", f"{tot['accepted']} accepted, {tot['rejected']} refused, {tot['too_stale']} too stale, "
                       f"{tot['tokens']:,} tokens")
    if s["rejections_by_reason"]:
        _row(t, "refusals", ", ".join(f"{k} {v}" for k, v in s["rejections_by_reason"].items()))
    if s["learner"].get("last_error"):
        _row(t, "learner error", _text(s["learner"]["last_error"], "red"))
    console.print(t)


# The columns of `admin clients`, in order: (header, right-aligned, width when squeezed, drop rank). When the whole
# table does not fit the terminal, the long texts (name, device, platform) are cut short with an ellipsis, then the
# columns with the highest drop rank go, until it fits: the id, state and counts stay longest.
_CLIENT_COLUMNS: tuple[tuple[str, bool, int, int], ...] = (
    ("client", False, 8, 0), ("name", False, 16, 1), ("state", False, 12, 0), ("valid", True, 24, 5),
    ("backend", False, 8, 3), ("device", False, 24, 6), ("platform", False, 18, 7), ("accepted", True, 12, 1),
    ("rejected", True, 12, 2), ("unreturned", True, 12, 4), ("reward z", True, 8, 4), ("dropped z", True, 9, 4),
    ("credit", True, 14, 1),
    ("last seen", True, 10, 2),
)
_GAP = 2  # spaces between two columns (a table without a box)


def _fit_columns(cells: dict[str, list[Text]], width: int) -> dict[str, int | None]:
    """The columns of ``cells`` to show in ``width`` terminal cells, each with its width limit (None: as wide as
    its widest cell): every column whole when that fits, else squeezed, dropping whole columns by rank rather than
    wrapping every cell into a tower of fragments."""
    spec = {name: (squeezed, rank) for name, _, squeezed, rank in _CLIENT_COLUMNS}
    full = {name: max(len(name), *(c.cell_len for c in col)) for name, col in cells.items()}

    def fits(names: list[str], widths: dict[str, int]) -> bool:
        return sum(widths[n] for n in names) + _GAP * (len(names) - 1) <= width

    if fits(list(cells), full):
        return dict.fromkeys(cells)
    need = {name: min(spec[name][0], w) for name, w in full.items()}
    shown, dropped = list(cells), []
    while len(shown) > 1 and not fits(shown, need):
        dropped.append(max(shown, key=lambda n: (spec[n][1], shown.index(n))))
        shown.remove(dropped[-1])
    for name in reversed(dropped):  # a narrow column dropped before a wide one may fit in what is left
        if fits([*shown, name], need):
            shown.append(name)
    return {name: spec[name][0] for name in cells if name in shown}


@admin_app.command()
def clients(ctx: typer.Context, as_json: JsonFlag = False, limit: LimitOpt = 1000) -> None:
    """Every registered client: state, trust (valid results of those checked, when the coordinator keeps it),
    backend, device, platform, counts, credit, and its reporting: the share of its leases that ended without a
    result (unreturned), and how the rewards of what it returned compare with the other volunteers' at the same
    versions (reward z; selective reporting, docs/security.md). A terminal too narrow for every column shows the
    most useful ones and names the rest; --json has them all."""
    rows = _run(ctx, "clients", limit)
    if as_json:
        return _dump(rows)
    has_trust = any("trust" in r for r in rows)
    has_reporting = any("reporting" in r for r in rows)
    colour = {"working": "green", "active": "cyan", "idle": "dim", "banned": "red"}
    cells: dict[str, list[Text]] = {name: [] for name, *_ in _CLIENT_COLUMNS
                                    if (has_trust or name != "valid")
                                    and (has_reporting or name not in ("unreturned", "reward z", "dropped z"))}
    for r in rows:
        unreturned, reward_z, dropped_z = _reporting(r.get("reporting"))
        row = {"client": r["client_id"][:8], "name": r["name"], "state": _text(r["state"], colour.get(r["state"], "")),
               "valid": _trust(r.get("trust")), "backend": r["backend"], "device": r["device"],
               "platform": r["platform"], "accepted": r["accepted"], "rejected": r["rejected"],
               "unreturned": unreturned, "reward z": reward_z, "dropped z": dropped_z, "credit": f"{r['credit']:,.0f}",
               "last seen": _ago(r["last_seen"])}
        for name, col in cells.items():
            col.append(row[name] if isinstance(row[name], Text) else _text(row[name]))
    shown = _fit_columns(cells, console.width)
    t = Table(title=f"{len(rows)} clients", box=None, pad_edge=False, header_style="bold")
    for name, right, _, _ in _CLIENT_COLUMNS:
        if name in shown:
            t.add_column(name, justify="right" if right else "left", no_wrap=True, overflow="ellipsis",
                         max_width=shown[name])
    for i in range(len(rows)):
        t.add_row(*(cells[name][i] for name in shown))
    hidden = [name for name in cells if name not in shown]
    if hidden:
        t.caption = f"not shown (too narrow): {', '.join(hidden)}; widen the terminal or use --json"
        t.caption_justify = "left"
    console.print(t)


def _reporting(rep: Optional[dict[str, Any]]) -> list[Text]:
    """The unreturned share and the two comparisons' z (core.reporting), '-' where nothing was compared."""
    if not rep:
        return [_text("-"), _text("-"), _text("-")]
    share = _text(f"{rep['unreturned']}/{rep['leased']}" if rep["leased"] else "-")
    z = _text(f"{rep['reward_z']:+.1f}" if rep["results_compared"] else "-")
    dropped = _text(f"{rep['dropped_z']:+.1f}" if rep.get("dropped_compared") else "-")
    return [share, z, dropped]


def _trust(t: Optional[dict[str, Any]]) -> Text:
    if not t:
        return _text("-")
    cell = _text(f"{t['valid']}/{t['valid'] + t['invalid']}")
    return cell.append(" quarantined", "red") if t["quarantined"] else cell


ClientArg = Annotated[str, typer.Argument(help="Client id, or a unique prefix of at least 6 hex digits "
                                               "(see `echo-swarm admin clients`).")]
NoteOpt = Annotated[str, typer.Option(help="Why (kept in the run's admin.log audit trail).")]


@admin_app.command()
def ban(ctx: typer.Context, client: ClientArg, note: NoteOpt = "", as_json: JsonFlag = False) -> None:
    """Ban a client: all its requests are refused (403 'banned') and its current leases are released for
    others. Its credit and history stay."""
    r = _run(ctx, "ban", client, note)
    if as_json:
        return _dump(r)
    _say(f"banned {r['client_id']}; released {len(r['released_jobs'])} leased job(s)")


@admin_app.command()
def unban(ctx: typer.Context, client: ClientArg, note: NoteOpt = "", as_json: JsonFlag = False) -> None:
    """Lift a ban: the client may register, lease and submit again."""
    r = _run(ctx, "unban", client, note)
    if as_json:
        return _dump(r)
    _say(f"unbanned {r['client_id']}")


@admin_app.command()
def versions(ctx: typer.Context, as_json: JsonFlag = False, limit: LimitOpt = 50) -> None:
    """Published policy versions, newest first: step reward, held-out accuracy, and whether still served."""
    r = _run(ctx, "versions", limit)
    if as_json:
        return _dump(r)
    t = Table(title=_text(f"policy versions (current {r['current']})"))
    for col in ("version", "published", "mean reward", "held-out acc", "step s", "served", "manifest"):
        t.add_column(col)
    for v in r["versions"]:
        _row(t, v["version"], _ago(v["created_at"]), _num(v["mean_reward"]), _num(v["heldout_accuracy"]),
             _num(v["step_s"], "{:.2f}"), "yes" if v["served"] else "pruned", v["manifest_sha256"][:16])
    console.print(t)


@admin_app.command()
def jobs(ctx: typer.Context, as_json: JsonFlag = False, limit: LimitOpt = 200) -> None:
    """Jobs not yet done — open, leased (in flight) and expired (waiting to be reissued) — and totals."""
    r = _run(ctx, "jobs", limit)
    if as_json:
        return _dump(r)
    counts = ", ".join(f"{k} {v}" for k, v in r["counts"].items())
    t = Table(title=_text(f"jobs: {counts}; reissued {r['reissued']}; {r['leases_issued']} leases issued"))
    for col in ("job", "state", "client", "version", "expires in", "issues"):
        t.add_column(col)
    for j in r["jobs"]:
        _row(t, j["job_id"], j["state"], (j["client_id"] or "-")[:12], _num(j["version"], "{}"),
             _num(j["expires_in_s"], "{:.0f}s"), str(j["issue_count"]) + (" (reissued)" if j["reissued"] else ""))
    console.print(t)


@admin_app.command()
def audit(
    ctx: typer.Context,
    as_json: JsonFlag = False,
    limit: LimitOpt = 100,
    client: Annotated[Optional[str], typer.Option(help="Only this client (id or unique prefix).")] = None,
    job: Annotated[Optional[str], typer.Option(help="Only this job id.")] = None,
    outcome: Annotated[Optional[str], typer.Option(help="Only results with this outcome: 'accepted', 'rejected' (and "
                                                        "any further outcome the coordinator's audit log records).")] = None,
) -> None:
    """The results audit, newest first: every accepted and refused result with its client, job, version,
    reason code and content hash (sha256 of the submitted bytes)."""
    rows = _run(ctx, "audit", limit, client, job, outcome)
    if as_json:
        return _dump(rows)
    t = Table(title=f"results audit ({len(rows)} entries)")
    for col in ("when", "outcome", "client", "job", "version", "reason / use", "content sha256"):
        t.add_column(col)
    for e in rows:
        mark = _text(e["outcome"], "green" if e["outcome"] == "accepted" else "red")
        _row(t, _ago(e["at"]), mark, e["client_id"][:12], e["job_id"] or "-", _num(e["version"], "{}"),
             e["reason"] or e["detail"], (e["content_sha256"] or "-")[:16])
    console.print(t)


@admin_app.command()
def checkpoint(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Export the current version now: model folder, optimizer state and a database backup, under
    <run dir>/exports/. (The learner also writes checkpoints by itself, every learner.checkpoint_every_steps
    steps or learner.checkpoint_every_s seconds, not every version; docs/run-dir.md §5.)"""
    r = _run(ctx, "checkpoint")
    if as_json:
        return _dump(r)
    _say(f"checkpoint of version {r['version']}: {r['path']} ({r['bytes'] / 2**20:.1f} MiB, {r['files']} files)")


@admin_app.command()
def pause(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Stop issuing jobs: lease requests are told to retry later. Jobs already leased may still be returned and
    are credited. Survives a coordinator restart until `resume`."""
    r = _run(ctx, "pause")
    if as_json:
        return _dump(r)
    _say("job issuing paused" + ("" if r["changed"] else " (it already was)"))


@admin_app.command()
def resume(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Issue jobs again; waiting clients are woken at once."""
    r = _run(ctx, "resume")
    if as_json:
        return _dump(r)
    _say("job issuing resumed" + ("" if r["changed"] else " (it was not paused)"))


@admin_app.command()
def invite(ctx: typer.Context, note: NoteOpt = "", as_json: JsonFlag = False) -> None:
    """Issue an invite token for one volunteer (`echo-swarm join --invite TOKEN`). Only its sha256 is kept, so it
    is shown this once. Needed to join while the run's registration is 'invite' (`echo-swarm admin registration
    invite`, or registration.mode in the config)."""
    r = _run(ctx, "invite", note)
    if as_json:
        return _dump(r)
    _say(f"invite token: {r['token']}")
    _say(f"give it to one volunteer: echo-swarm join <url> --invite {r['token']}  (registration is {r['mode']})")


@admin_app.command()
def registration(ctx: typer.Context, mode: Annotated[str, typer.Argument(help="'invite': registering needs an invite "
                                                                            "token (`echo-swarm admin invite`); "
                                                                            "'open': anyone may join.")],
                 as_json: JsonFlag = False) -> None:
    """Set the run's registration: invite-only or open. Kept in the run's store: it survives a restart and holds
    for every API process, over the config's registration.mode. Known identities are not affected."""
    if mode not in ("open", "invite"):
        _fail(f"registration mode must be 'open' or 'invite', not {mode!r}", ExitCode.USAGE)
    r = _run(ctx, "registration", mode)
    if as_json:
        return _dump(r)
    _say(f"registration is {r['mode']}" + ("" if r["changed"] else " (it already was)") +
         (f"; {r['invites']} invite token(s) valid" if r["mode"] == "invite" else ""))


@admin_app.command()
def notice(
    ctx: typer.Context,
    text: Annotated[Optional[str], typer.Argument(help="What to tell every volunteer: one line of at most 500 "
                                                      "printable characters.", show_default=False)] = None,
    run: Annotated[bool, typer.Option("--run", help="A notice about runs (this one finished, the next starts "
                                                    "…) rather than a general one.")] = False,
    min_version: Annotated[Optional[str], typer.Option("--min-version", help="This run needs this echo-swarm "
                                                       "release or newer (e.g. 0.5): older clients say 'please "
                                                       "update'.", show_default=False)] = None,
    withdraw: Annotated[Optional[int], typer.Option("--withdraw", min=1, help="Withdraw the notice with this id "
                                                    "(`echo-swarm admin notices` lists them) instead.",
                                                    show_default=False)] = None,
    as_json: JsonFlag = False,
) -> None:
    """Publish a notice to every volunteer: their clients show it on the panel, the control page, `client status`
    and as a desktop notification (within 5 minutes; at once when they join). Kept in the run's store, signed
    with the run's key, at most the 16 newest."""
    if withdraw is not None:
        if text is not None or run or min_version is not None:
            _fail("--withdraw takes no text, --run or --min-version", ExitCode.USAGE)
        r = _run(ctx, "notices.withdraw", withdraw)
        return _dump(r) if as_json else _say(f"withdrew notice {r['notice_id']}; {r['notices']} in force")
    if text is None:
        _fail("give the notice's text (or --withdraw ID)", ExitCode.USAGE)
    if run and min_version is not None:
        _fail("a notice is about runs (--run) or asks for a release (--min-version), not both", ExitCode.USAGE)
    kind = "update" if min_version is not None else "run" if run else "operator"
    r = _run(ctx, "notices.publish", text, kind, min_version)
    if as_json:
        return _dump(r)
    _say(f"published notice {r['notice_id']} ({kind}); {r['notices']} in force")


@admin_app.command()
def notices(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """The notices in force, oldest first (withdraw one with `echo-swarm admin notice --withdraw ID`)."""
    r = _run(ctx, "notices.list")
    if as_json:
        return _dump(r)
    t = Table(title=_text(f"notices ({len(r)})"))
    for col in ("id", "published", "kind", "text"):
        t.add_column(col)
    for n in r:
        kind = n["kind"] + (f" ≥ {n['min_client_version']}" if n.get("min_client_version") else "")
        _row(t, n["notice_id"], _ago(n["at"]), kind, n["text"])
    console.print(t)


@keys_app.command("list")
def keys_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Operator keys allowed to use the admin API, and the coordinator's own public key (the one volunteers
    pin; publish it so they can pass --coordinator-key)."""
    r = _run(ctx, "keys.list")
    if as_json:
        return _dump(r)
    t = Table(title=_text(f"operator keys ({r['keys_file']})"),
              caption=_text(f"coordinator signing key: {r['coordinator_public_key']}"))
    for col in ("key id", "public key", "comment", ""):
        t.add_column(col)
    for k in r["admin_keys"]:
        _row(t, k["key_id"][:12], k["public_key"], k["comment"], "← you" if k["you"] else "")
    console.print(t)


@keys_app.command("add")
def keys_add(
    ctx: typer.Context,
    public_key: Annotated[str, typer.Argument(help="The new operator's Ed25519 public key, 64 hex digits (printed "
                                                   "by `echo-swarm admin keys generate`).")],
    comment: Annotated[str, typer.Option(help="Who or what the key is for.")] = "",
    as_json: JsonFlag = False,
) -> None:
    """Allow another operator key."""
    try:
        raw = bytes.fromhex(public_key.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        _fail(f"{public_key!r} is not a public key: give its 64 hex digits, as `echo-swarm admin keys generate` "
              f"printed them", ExitCode.USAGE)
    r = _run(ctx, "keys.add", raw, comment)
    if as_json:
        return _dump(r)
    _say(f"added operator key {r['key_id']}" if r["added"] else f"key {r['key_id']} was already listed")


@keys_app.command("remove")
def keys_remove(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="Key id (or a unique prefix of at least 6 hex digits) from "
                                                "`echo-swarm admin keys list`.")],
    as_json: JsonFlag = False,
) -> None:
    """Revoke an operator key (the last one cannot be removed)."""
    r = _run(ctx, "keys.remove", key_id)
    if as_json:
        return _dump(r)
    _say(f"removed operator key {r['key_id']}; {r['remaining']} remain")


@keys_app.command("rotate")
def keys_rotate(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Replace the key you are using with a new one: the new key is listed, the old one revoked, and the
    key file (--key, or <run dir>/admin.key) rewritten."""
    r = _run(ctx, "keys.rotate")
    if as_json:
        return _dump(r)
    _say(f"rotated: {r['old_key_id'][:12]} → {r['new_key_id'][:12]} (saved to {r['key_file']})")


@keys_app.command("generate")
def keys_generate(
    path: Annotated[Path, typer.Argument(help="Where to write the new private key (mode 0600; never overwritten).")],
    as_json: JsonFlag = False,
) -> None:
    """Create an operator key file locally (no coordinator needed) and print its public key, which an existing
    operator then allows with `echo-swarm admin keys add`."""
    from echo_swarm.admin_client import AdminUsageError, generate_key_file  # lazy: as in _run (cryptography)

    try:
        r = generate_key_file(path)
    except AdminUsageError as exc:
        _fail(str(exc), ExitCode.USAGE)
    if as_json:
        return _dump(r)
    for line in (f"wrote {r['key_file']}", f"public key: {r['public_key']}",
                 f"an operator allows it with: echo-swarm admin keys add {r['public_key']}"):
        _say(line)
