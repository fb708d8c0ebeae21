"""Errors that cross a layer of the coordinator, in a leaf module so that whoever raises one and whoever catches
it need not import each other: the verifier engine raises :class:`VersionGone`, and the work queue and the API,
which never import the engine, catch it; the config's checks and the tasks both raise :class:`MissingDependency`."""

from __future__ import annotations

from shared.errors import EchoSwarmError


class VersionGone(LookupError):
    """The requested version is no longer kept (pruned), so it cannot be verified."""


class TaskError(EchoSwarmError):
    """A task's data file is missing or malformed, or its prompts or rewards cannot be set up."""


class MissingDependency(TaskError):
    """A configured task needs an optional package that is not installed; the message says what to install."""
