"""shared/wire.py: every way untrusted bytes can be wrong ends in ProtocolError with the right reason."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import wire
from shared.errors import ProtocolError, Reason
from shared.messages import (
    Completion,
    Info,
    Job,
    LeaseRequest,
    Message,
    RegisterRequest,
    ResultSubmission,
    SignedRequest,
)

from .factories import all_messages, job, submission, valid_dict

MESSAGES = all_messages()
MODELS: list[type[Message]] = sorted({type(m) for m in MESSAGES}, key=lambda cls: cls.__name__)


def refusal(data: Any, model: type[pydantic.BaseModel] = LeaseRequest, **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.decode(data, model, **kw)
    return info.value


def packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


LEASE = {"backend": "torch", "held_version": 3}


def nested(depth: int, kind: str, leaf: Any = 1) -> Any:
    obj = leaf
    for _ in range(depth):
        obj = [obj] if kind == "list" else {"k": obj}
    return obj


# ---- sanity ---------------------------------------------------------------------------------------------
def test_valid_message_decodes() -> None:
    msg = wire.decode(packed(LEASE), LeaseRequest)
    assert msg == LeaseRequest(backend="torch", held_version=3)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_bytes_like_inputs_accepted(wrap: Any) -> None:
    assert wire.decode(wrap(packed(LEASE)), LeaseRequest).held_version == 3


# ---- framing: MALFORMED ---------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    b"",                      # nothing at all
    b"\xc1",                  # the one byte msgpack never uses
    b"\x92\x01",              # array of 2 with only one element
    b"\xa5abc",               # str of 5 with 3 bytes
    b"\xda\xff",              # str16 header cut short
    b"\xa2\xff\xfe",          # str that is not UTF-8
], ids=["empty", "reserved-byte", "short-array", "short-str", "short-header", "bad-utf8"])
def test_malformed_msgpack(data: bytes) -> None:
    err = refusal(data)
    assert err.reason is Reason.MALFORMED
    assert err.http_status == 400


@pytest.mark.parametrize("cut", [1, 2, 5, 10])
def test_truncated_valid_message(cut: int) -> None:
    data = wire.encode(job())
    assert refusal(data[:-cut], Job).reason is Reason.MALFORMED


def test_trailing_extra_data() -> None:
    data = packed(LEASE)
    for extra in (b"\x00", b"\xc0", packed(LEASE)):
        assert refusal(data + extra).reason is Reason.MALFORMED


def test_duplicate_map_keys() -> None:
    # {"backend": "torch", "held_version": 1, "held_version": 2}: msgpack alone would keep the last one
    data = b"\x83" + packed("backend") + packed("torch") + packed("held_version") + b"\x01" + \
        packed("held_version") + b"\x02"
    err = refusal(data)
    assert err.reason is Reason.MALFORMED
    assert "duplicate" in err.message


def test_duplicate_keys_in_nested_map() -> None:
    inner = b"\x82" + packed("a") + b"\x01" + packed("a") + b"\x02"
    data = b"\x81" + packed("x") + inner
    assert refusal(data).reason is Reason.MALFORMED


@pytest.mark.parametrize("obj", [
    {1: "torch"},
    {b"backend": "torch", "held_version": 1},
    {"backend": "torch", "held_version": 1, None: 2},
    {1.5: 1},
    {True: 1},
    {"backend": "torch", "held_version": {7: 1}},
    {"x": [{b"y": 1}]},
], ids=["int", "bytes", "nil", "float", "bool", "nested-int", "nested-in-list"])
def test_non_string_map_keys(obj: Any) -> None:
    assert refusal(packed(obj)).reason is Reason.MALFORMED


@pytest.mark.parametrize("ext", [
    msgpack.ExtType(1, b"\x00"),
    msgpack.ExtType(5, b"abcdefgh"),
    msgpack.ExtType(127, b"x" * 300),
    msgpack.Timestamp(1, 0),
], ids=["fixext1", "fixext8", "ext16", "timestamp"])
@pytest.mark.parametrize("where", ["top", "value", "list"])
def test_ext_types_refused(ext: Any, where: str) -> None:
    obj = {"top": ext, "value": {"backend": ext}, "list": {"backend": [1, ext]}}[where]
    err = refusal(msgpack.packb(obj, use_bin_type=True, datetime=False))
    assert err.reason is Reason.MALFORMED


@pytest.mark.parametrize("data", [b"\xc7\x00\x05", b"\xc8\x00\x00\x05", b"\xc9\x00\x00\x00\x00\x05"],
                         ids=["ext8", "ext16", "ext32"])
def test_zero_length_ext_types_refused_by_unpack(data: bytes) -> None:
    # The module promises to refuse ext types; max_ext_len=0 still lets a zero-length ext through.
    with pytest.raises(ProtocolError) as info:
        wire.unpack(data)
    assert info.value.reason is Reason.MALFORMED
    with pytest.raises(ProtocolError) as nested_info:
        wire.decode(b"\x82" + packed("backend") + data + packed("held_version") + b"\x01", LeaseRequest)
    assert nested_info.value.reason is Reason.MALFORMED


def test_nesting_limit_lists() -> None:
    assert wire.unpack(packed(nested(wire.MAX_DEPTH, "list"))) == nested(wire.MAX_DEPTH, "list")
    err = refusal(packed({"backend": nested(wire.MAX_DEPTH, "list")}))
    assert err.reason is Reason.MALFORMED and "nesting" in err.message
    with pytest.raises(ProtocolError) as info:
        wire.unpack(packed(nested(wire.MAX_DEPTH + 1, "list")))
    assert info.value.reason is Reason.MALFORMED


def test_nesting_limit_maps_is_consistent_with_lists() -> None:
    # MAX_DEPTH counts nested containers: 16 maps around a scalar are as deep as 16 lists around one.
    assert wire.unpack(packed(nested(wire.MAX_DEPTH, "map"))) == nested(wire.MAX_DEPTH, "map")
    with pytest.raises(ProtocolError) as info:
        wire.unpack(packed(nested(wire.MAX_DEPTH + 1, "map")))
    assert info.value.reason is Reason.MALFORMED


def test_very_deep_nesting_is_malformed_not_a_crash() -> None:
    data = b"\x91" * 100_000 + b"\x01"
    assert refusal(data).reason is Reason.MALFORMED
    data = (b"\x81\xa1k") * 50_000 + b"\x01"
    assert refusal(data).reason is Reason.MALFORMED


@pytest.mark.parametrize("obj", [[1, 2], [LEASE], 7, "backend", None, True, 1.5, b"\x00"])
def test_non_map_top_level(obj: Any) -> None:
    err = refusal(packed(obj))
    assert err.reason is Reason.MALFORMED
    assert "map" in err.message


@pytest.mark.parametrize("data", ["a string", 123, None, [1, 2]])
def test_non_bytes_input(data: Any) -> None:
    assert refusal(data).reason is Reason.MALFORMED


# ---- size -----------------------------------------------------------------------------------------------
def test_body_too_large_with_explicit_limit() -> None:
    data = packed(LEASE)
    assert wire.decode(data, LeaseRequest, max_bytes=len(data)).held_version == 3
    err = refusal(data, max_bytes=len(data) - 1)
    assert err.reason is Reason.BODY_TOO_LARGE
    assert err.http_status == 413


def test_body_too_large_default_limit_checked_before_parsing() -> None:
    err = refusal(b"\xc1" * (wire.MAX_MESSAGE_BYTES + 1))
    assert err.reason is Reason.BODY_TOO_LARGE


def test_declared_length_larger_than_input() -> None:
    # a str32 header claiming 2**31 bytes must not allocate, just fail
    assert refusal(b"\xdb\x7f\xff\xff\xff" + b"a" * 10).reason is Reason.MALFORMED
    assert refusal(b"\xdd\x7f\xff\xff\xff" + b"\x01" * 10).reason is Reason.MALFORMED
    assert refusal(b"\xdf\x7f\xff\xff\xff" + b"\x01" * 10).reason is Reason.MALFORMED


# ---- schema: SCHEMA -------------------------------------------------------------------------------------
def schema_refusal(obj: dict[str, Any], model: type[pydantic.BaseModel]) -> ProtocolError:
    err = refusal(packed(obj), model)
    assert err.reason is Reason.SCHEMA, err
    assert err.http_status == 422
    assert model.__name__ in err.message
    return err


def test_missing_field() -> None:
    err = schema_refusal({"backend": "torch"}, LeaseRequest)
    assert "held_version" in err.message


def test_extra_field() -> None:
    err = schema_refusal(LEASE | {"credit": 1000}, LeaseRequest)
    assert "credit" in err.message


def test_missing_nested_field() -> None:
    obj = valid_dict(submission())
    del obj["completions"][0]["finish_reason"]
    err = schema_refusal(obj, ResultSubmission)
    assert "completions.0.finish_reason" in err.message


@pytest.mark.parametrize(("model", "field", "value"), [
    (LeaseRequest, "backend", 1),                     # int where str expected
    (LeaseRequest, "backend", b"torch"),              # bytes where str expected
    (LeaseRequest, "held_version", "3"),              # str where int expected
    (LeaseRequest, "held_version", 3.0),              # float where int expected
    (LeaseRequest, "held_version", True),             # bool where int expected
    (LeaseRequest, "held_version", None),
    (SignedRequest, "nonce", "n" * 16),               # str where bytes expected
    (SignedRequest, "body", [1, 2]),
    (SignedRequest, "timestamp", "1700000000"),
    (SignedRequest, "client_id", b"0123456789abcdef0123456789abcdef"),
    (Info, "finished", 0),                            # int where bool expected
    (Info, "coordinator_public_key", "p" * 32),
    (Job, "prompts", {"0": 1}),
    (Job, "sampling", [1.0, 8, [2]]),
])
def test_wrong_type_is_refused_strictly(model: type[Message], field: str, value: Any) -> None:
    instance = next(m for m in MESSAGES if type(m) is model)
    err = schema_refusal(valid_dict(instance) | {field: value}, model)
    assert field in err.message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("model", "field"), [
    (SignedRequest, "timestamp"), (ResultSubmission, "generation_s"), (Info, "server_time"),
])
def test_non_finite_floats_refused(model: type[Message], field: str, value: float) -> None:
    instance = next(m for m in MESSAGES if type(m) is model)
    schema_refusal(valid_dict(instance) | {field: value}, model)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.5])
def test_non_finite_or_positive_logprob_refused(value: float) -> None:
    obj = valid_dict(submission())
    obj["completions"][1]["logprobs"][0] = value
    err = schema_refusal(obj, ResultSubmission)
    assert "completions.1.logprobs.0" in err.message


@pytest.mark.parametrize(("model", "field", "value"), [
    (SignedRequest, "nonce", b"n" * 15),             # too short
    (SignedRequest, "nonce", b"n" * 33),             # too long
    (SignedRequest, "signature", b"s" * 63),
    (SignedRequest, "signature", b"s" * 65),
    (SignedRequest, "client_id", "0123456789ABCDEF0123456789ABCDEF"),  # pattern
    (SignedRequest, "client_id", "0" * 33),
    (SignedRequest, "path", "/v2/lease"),
    (SignedRequest, "protocol", -1),                 # not a protocol number (other versions: protocol_version)
    (SignedRequest, "timestamp", -1.0),
    (RegisterRequest, "public_key", b"k" * 31),
    (ResultSubmission, "completions", []),           # min_length 1
    (ResultSubmission, "group_size", 0),
    (ResultSubmission, "group_size", 65),
    (ResultSubmission, "seed", -1),
    (ResultSubmission, "job_id", "x" * 65),
    (ResultSubmission, "job_id", "has space"),
    (ResultSubmission, "backend", "jax"),            # not one of the literals
    (LeaseRequest, "held_version", -2),
    (LeaseRequest, "held_version", 2**31),
    (Job, "prompts", []),
    (Job, "group_size", 0),
])
def test_out_of_bounds_values(model: type[Message], field: str, value: Any) -> None:
    instance = next(m for m in MESSAGES if type(m) is model)
    err = schema_refusal(valid_dict(instance) | {field: value}, model)
    assert field in err.message


def test_too_many_items_in_bounded_list() -> None:
    obj = valid_dict(job())
    obj["prompts"] = obj["prompts"] * 257
    schema_refusal(obj, Job)
    comp = valid_dict(Completion(token_ids=[1], logprobs=[-0.1], finish_reason="stop"))
    comp["token_ids"] = [1] * 4097
    schema_refusal(comp, Completion)


def test_token_id_bounds() -> None:
    comp = {"token_ids": [-1], "logprobs": [-0.1], "finish_reason": "stop"}
    schema_refusal(comp, Completion)
    comp["token_ids"] = [2**31]
    schema_refusal(comp, Completion)


def test_huge_int_refused() -> None:
    schema_refusal(LEASE | {"held_version": 2**64 - 1}, LeaseRequest)
    schema_refusal(LEASE | {"held_version": -(2**63)}, LeaseRequest)


# ---- encode / pack --------------------------------------------------------------------------------------
def test_encode_is_canonical_field_order() -> None:
    data = wire.encode(LeaseRequest(backend="torch", held_version=3, precision="f32"))
    assert data == packed({"backend": "torch", "held_version": 3, "precision": "f32"})
    assert list(wire.unpack(data)) == ["backend", "held_version", "precision"]


def test_pack_unpack_plain_values() -> None:
    obj = {"a": [1, -2, 3.5, None, True, "s", b"\x00\xff"], "b": {"c": []}}
    assert wire.unpack(wire.pack(obj)) == obj


# ---- property tests -------------------------------------------------------------------------------------
def _decode_only_protocol_errors(data: bytes, model: type[pydantic.BaseModel]) -> None:
    try:
        result = wire.decode(data, model)
    except ProtocolError as exc:
        assert isinstance(exc.reason, Reason)
        assert exc.http_status in (400, 413, 422)
    else:
        assert isinstance(result, model)


model_strategy = st.sampled_from(MODELS)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256), model=model_strategy)
def test_decode_arbitrary_bytes_raises_only_protocol_error(data: bytes, model: type[Message]) -> None:
    _decode_only_protocol_errors(data, model)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_decode_mutated_valid_encoding_raises_only_protocol_error(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(MESSAGES))
    encoded = bytearray(wire.encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(encoded) - 1))
        encoded[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    _decode_only_protocol_errors(bytes(encoded[:cut]), type(message))


FIELD_NAMES = sorted({name for cls in MODELS for name in cls.model_fields})
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=70)
)
any_keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=10) | st.integers(-5, 5) | st.binary(max_size=4)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(any_keys, children, max_size=6),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=msgpack_values, model=model_strategy)
def test_decode_arbitrary_msgpack_values_raises_only_protocol_error(value: Any, model: type[Message]) -> None:
    _decode_only_protocol_errors(packed(value), model)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decode_valid_message_with_one_field_replaced(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(MESSAGES))
    obj = valid_dict(message)
    field = data.draw(st.sampled_from(sorted(obj)))
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        obj[field] = data.draw(msgpack_values)
    elif action == "delete":
        del obj[field]
    else:
        obj[data.draw(any_keys)] = data.draw(msgpack_values)
    _decode_only_protocol_errors(packed(obj), type(message))


@settings(max_examples=50, deadline=None)
@given(depth=st.integers(1, 60), kind=st.sampled_from(["list", "map"]), model=model_strategy)
def test_decode_deep_nesting_raises_only_protocol_error(depth: int, kind: str, model: type[Message]) -> None:
    _decode_only_protocol_errors(packed({"k": nested(depth, kind)}), model)
