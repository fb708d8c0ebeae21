"""What every section of the run config shares: the refusal a bad file or flag raises, and the strict base
model (an unknown key is an error that names it, never a silently ignored setting)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from shared.errors import EchoSwarmError


class ConfigError(EchoSwarmError):
    """A configuration file or flag is invalid; the message names the key and how to fix it."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def cuda_device(device: str) -> bool:
    """'cuda' or 'cuda:K'."""
    kind, _, index = device.partition(":")
    return kind == "cuda" and (not index or index.isdigit())
