"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny model (built once into the shared cache, ~1 minute on 2 cores, then reused)."""
    from coordinator.tiny_model import ensure_tiny_model

    return ensure_tiny_model()
