"""Reference tables generated from the code, for docs/client.md, docs/run-dir.md and README.md (tests keep them in
step): the `join` options from JoinConfig and the command's own flags, the `coordinator` flags from the run-config
keys they set, so the config keys, the flags, their --help and the docs cannot disagree, and the model families GGUF
is published for."""

from __future__ import annotations

import typing
from typing import Any

from coordinator.publish.gguf_export import ARCHITECTURES, CONVERTED, FAMILIES
from echo_swarm.cli import COORDINATOR_KEYS, app, run_field
from echo_swarm.flags import field_metavar, value_type
from shared.exit_codes import codes_table
from swarm_client.settings import FLAG_FIELDS, JoinConfig

BEGIN = "<!-- generated: {name} (echo_swarm/reference.py) -->"
END = "<!-- end generated: {name} -->"


def _flags(command: Any) -> dict[str, str]:
    """JoinConfig field → the flag spelling(s) of `join` that set it."""
    out: dict[str, str] = {}
    for param in command.params:
        kind = getattr(param, "param_type_name", "")
        field = FLAG_FIELDS.get(param.name, param.name)
        if kind == "argument":
            out[field] = f"`{param.name.upper()}` (argument)"
        elif kind == "option":
            out[field] = " / ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
    return out


def _values(field: Any) -> str:
    """What a setting takes, as --help shows it (its type, bounds and choices; echo_swarm.flags)."""
    kind = value_type(field)
    if kind is bool:
        return "true / false"
    if typing.get_origin(kind) is list:
        return "a list of `<str>`"
    return "`" + field_metavar(field).replace("|", "\\|") + "`"


def join_options_markdown() -> str:
    import typer

    join = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    flags = _flags(join)
    keys = {field: flag for flag, field in FLAG_FIELDS.items()}
    rows = ["| config key | flag | values | default | meaning |", "|---|---|---|---|---|"]
    for name, field in JoinConfig.model_fields.items():
        key = f"`{name}`" + (f" or `{keys[name]}`" if name in keys else "")
        default = field.default if not callable(field.default_factory) else field.default_factory()  # type: ignore[call-arg]
        shown = ("—" if field.is_required() else "unset" if default is None
                 else f'`"{default}"`' if isinstance(default, str) else f"`{default}`")
        text = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {key} | {flags.get(name, '—')} | {_values(field)} | {shown} | {text} |")
    return "\n".join(rows)


def coordinator_flags_markdown() -> str:
    """`coordinator`'s flags, the run-config key each sets and the values it takes (the key's type, bounds and
    choices, as --help shows them)."""
    import typer

    command = typer.main.get_command(app).commands["coordinator"]  # type: ignore[attr-defined]
    rows = ["| flag | key | value |", "|---|---|---|"]
    for param in command.params:
        if param.name not in COORDINATOR_KEYS:
            continue
        key = COORDINATOR_KEYS[param.name]
        flag = " / ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        value = "a switch" if param.is_flag else f"`{field_metavar(run_field(key))}`"
        rows.append(f"| {flag} | `{key}` | {value.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def exit_codes_markdown() -> str:
    return codes_table()


_ROUTE_LABELS = {(True, False): "the project's writer", (False, True): "llama.cpp's converters",
                 (True, True): "the project's writer; llama.cpp's converters with rope scaling or another "
                               "pre-tokenizer"}


def model_families_markdown() -> str:
    """The families a run can publish as GGUF for llama.cpp clients (coordinator.publish.gguf_export.FAMILIES)."""
    rows = ["| Hugging Face architecture | families | GGUF and llama.cpp LoRA adapters written by |", "|---|---|---|"]
    for arch, families in FAMILIES.items():
        rows.append(f"| `{arch}` | {families} | {_ROUTE_LABELS[(arch in ARCHITECTURES, arch in CONVERTED)]} |")
    return "\n".join(rows)


TABLES = {"join-options": join_options_markdown, "coordinator-flags": coordinator_flags_markdown,
          "exit-codes": exit_codes_markdown, "model-families": model_families_markdown}


def block(name: str) -> str:
    return f"{BEGIN.format(name=name)}\n{TABLES[name]()}\n{END.format(name=name)}"


def refresh(text: str) -> str:
    """``text`` with every generated block rewritten from the code."""
    for name in TABLES:
        begin, end = BEGIN.format(name=name), END.format(name=name)
        if begin in text:
            head, _, rest = text.partition(begin)
            _, _, tail = rest.partition(end)
            text = head + block(name) + tail
    return text


if __name__ == "__main__":  # python -m echo_swarm.reference FILE...: rewrite the generated blocks in place
    import sys
    from pathlib import Path

    for arg in sys.argv[1:]:
        path = Path(arg)
        path.write_text(refresh(path.read_text()))
