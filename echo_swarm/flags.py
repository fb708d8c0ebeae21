"""Command-line options made from config model fields, so that a bound is written once: on the model.

A flag that sets a config key (a `join` setting, a `coordinator` run-config key) takes its value's type, bounds and
choices from that key's pydantic field: :func:`field_parser` validates the value as the model validates the field
(``gt=0`` stays open, ``le=10_000`` stays a bound), and :func:`field_metavar` shows the same in --help
(``<float range> [0<x<=100]``, ``[auto|f32|f16]``), as nanoGPT's configurator makes every config key a flag of its own
type. A value the field refuses is a usage error naming the flag, before anything runs.

The field is given as a function, so that a command whose models are heavy to import (`coordinator`: the whole run
config) resolves it only when a value is parsed or its help is shown.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

#: The type word --help shows for a field's type (typer's own words for the flags it types itself).
_TYPE_WORDS = {int: "int", float: "float", str: "str", Path: "path", bool: "bool"}


def value_type(field: FieldInfo) -> Any:
    """The field's type without ``None`` (a flag that is not given is unset, never None on purpose)."""
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def bounds(field: FieldInfo) -> tuple[float | None, bool, float | None, bool]:
    """(lower, lower is open, upper, upper is open) of a numeric field, from its ge/gt/le/lt."""
    low: float | None = None
    high: float | None = None
    low_open = high_open = False
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            low, low_open = item.ge, False  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Gt):
            low, low_open = item.gt, True  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Le):
            high, high_open = item.le, False  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Lt):
            high, high_open = item.lt, True  # type: ignore[assignment]
    return low, low_open, high, high_open


def _number(value: float) -> str:
    """1e6 as 1000000, 0.5 as 0.5."""
    return str(int(value)) if float(value).is_integer() else str(value)


def describe_range(field: FieldInfo) -> str | None:
    """The field's bounds as click writes a range (``x>=1``, ``0<x<=100``); None when it has none."""
    low, low_open, high, high_open = bounds(field)
    below = "<" if low_open else "<="
    above = "<" if high_open else "<="
    if low is None:
        return None if high is None else f"x{above}{_number(high)}"
    if high is None:
        return f"x{'>' if low_open else '>='}{_number(low)}"
    return f"{_number(low)}{below}x{above}{_number(high)}"


def choices(field: FieldInfo) -> tuple[str, ...] | None:
    """The values of a Literal field, None for any other."""
    kind = value_type(field)
    return tuple(str(v) for v in typing.get_args(kind)) if typing.get_origin(kind) is Literal else None


def field_metavar(field: FieldInfo) -> str:
    """What --help shows for the flag's value: the choices, or the type word and the range."""
    options = choices(field)
    if options is not None:
        return "[" + "|".join(options) + "]"
    word = _TYPE_WORDS.get(value_type(field), "str")
    span = describe_range(field)
    return f"<{word} range> [{span}]" if span else f"<{word}>"


def field_parser(field: Callable[[], FieldInfo]) -> Callable[[str], Any]:
    """A typer ``parser`` that validates a flag's text as the model validates ``field()``: its type, bounds, choices
    and lengths (the field's validator functions run when the whole model is built, as for the config file)."""
    adapter: list[TypeAdapter[Any]] = []

    def parse(text: str) -> Any:
        if not adapter:
            info = field()
            kind: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            adapter.append(TypeAdapter(kind))
        try:
            return adapter[0].validate_python(text)
        except ValidationError as exc:  # typer names the flag before the model's own words
            raise PydanticCustomError("flag_value", "{message}", {"message": exc.errors()[0]["msg"]}) from None

    return parse
