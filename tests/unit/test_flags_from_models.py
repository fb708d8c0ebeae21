"""Every flag of `echo-swarm join` and `echo-swarm coordinator` that sets a config key has that key's type, bounds
and choices (issue 33): its --help shows them as the model states them, and the command line accepts and refuses
exactly the values the model accepts and refuses at each bound, so that a bound is written once, on the model."""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import pytest
import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from coordinator.config import CoordinatorConfig
from echo_swarm import reference
from echo_swarm.cli import COORDINATOR_KEYS, app, run_field
from swarm_client.settings import FLAG_FIELDS, JoinConfig
from tests.terminal import run_on_terminal
from tests.unit.test_cli_conventions import _options

#: Options that set no config key: the config file itself, which role to run, and --help.
NOT_SETTINGS = {"join": {"--config", "--help"}, "coordinator": {"--config", "--role", "--index", "--help"}}
URL = "http://127.0.0.1:8470"


def _join_field(flag: str) -> tuple[str, FieldInfo]:
    name = FLAG_FIELDS.get(flag, flag)
    return name, JoinConfig.model_fields[name]


def _run_field(flag: str) -> tuple[str, FieldInfo]:
    return COORDINATOR_KEYS[flag], run_field(COORDINATOR_KEYS[flag])


FIELD = {"join": _join_field, "coordinator": _run_field}


def _kind(field: FieldInfo) -> Any:
    args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    return args[0] if typing.get_origin(field.annotation) in (typing.Union, type(int | None)) and len(args) == 1 \
        else field.annotation


def _limits(field: FieldInfo) -> dict[str, float]:
    """The field's ge/gt/le/lt, by name."""
    out: dict[str, float] = {}
    for item in field.metadata:
        for op in ("ge", "gt", "le", "lt"):
            if isinstance(item, getattr(annotated_types, op.capitalize())):
                out[op] = getattr(item, op)
    return out


def _shown_range(field: FieldInfo) -> str:
    """The range as --help must show it, click's notation: x>=1, x>0, 0<=x<=100, 0<x<1."""
    lim = _limits(field)

    def num(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else str(v)

    low = next(((num(lim[o]), o == "gt") for o in ("ge", "gt") if o in lim), None)
    high = next(((num(lim[o]), o == "lt") for o in ("le", "lt") if o in lim), None)
    if low and high:
        return f"{low[0]}{'<' if low[1] else '<='}x{'<' if high[1] else '<='}{high[0]}"
    if low:
        return f"x{'>' if low[1] else '>='}{low[0]}"
    return f"x{'<' if high and high[1] else '<='}{high[0]}" if high else ""


@pytest.mark.parametrize("command", ["join", "coordinator"])
def test_every_flags_help_shows_its_fields_type_and_bounds(command: str) -> None:
    screen = run_on_terminal([sys.executable, "-m", "echo_swarm", command, "--help"], columns=250)
    assert screen.returncode == 0, screen.text()
    rows = _options(screen.text())
    assert NOT_SETTINGS[command] <= set(rows)
    checked = 0
    for option, row in rows.items():
        if option in NOT_SETTINGS[command]:
            continue
        key, field = FIELD[command](option[2:].replace("-", "_"))  # KeyError: a flag that sets no config key
        kind = _kind(field)
        shown = re.match(r"(<[\w\[\] ]+?>(?: \[[^\]]*\])?|\[[^\]]*\])?", row).group(1)  # type: ignore[union-attr]
        if kind is bool:
            assert shown is None, (option, row)
        elif typing.get_origin(kind) is Literal:
            assert shown == "[" + "|".join(typing.get_args(kind)) + "]", (option, key, row)
        elif kind in (int, float):
            word = {int: "int", float: "float"}[kind]
            want = f"<{word} range> [{_shown_range(field)}]" if _limits(field) else f"<{word}>"
            assert shown == want, (option, key, row)
        elif typing.get_origin(kind) is list:
            assert shown == "<list[str]>", (option, key, row)
        else:
            assert shown == {str: "<str>", Path: "<path>"}[kind], (option, key, row)
        checked += 1
    assert checked == {"join": 42, "coordinator": len(COORDINATOR_KEYS)}[command]  # the issue counted 38 and 17; --team, --attach, --share, --keep-models since


def _probes(field: FieldInfo) -> list[str]:
    """Values at and beside each bound, a wrong type, and for choices each choice and one more."""
    kind = _kind(field)
    if typing.get_origin(kind) is Literal:
        return [*typing.get_args(kind), "no-such-choice"]
    if kind not in (int, float):
        return []
    out = ["1.5" if kind is int else "one", "abc"]
    for bound in _limits(field).values():
        step = 1 if kind is int else 1e-3 * max(1.0, abs(bound))
        out += [str(kind(bound + d)) for d in (-step, 0, step)]
    return out


def _model_accepts(command: str, key: str, value: str) -> bool:
    """Whether the model itself (not the command line) accepts ``value`` for ``key``: no error located at the key."""
    try:
        if command == "join":
            JoinConfig.model_validate({"url": URL, "home": "h", key: value})
        else:
            data: dict[str, Any] = {}
            node = data
            *sections, name = key.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
            CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        return not any(tuple(str(p) for p in e["loc"]) == tuple(key.split(".")) for e in exc.errors())
    return True


@pytest.mark.parametrize("command", ["join", "coordinator"])
def test_the_command_line_accepts_what_the_model_accepts_at_every_bound(command: str) -> None:
    cli = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    probed = 0
    for param in cli.params:
        option = f"--{param.name.replace('_', '-')}"
        if param.param_type_name != "option" or param.name in ("config", "role", "index") or param.is_flag:
            continue
        key, field = FIELD[command](param.name)
        for value in _probes(field):
            try:
                cli.make_context(command, [*([URL] if command == "join" else []), param.opts[0], value])
                flag_accepts = True
            except typer.BadParameter:
                flag_accepts = False
            assert flag_accepts == _model_accepts(command, key, value), (option, key, value)
            probed += 1
    assert probed > 50  # the walk reached the numeric and choice flags (join: 139 values, coordinator: 77)


def test_the_disagreements_issue_33_named_are_gone() -> None:
    """`join --max-cpu-percent` was bounded min=1 by hand while the model says gt=0; `--gpu-layers` was unbounded
    above while the model says le=10_000."""
    join = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    join.make_context("join", [URL, "--max-cpu-percent", "0.5"])
    with pytest.raises(typer.BadParameter, match="less than or equal to 10000"):
        join.make_context("join", [URL, "--gpu-layers", "10001"])
    with pytest.raises(typer.BadParameter, match="greater than 0"):
        join.make_context("join", [URL, "--max-cpu-percent", "0"])


def test_an_unknown_flag_is_an_error() -> None:
    for command in ("join", "coordinator"):
        cli = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
        with pytest.raises(typer.TyperException, match="No such option"):
            cli.make_context(command, ["--max-cpu-percnt", "5"])


def test_docs_run_dir_md_lists_every_coordinator_flag_as_the_models_have_it() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "run-dir.md").read_text()
    assert reference.block("coordinator-flags") in doc, ("docs/run-dir.md's flags table differs from the run config: "
                                                         "run python -m echo_swarm.reference docs/run-dir.md")
