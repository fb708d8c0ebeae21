"""shared/messages.py through shared/wire.py: every message survives encode → decode unchanged."""

from __future__ import annotations

import inspect

import pydantic
import pytest

from shared import messages, wire
from shared.errors import ProtocolError, Reason
from shared.messages import ClientProfile, LeaseResponse, Message, SignedJob

from .factories import all_messages, job, profile

MESSAGES = all_messages()


def test_every_message_class_has_an_example() -> None:
    defined = {cls for _, cls in inspect.getmembers(messages, inspect.isclass)
               if issubclass(cls, Message) and cls is not Message and cls.__module__ == messages.__name__}
    assert defined == {type(m) for m in MESSAGES}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    data = wire.encode(message)
    assert isinstance(data, bytes)
    decoded = wire.decode(data, type(message))
    assert decoded == message
    assert type(decoded) is type(message)
    assert wire.encode(decoded) == data  # canonical: re-encoding gives the same bytes


def test_nested_messages_round_trip_as_models() -> None:
    decoded = wire.decode(wire.encode(job()), type(job()))
    assert decoded.prompts[0].token_ids == [5, 6, 7]
    assert decoded.sampling.stop_token_ids == [2]
    signed = SignedJob(job=wire.encode(job()), signature=b"s" * 64)
    resp = wire.decode(wire.encode(LeaseResponse(job=signed, retry_after_s=0, current_version=0, finished=False)),
                       LeaseResponse)
    assert resp.job is not None and wire.decode(resp.job.job, type(job())) == job()


def test_default_field_may_be_omitted_on_the_wire() -> None:
    obj = wire.unpack(wire.encode(profile()))
    del obj["name"]
    assert wire.decode(wire.pack(obj), ClientProfile).name == ""


def test_lease_prefetch_is_optional_and_strictly_a_bool() -> None:
    # a coordinator that predates LeaseResponse.prefetch omits it: the client reads "fetch when a job needs it"
    obj = wire.unpack(wire.encode(LeaseResponse(job=None, retry_after_s=1.0, current_version=3, finished=False,
                                                prefetch=True)))
    assert obj["prefetch"] is True
    del obj["prefetch"]
    assert wire.decode(wire.pack(obj), LeaseResponse).prefetch is False
    for wrong in (1, "true", None):
        with pytest.raises(ProtocolError) as info:
            wire.decode(wire.pack(obj | {"prefetch": wrong}), LeaseResponse)
        assert info.value.reason is Reason.SCHEMA


def test_messages_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        job().version = 5  # type: ignore[misc]
