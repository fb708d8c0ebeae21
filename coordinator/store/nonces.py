"""Replay protection's rows: every signed request's nonce, remembered until its window has passed.

Where they live is the store's choice (:meth:`coordinator.store.store.Store.nonce_path`: on SQLite a database file of
their own, in the run's tmpfs folder where the host has one; on PostgreSQL a table of the main database written
through the light connection), so this class is handed an opener and opens that database on first use: only the API
checks signed requests, and the other roles never create the file.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.store.db import Db


class Nonces:
    """The ``nonces`` table, over the connection ``open_db`` returns (opened on first use)."""

    def __init__(self, open_db: Callable[[], Db]) -> None:
        self._open = open_db

    def remember(self, nonce: bytes, expires: float) -> bool:
        """Record a nonce; False if it was already seen (a replay). Durable across a process crash, not a power
        loss (see Store._nonce_db)."""
        conn = self._open()
        with conn.transaction():
            return conn.execute("INSERT INTO nonces(nonce, expires) VALUES(?,?) ON CONFLICT DO NOTHING",
                                (nonce, expires)).rowcount == 1

    def prune(self, now: float) -> int:
        conn = self._open()
        with conn.transaction():
            return conn.execute("DELETE FROM nonces WHERE expires < ?", (now,)).rowcount
