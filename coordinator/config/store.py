"""The ``[store]`` section: which database the roles meet through."""

from __future__ import annotations

from pydantic import Field, field_validator

from coordinator.config.base import StrictModel


class StoreConfig(StrictModel):
    url: str | None = Field(None, description="The run's database. Unset: SQLite, run_dir/coordinator.sqlite (one "
                            "host). postgresql://USER[:PASSWORD]@HOST[:PORT]/DB: a PostgreSQL database that roles on "
                            "several hosts share (API processes on a small VM, learner and verifiers on a GPU "
                            "server; docs/operations.md). Needs pip install 'echo-swarm[postgres]'.")

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"store.url must be a postgresql://USER@HOST:PORT/DATABASE URL (got {v[:40]!r}); "
                             f"leave it unset for the run directory's SQLite database")
        return v
