"""msgpack framing with explicit limits and strict schema validation.

Decoding untrusted bytes goes through :func:`decode`, which bounds every container and string by explicit
limits (not only by msgpack's input-length heuristics), refuses duplicate map keys (msgpack silently keeps
the last one), refuses ext types and non-string map keys, and then validates the result against a pydantic
model in strict mode. Anything else raises :class:`~shared.errors.ProtocolError`; it never crashes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import pydantic

from shared.errors import ProtocolError, Reason

M = TypeVar("M", bound=pydantic.BaseModel)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Hard upper bound on any single protocol message; endpoints apply tighter caps of their own."""
MAX_DEPTH = 16


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise ValueError("map keys must be strings")
        if key in out:
            raise ValueError(f"duplicate map key {key!r}")
        out[key] = value
    return out


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in protocol messages")


def _depth(obj: Any, limit: int) -> int:
    """Depth of nested containers, raising once ``limit`` is exceeded (iterative: no recursion bomb)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    deepest = 0
    while stack:
        item, level = stack.pop()
        if level > limit:
            raise ValueError(f"nesting deeper than {limit}")
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values() if isinstance(v, (list, dict)))
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item if isinstance(v, (list, dict)))
    return deepest


def unpack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Decode msgpack bytes into plain Python values, bounded; raise ProtocolError(MALFORMED) otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(Reason.MALFORMED, "message must be bytes")
    if len(data) > max_bytes:
        raise ProtocolError(Reason.BODY_TOO_LARGE, f"message is {len(data)} bytes; the limit is {max_bytes}")
    n = len(data)
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_no_duplicates,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
        _depth(obj, MAX_DEPTH)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            OverflowError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(Reason.MALFORMED, f"not a valid protocol message: {exc}") from None
    except Exception as exc:  # msgpack raises a few undocumented types on garbage; never let one escape
        raise ProtocolError(Reason.MALFORMED, f"not a valid protocol message: {type(exc).__name__}") from None
    return obj


def pack(obj: Any) -> bytes:
    """Encode plain values (dicts, lists, str, bytes, int, float, bool, None) as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def validate(obj: Any, model: type[M]) -> M:
    """Validate decoded values against a strict pydantic model; map failures to ProtocolError(SCHEMA)."""
    if not isinstance(obj, dict):
        raise ProtocolError(Reason.MALFORMED, f"expected a map at the top level, got {type(obj).__name__}")
    try:
        return model.model_validate(obj, strict=True)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "<message>"
        raise ProtocolError(
            Reason.SCHEMA, f"{model.__name__}.{where}: {first.get('msg', 'invalid')} ({exc.error_count()} error(s))"
        ) from None


def decode(data: bytes, model: type[M], *, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Bytes → validated message, or ProtocolError. The only way untrusted bytes become a message."""
    return validate(unpack(data, max_bytes=max_bytes), model)


def encode(message: pydantic.BaseModel) -> bytes:
    """Message → canonical msgpack bytes (fields in declaration order)."""
    return pack(message.model_dump(mode="python"))
