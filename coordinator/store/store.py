"""The coordinator's durable state: one SQLite database (WAL) in the run directory, or one PostgreSQL database
(``store.url``) that roles on several hosts share.

What is promised to a client (an accepted result) and what the learner trained (a step) is made power-safe
before anyone relies on it: on SQLite by :meth:`Store.sync` after the commit (the API before its reply, the
learner before it prunes), an fsync outside the write lock (coordinator.store.db, durability); reply-path state that
can be re-created (leases, nonces, the work queue, role reports) is never synced for its own sake (see
Store.__init__, lease_job, _nonce_db).

Invariants the rest of the coordinator relies on:
- a result is committed and synced before the client is told it was accepted;
- a job has at most one accepted result (``results.job_id`` is the primary key, and acceptance is a
  compare-and-set on the job's lease);
- a result is ingested by exactly one learner step: ``ingested_step`` is set in the same transaction that
  records the new policy version, so the database and the published versions never disagree;
- a result older than the staleness bound is set aside (``stale_at``) and never trained on.
Each role process (coordinator.launch.processes: API, learner, verifiers) opens its own Store on the same database. On
SQLite, WAL lets them read concurrently and serialises their writes (BEGIN IMMEDIATE, busy_timeout); on PostgreSQL,
writers lock rows, so several API processes lease at once and each job still goes to one client: a lease is a
compare-and-set on the job's row, and a row another lease is writing is skipped (FOR UPDATE SKIP LOCKED).
The SQL is written once for both engines; :mod:`coordinator.store.db` holds what differs between them. This module is
the only one that writes SQL for the run's tables, and owns their migrations (``SCHEMA_VERSION``).
Within a process all access happens from the event-loop thread; nothing here is shared across threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coordinator.core.jobs import JobPlan
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.reporting import FLAGGED
from coordinator.core.scheduling import Pending
from coordinator.store.db import Db, Row, is_postgres_url, pg_ddl
from coordinator.store.tmpfs import run_folder

#: The work queue (coordinator.run.workqueue), on its own: schema 6 rebuilds it on SQLite (Store._retire_replication).
WORK_SCHEMA = """
CREATE TABLE IF NOT EXISTS work(
  id INTEGER PRIMARY KEY, kind TEXT NOT NULL CHECK(kind IN ('recompute','evaluate')),
  version INTEGER NOT NULL, request BLOB NOT NULL, created_at REAL NOT NULL,
  state TEXT NOT NULL CHECK(state IN ('queued','claimed','done','failed')),
  worker TEXT, claim_until REAL, attempts INTEGER NOT NULL DEFAULT 0, answer BLOB, error TEXT,
  requester TEXT NOT NULL DEFAULT 'api');
CREATE INDEX IF NOT EXISTS work_by_state ON work(state, kind, id)"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients(
  client_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, profile TEXT NOT NULL,
  registered_at REAL NOT NULL, last_seen REAL NOT NULL,
  accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
  credit REAL NOT NULL DEFAULT 0, banned INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS versions(
  version INTEGER PRIMARY KEY, manifest_sha256 TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs(
  job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, version INTEGER, prompt_ids TEXT NOT NULL,
  seed INTEGER NOT NULL, group_size INTEGER NOT NULL, created_at REAL NOT NULL,
  state TEXT NOT NULL CHECK(state IN ('open','leased','done')),
  lease_id TEXT, lease_client TEXT, lease_deadline REAL, issue_count INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS results(
  job_id TEXT PRIMARY KEY REFERENCES jobs(job_id), client_id TEXT NOT NULL, lease_id TEXT NOT NULL,
  version INTEGER NOT NULL, received_at REAL NOT NULL, content_sha256 TEXT NOT NULL, payload BLOB NOT NULL,
  rewards TEXT NOT NULL, mean_reward REAL NOT NULL, n_tokens INTEGER NOT NULL, ingested_step INTEGER,
  stale_at INTEGER);
CREATE INDEX IF NOT EXISTS results_pending ON results(ingested_step, stale_at);
CREATE INDEX IF NOT EXISTS results_by_client ON results(client_id, received_at);
CREATE INDEX IF NOT EXISTS results_by_version ON results(version, client_id);
CREATE TABLE IF NOT EXISTS rejections(
  id INTEGER PRIMARY KEY, client_id TEXT NOT NULL, job_id TEXT, reason TEXT NOT NULL, message TEXT NOT NULL,
  content_sha256 TEXT, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rejections_by_client_job ON rejections(client_id, job_id);
CREATE TABLE IF NOT EXISTS audit(
  id INTEGER PRIMARY KEY, at REAL NOT NULL, client_id TEXT NOT NULL, job_id TEXT, version INTEGER,
  outcome TEXT NOT NULL, reason TEXT NOT NULL, content_sha256 TEXT, detail TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS audit_by_client ON audit(client_id, id);
CREATE INDEX IF NOT EXISTS audit_by_job ON audit(job_id, id);
CREATE TABLE IF NOT EXISTS steps(
  step INTEGER PRIMARY KEY, trained_version INTEGER NOT NULL, mean_reward REAL NOT NULL, metrics TEXT NOT NULL,
  at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS evals(version INTEGER PRIMARY KEY, accuracy REAL NOT NULL, n INTEGER NOT NULL,
  at REAL NOT NULL);
"""+ WORK_SCHEMA + """;
CREATE TABLE IF NOT EXISTS trust(
  client_id TEXT NOT NULL, backend_class TEXT NOT NULL, consecutive_valid INTEGER NOT NULL DEFAULT 0,
  consecutive_invalid INTEGER NOT NULL DEFAULT 0, quarantines INTEGER NOT NULL DEFAULT 0,
  quarantined_until REAL NOT NULL DEFAULT 0, valid_total INTEGER NOT NULL DEFAULT 0,
  invalid_total INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(client_id, backend_class));
"""
#: Bumped whenever SCHEMA or the in-place migrations below change; stored as SQLite's user_version (in PostgreSQL,
#: the meta row 'schema_version') so a database written by a newer release is refused instead of misread.
#: 4: work.requester (several API processes share one queue); 5: SQLite keeps nonces in a file of their own;
#: 6: spot-checks retired (issue 21) — the replicas table and the work queue's 'replay' kind are gone
#: (:meth:`Store._retire_replication`); clients.leased / clients.unreturned count leases for the selective-reporting
#: rule (coordinator.core.reporting); results.completions_sha256 finds copies (coordinator.core.duplicates).
SCHEMA_VERSION = 6
#: Replay protection: on SQLite in its own database file beside the main one, on PostgreSQL a table of the
#: main database (see Store._nonce_db).
NONCE_SCHEMA = "CREATE TABLE IF NOT EXISTS nonces(nonce BLOB PRIMARY KEY, expires REAL NOT NULL)"
WorkKind = Literal["recompute", "evaluate"]


@dataclass(frozen=True)
class JobRow:
    view: LeaseView
    prompt_ids: tuple[int, ...]
    seed: int
    group_size: int
    issue_count: int


@dataclass(frozen=True)
class ResultRow:
    job_id: str
    client_id: str
    version: int
    payload: bytes
    rewards: list[float]


#: The job stream's lock (Db.lock): one writer at a time draws the next sequence number and inserts its job.
JOB_STREAM = "echo-swarm:job-stream"


class Store:
    def __init__(self, path: Path | str) -> None:
        """``path``: the SQLite file, or a ``postgresql://`` URL (store.url)."""
        self.url = str(path) if isinstance(path, str) and is_postgres_url(path) else None
        self.path = Path(path) if self.url is None else Path("postgresql")
        self.conn = Db(self.url or self.path)
        self._nonce_conn: Db | None = None
        self._nonce_file: Path | None = None
        self._migrate()
        # Leases, the transient work queue and role reports (which a power loss may drop: requesters resend,
        # roles report again, a forgotten lease's job is issued again) go through a second connection, which
        # nobody syncs: a commit there is written to the WAL (the OS page cache) without an fsync. That
        # survives a kill -9 of the coordinator exactly (the OS still has the bytes), and the next sync
        # (before the API replies to an accepted result, after a learner step) fsyncs those WAL frames too.
        # On PostgreSQL the light connection commits with synchronous_commit=off, a similar trade: a crash of a
        # role process loses nothing; a crash of the database server or its machine may lose the last ~0.6 s
        # (3 × wal_writer_delay) of such commits, never a result or a step (those commit synchronously).
        self.light_conn = Db(self.url or self.path, light=True)

    @property
    def commits(self) -> int:
        """Commits made through the main connection so far (see :meth:`sync`)."""
        return self.conn.commits

    @property
    def changes(self) -> int:
        """Rows this process changed through either connection: a key for caches of read models, which must
        move when a lease (light connection) changes the jobs as much as when a result (main connection) does."""
        return self.conn.total_changes + self.light_conn.total_changes

    def sync(self) -> None:
        """Make everything committed so far survive a power loss (coordinator.store.db, durability). Blocks for an
        fsync and holds no lock: call it from a worker thread, never an event loop."""
        self.conn.fsync_wal()

    def backup_to(self, dest: Path) -> str:
        """An online, consistent copy of a SQLite database at ``dest``; says what was done. A PostgreSQL database
        is the operator's to back up (pg_dump, or the server's own backups): nothing is copied."""
        if self.url is not None:
            return f"not copied: the run's database is {self.where}; back it up with pg_dump"
        import sqlite3

        db = sqlite3.connect(str(dest))
        try:
            self.conn.backup_sqlite(db)
        finally:
            db.close()
        return dest.name

    @property
    def nonce_path(self) -> Path:
        """SQLite: the nonce database's file — in memory (coordinator.store.tmpfs) where the host has a tmpfs, else
        beside the main one."""
        if self._nonce_file is None:
            folder = run_folder(self.path)
            self._nonce_file = folder / "nonces.sqlite" if folder is not None else self._disk_nonce_path
        return self._nonce_file

    @property
    def _disk_nonce_path(self) -> Path:
        return self.path.with_name(self.path.stem + "-nonces.sqlite")

    def _nonce_db(self) -> Db:
        """Where nonces are remembered, opened on first use (only the API checks signed requests).

        Every signed request writes one nonce. In SQLite's main database that insert queued behind the file's
        single write lock, which every role's transactions take (and, before syncs moved out of commits,
        held through an fsync that takes seconds while the publisher writes a multi-gigabyte snapshot). A file
        of its own has a write lock only API processes take. synchronous=NORMAL: durable across a
        kill -9 (the OS keeps the WAL), not a power loss, which can reopen a replay window of at most
        request_window_s for requests captured just before it — the price of not paying an fsync on every
        signed request. On a host with a tmpfs the file lives there (coordinator.store.tmpfs: a disk write, fsync or
        not, stalls for up to seconds while the publisher's gigabytes go to the same disk; kill -9 keeps tmpfs).
        PostgreSQL locks rows, not the database: nonces stay a table there, written through the light
        connection (synchronous_commit=off)."""
        if self._nonce_conn is None:
            if self.conn.postgres:
                self._nonce_conn = self.light_conn
            else:
                db = Db(self.nonce_path, light=True)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(NONCE_SCHEMA)
                self._nonce_conn = db
                self._adopt_disk_nonces(db)
        return self._nonce_conn

    def _adopt_disk_nonces(self, db: Db) -> None:
        """Nonces a release before coordinator.store.tmpfs kept beside the main file move into the tmpfs one (a replay
        of a request captured just before the upgrade must still be refused); the old file is removed."""
        old = self._disk_nonce_path
        if old == self.nonce_path or not old.exists():
            return
        import sqlite3

        src = sqlite3.connect(str(old))
        try:
            rows = src.execute("SELECT nonce, expires FROM nonces").fetchall()
        except sqlite3.Error:
            rows = []
        finally:
            src.close()
        _carry_nonces(db, rows)
        for suffix in ("", "-wal", "-shm"):
            Path(str(old) + suffix).unlink(missing_ok=True)

    def _nonce_schema(self) -> None:
        """Inside the migration: PostgreSQL keeps nonces in the main database. SQLite's schema up to 4 did too;
        carry the ones still inside their window over to the nonce file (a replay of a request captured just
        before the upgrade must still be refused), then drop the old table."""
        if self.conn.postgres:
            self.conn.execute(pg_ddl(NONCE_SCHEMA))
            return
        if not self.conn.has_table("nonces"):
            return
        rows = self.conn.execute("SELECT nonce, expires FROM nonces").fetchall()
        _carry_nonces(self._nonce_db(), [(r["nonce"], r["expires"]) for r in rows])
        self.conn.execute("DROP TABLE nonces")

    def close(self) -> None:
        if self._nonce_conn is not None and self._nonce_conn is not self.light_conn:
            self._nonce_conn.close()
        self.light_conn.close()
        if self.conn.commits:
            self.sync()  # a command-line tool's last change (admin, ops) is as durable as a reply's
        self.conn.close()

    @property
    def dialect(self) -> str:
        return self.conn.dialect

    @property
    def where(self) -> str:
        """The database, for messages (a URL without its password)."""
        if self.url is None:
            return str(self.path)
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        return f"{u.scheme}://{u.hostname}:{u.port or 5432}{u.path}"

    def _migrate(self) -> None:
        """Create the schema, add columns later releases introduced, and record the schema version — one
        exclusive transaction (PostgreSQL: under an advisory lock), so two role processes opening a new run at
        once do not race."""
        pg = self.conn.postgres
        with self.conn.transaction(exclusive=True):
            if pg:
                self.conn.lock("echo-swarm:migrate")
                self.conn.execute("CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = self.schema_version()
            if found > SCHEMA_VERSION:
                raise RuntimeError(f"{self.where} was written by a newer echo-swarm (schema {found}, this release "
                                   f"reads up to {SCHEMA_VERSION}); upgrade echo-swarm to use this database")
            for statement in (pg_ddl(SCHEMA) if pg else SCHEMA).split(";"):
                if statement.strip():
                    self.conn.execute(statement)
            self._add_client_columns()
            if 0 < found < 6:
                self._retire_replication()
            if pg:
                self.conn.execute("INSERT INTO meta(key,value) VALUES('schema_version',?) ON CONFLICT(key) DO UPDATE "
                                  "SET value=excluded.value", (str(SCHEMA_VERSION),))
            else:
                self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._nonce_schema()

    def schema_version(self) -> int:
        if self.conn.postgres:
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            return 0 if row is None else int(row[0])
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    # -- transactions -------------------------------------------------------------------------------------
    def _tx(self) -> _Tx:
        return _Tx(self.conn)

    # -- meta ---------------------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                              (key, value))

    def add_to_counter(self, key: str, delta: int) -> None:
        """Add ``delta`` to a counter kept in meta (e.g. snapshot bytes served): counters the status page shows
        survive restarts, and several API processes on one store each add their own share."""
        with _Tx(self.light_conn):
            self.light_conn.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                                    "value=CAST(CAST(meta.value AS BIGINT) + ? AS TEXT)", (key, str(delta), delta))

    def counter(self, key: str) -> int:
        raw = self.get_meta(key)
        return 0 if raw is None else int(raw)

    # -- clients ------------------------------------------------------------------------------------------
    def _add_client_columns(self) -> None:
        """Columns added after the first release, added in place to databases created before them."""
        ddl = pg_ddl if self.conn.postgres else str
        have = self.conn.columns("clients")
        if "benchmark_tokens_per_s" not in have:  # self-benchmark reported at registration (NULL: none)
            self.conn.execute(ddl("ALTER TABLE clients ADD COLUMN benchmark_tokens_per_s REAL"))
        # the trust boundary's observations (coordinator.api.guard): the backend class pinned at first registration
        # (NULL for identities registered before it: derived from the profile) and the addresses it registered
        # from, first and latest (for the operator: which identities share a network)
        for col in ("backend_class", "address", "last_address"):
            if col not in have:
                self.conn.execute(ddl(f"ALTER TABLE clients ADD COLUMN {col} TEXT"))
        # schema 6: leases granted, and how many of them ended without a result from the client (released, or
        # run out and reissued) — what the selective-reporting rule reads (coordinator.core.reporting)
        for col in ("leased", "unreturned"):
            if col not in have:
                self.conn.execute(ddl(f"ALTER TABLE clients ADD COLUMN {col} INTEGER NOT NULL DEFAULT 0"))
        # schema 6: the content hash of an accepted result's tokens (shared.hashing.tokens_sha256; NULL for results
        # from before), indexed: a copy of another job's result is found by one lookup (coordinator.core.duplicates)
        if "completions_sha256" not in self.conn.columns("results"):
            self.conn.execute("ALTER TABLE results ADD COLUMN completions_sha256 TEXT")
        self.conn.execute("CREATE INDEX IF NOT EXISTS results_by_completions ON results(completions_sha256)")
        # schema 4: which API process asked (API processes sharing a PostgreSQL store each drop only their own
        # previous run's requests when they start)
        if "requester" not in self.conn.columns("work"):
            self.conn.execute("ALTER TABLE work ADD COLUMN requester TEXT NOT NULL DEFAULT 'api'")

    def _retire_replication(self) -> None:
        """Schema 6: spot-check replication is retired (every token is checked by the keyed sampler instead,
        docs/security.md). A database from before loses the ``replicas`` table — replicas, holds, arbiter
        judgements — and the work queue's ``replay`` kind. A result that was held for a spot-check becomes an
        ordinary pending one: it passed every per-result check when it was accepted. The work queue is transient
        (requesters resend), so its replay requests are dropped and, on SQLite, the table is rebuilt for the new
        CHECK constraint (SQLite cannot alter a constraint in place)."""
        if self.conn.has_table("replicas"):
            self.conn.execute("DROP TABLE replicas")
        if self.conn.postgres:
            self.conn.execute("DELETE FROM work WHERE kind='replay'")
            self.conn.execute("ALTER TABLE work DROP CONSTRAINT IF EXISTS work_kind_check")
            self.conn.execute("ALTER TABLE work ADD CONSTRAINT work_kind_check CHECK(kind IN ('recompute','evaluate'))")
            return
        row = self.conn.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name='work'").fetchone()
        if row is None or "'replay'" not in str(row["sql"]):
            return
        self.conn.execute("ALTER TABLE work RENAME TO work_before_6")
        self.conn.execute("DROP INDEX IF EXISTS work_by_state")
        for statement in WORK_SCHEMA.split(";"):
            self.conn.execute(statement)
        self.conn.execute("INSERT INTO work(id, kind, version, request, created_at, state, worker, claim_until, "
                          "attempts, answer, error, requester) SELECT id, kind, version, request, created_at, state, "
                          "worker, claim_until, attempts, answer, error, requester FROM work_before_6 "
                          "WHERE kind!='replay'")
        self.conn.execute("DROP TABLE work_before_6")

    def register_client(self, client_id: str, public_key: bytes, profile: dict[str, Any], now: float, *,
                        backend_class: str | None = None, address: str | None = None) -> bool:
        """Insert or refresh a client. Returns True if it is new. The profile's self-benchmark (tokens/s, if
        reported) is also kept in its own column, ``benchmark_tokens_per_s``, for the scheduler.
        ``backend_class`` is pinned by the first registration that gives one (a refresh never changes it);
        ``address`` is the first registration's remote address, ``last_address`` the latest one's."""
        bench = profile.get("benchmark_tokens_per_s")
        with self._tx():
            cur = self.conn.execute(
                "INSERT INTO clients(client_id, public_key, profile, registered_at, last_seen, "
                "benchmark_tokens_per_s, backend_class, address, last_address) VALUES(?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT DO NOTHING",
                (client_id, public_key, json.dumps(profile), now, now, bench, backend_class, address, address),
            )
            if cur.rowcount == 0:
                self.conn.execute("UPDATE clients SET profile=?, last_seen=?, benchmark_tokens_per_s=?, "
                                  "backend_class=COALESCE(backend_class, ?), address=COALESCE(address, ?), "
                                  "last_address=COALESCE(?, last_address) WHERE client_id=?",
                                  (json.dumps(profile), now, bench, backend_class, address, address, client_id))
                return False
            return True

    def expire_idle_clients(self, keep: int, now: float, spare: str = "") -> list[str]:
        """Remove the identities that never had a result accepted, oldest last seen first, until at most ``keep``
        remain (registration.max_idle_identities; issue 24): a registration flood then grows the store by nothing.
        Banned, quarantined and lease-holding identities are kept, and ``spare`` (the one just registered). Their
        trust rows go with them; the audit log
        stays. Returns the removed ids (the API forgets them in memory too)."""
        idle = "accepted=0 AND banned=0"
        with self._tx():
            (count,), = self.conn.execute(f"SELECT COUNT(*) FROM clients WHERE {idle}").fetchall()
            if count <= keep:
                return []
            rows = self.conn.execute(
                f"SELECT client_id FROM clients WHERE {idle} AND client_id != ? AND client_id NOT IN (SELECT lease_client FROM jobs "
                "WHERE state='leased' AND lease_client IS NOT NULL) AND client_id NOT IN (SELECT client_id FROM "
                "trust WHERE quarantined_until > ?) ORDER BY last_seen, registered_at LIMIT ?",
                (spare, now, count - keep)).fetchall()
            gone = [str(r["client_id"]) for r in rows]
            for cid in gone:
                self.conn.execute("DELETE FROM trust WHERE client_id=?", (cid,))
                self.conn.execute("DELETE FROM clients WHERE client_id=?", (cid,))
            return gone

    def count_clients(self) -> int:
        (n,), = self.conn.execute("SELECT COUNT(*) FROM clients").fetchall()
        return int(n)

    def get_client(self, client_id: str) -> Row | None:
        return self.conn.execute("SELECT * FROM clients WHERE client_id=?", (client_id,)).fetchone()

    def set_banned(self, client_id: str, banned: bool) -> bool:
        with self._tx():
            return self.conn.execute("UPDATE clients SET banned=? WHERE client_id=?",
                                     (int(banned), client_id)).rowcount == 1

    def clients(self) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT client_id, profile, registered_at, last_seen, accepted, rejected, credit, "
                                 "banned, benchmark_tokens_per_s, leased, unreturned FROM clients "
                                 "ORDER BY credit DESC, registered_at").fetchall()
        return [dict(r) | {"profile": json.loads(r["profile"])} for r in rows]

    # -- nonces -------------------------------------------------------------------------------------------
    def remember_nonce(self, nonce: bytes, expires: float) -> bool:
        """Record a nonce; False if it was already seen (a replay). Durable across a process crash, not a power
        loss (see __init__)."""
        conn = self._nonce_db()
        with _Tx(conn):
            return conn.execute("INSERT INTO nonces(nonce, expires) VALUES(?,?) ON CONFLICT DO NOTHING",
                                (nonce, expires)).rowcount == 1

    def prune_nonces(self, now: float) -> int:
        conn = self._nonce_db()
        with _Tx(conn):
            return conn.execute("DELETE FROM nonces WHERE expires < ?", (now,)).rowcount

    # -- versions and jobs --------------------------------------------------------------------------------
    def current_version(self) -> int | None:
        row = self.conn.execute("SELECT MAX(version) AS v FROM versions").fetchone()
        return None if row["v"] is None else int(row["v"])

    def manifest_sha(self, version: int) -> str | None:
        row = self.conn.execute("SELECT manifest_sha256 FROM versions WHERE version=?", (version,)).fetchone()
        return None if row is None else str(row["manifest_sha256"])

    def versions(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM versions ORDER BY version").fetchall()]

    def publish_initial(self, manifest_sha: str, now: float) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO versions(version, manifest_sha256, created_at) VALUES(0,?,?)",
                              (manifest_sha, now))

    def next_seq(self, db: Db | None = None) -> int:
        """The next number of the job stream."""
        row = (db or self.conn).execute("SELECT MAX(seq) AS j FROM jobs").fetchone()
        return (-1 if row["j"] is None else int(row["j"])) + 1

    def create_next_job(self, plan: Callable[[int], JobPlan], group_size: int, now: float) -> JobRow:
        """Draw the next number of the job stream and insert the job ``plan(seq)`` makes of it, in one
        transaction under the job stream's lock: API processes sharing a PostgreSQL database never draw the
        same number.

        Through the light connection, as a lease (it happens on a lease's path): a new job is re-creatable. A
        power loss that forgets it forgets its lease too, and the same number is drawn and planned again; a
        result for it is only ever accepted after the job's row, and its sync covers both."""
        with _Tx(self.light_conn):
            self.light_conn.lock(JOB_STREAM)
            made = plan(self.next_seq(self.light_conn))
            self._insert_job(made, group_size, now, self.light_conn)
        row = self.get_job(made.job_id)
        assert row is not None
        return row

    def create_job(self, plan: JobPlan, group_size: int, now: float) -> JobRow:
        with self._tx():
            self._insert_job(plan, group_size, now)
        row = self.get_job(plan.job_id)
        assert row is not None
        return row

    def _insert_job(self, plan: JobPlan, group_size: int, now: float, db: Db | None = None) -> None:
        (db or self.conn).execute(
            "INSERT INTO jobs(job_id, seq, prompt_ids, seed, group_size, created_at, state) VALUES(?,?,?,?,?,?,'open')",
            (plan.job_id, plan.seq, json.dumps(list(plan.prompt_ids)), plan.seed, group_size, now))

    @staticmethod
    def _job(row: Row) -> JobRow:
        version = None if row["version"] is None else int(row["version"])
        view = LeaseView(row["job_id"], JobState(row["state"]), version, float(row["created_at"]),
                         row["lease_id"], row["lease_client"], row["lease_deadline"])
        return JobRow(view, tuple(json.loads(row["prompt_ids"])), int(row["seed"]), int(row["group_size"]),
                      int(row["issue_count"]))

    def get_job(self, job_id: str) -> JobRow | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else self._job(row)

    def active_jobs(self) -> list[JobRow]:
        """Jobs not yet done (open, leased, or leased with an expired lease), oldest first."""
        rows = self.conn.execute("SELECT * FROM jobs WHERE state != 'done' ORDER BY seq")
        return [self._job(r) for r in rows.fetchall()]

    def lease_job(self, job_id: str, lease_id: str, client_id: str, deadline: float, version: int, now: float) -> bool:
        """Compare-and-set: lease the job (bound to ``version``) only if it is open or its lease has expired.

        Through the no-fsync connection: a lease is reply-path state a client waits on, and an fsync there queues
        behind the publisher's multi-gigabyte writes. A kill -9 keeps it exactly; the next sync (an accepted result, a
        step) makes it power-safe; a power loss before that forgets the lease, and the job is
        issued again."""
        with _Tx(self.light_conn):
            before = self.light_conn.execute("SELECT state, lease_client FROM jobs WHERE job_id=?",
                                             (job_id,)).fetchone()
            cur = self.light_conn.execute(
                "UPDATE jobs SET state='leased', lease_id=?, lease_client=?, lease_deadline=?, version=?, "
                "issue_count=issue_count+1 WHERE job_id=(SELECT job_id FROM jobs WHERE job_id=? AND "
                f"(state='open' OR (state='leased' AND lease_deadline<=?)){self.light_conn.skip_locked})",
                (lease_id, client_id, deadline, version, job_id, now),
            )
            if cur.rowcount != 1:
                return False
            self.light_conn.execute("UPDATE clients SET leased=leased+1 WHERE client_id=?", (client_id,))
            if before is not None and before["state"] == "leased" and before["lease_client"]:
                self._count_unreturned(self.light_conn, str(before["lease_client"]), job_id)  # it ran out
            return True

    @staticmethod
    def _count_unreturned(db: Db, client_id: str, job_id: str) -> None:
        """A lease of ``client_id`` on ``job_id`` ended without its result: counted unless the client did send
        one that was refused (a refused result was returned; the refusal is counted where it belongs)."""
        db.execute("UPDATE clients SET unreturned=unreturned+1 WHERE client_id=? AND NOT EXISTS (SELECT 1 FROM "
                   "rejections WHERE rejections.client_id=? AND rejections.job_id=?)", (client_id, client_id, job_id))

    def release_lease(self, job_id: str, lease_id: str, client_id: str) -> bool:
        with _Tx(self.light_conn):  # as lease_job: a forgotten release only means the lease runs out
            cur = self.light_conn.execute(
                "UPDATE jobs SET state='open', lease_deadline=NULL WHERE job_id=? AND lease_id=? AND lease_client=? "
                "AND state='leased'", (job_id, lease_id, client_id))
            if cur.rowcount != 1:
                return False
            self._count_unreturned(self.light_conn, client_id, job_id)
            return True

    # -- results ------------------------------------------------------------------------------------------
    def accept_result(self, *, job_id: str, lease_id: str, client_id: str, version: int, content_sha256: str,
                      payload: bytes, rewards: list[float], n_tokens: int, credit: float, now: float,
                      completions_sha256: str | None = None) -> bool:
        """Durably record an accepted result, closing the job. False if the lease changed meanwhile.
        ``completions_sha256``: the content hash of its tokens (shared.hashing.tokens_sha256), for
        :meth:`result_with_tokens`."""
        try:
            self._accept(job_id, lease_id, client_id, version, content_sha256, payload, rewards, n_tokens, credit, now,
                         completions_sha256)
        except _Abort:
            return False
        return True

    def _accept(self, job_id: str, lease_id: str, client_id: str, version: int, content_sha256: str, payload: bytes,
                rewards: list[float], n_tokens: int, credit: float, now: float, completions_sha256: str | None
                ) -> None:
        with self._tx():
            cur = self.conn.execute(
                "UPDATE jobs SET state='done' WHERE job_id=? AND lease_id=? AND lease_client=? AND state='leased'",
                (job_id, lease_id, client_id))
            if cur.rowcount != 1:
                raise _Abort
            self.conn.execute(
                "INSERT INTO results(job_id, client_id, lease_id, version, received_at, content_sha256, payload, "
                "rewards, mean_reward, n_tokens, completions_sha256) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                (job_id, client_id, lease_id, version, now, content_sha256, payload, json.dumps(rewards),
                 sum(rewards) / max(1, len(rewards)), n_tokens, completions_sha256))
            self.conn.execute("UPDATE clients SET accepted=accepted+1, credit=credit+?, last_seen=? WHERE client_id=?",
                              (credit, now, client_id))
            self.audit_write(now, client_id, job_id, version, "accepted", "ok", content_sha256)

    def accepted_result(self, job_id: str) -> Row | None:
        return self.conn.execute("SELECT client_id, content_sha256, mean_reward, n_tokens FROM results WHERE job_id=?",
                                 (job_id,)).fetchone()

    def result_with_tokens(self, completions_sha256: str, other_than: str) -> str | None:
        """The job id of an accepted result, of another job than ``other_than``, whose tokens have this content
        hash (coordinator.core.duplicates), or None."""
        row = self.conn.execute("SELECT job_id FROM results WHERE completions_sha256=? AND job_id!=? LIMIT 1",
                                (completions_sha256, other_than)).fetchone()
        return None if row is None else str(row["job_id"])

    def record_rejection(self, client_id: str, job_id: str | None, reason: str, message: str,
                         content_sha256: str | None, now: float, version: int | None = None) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO rejections(client_id, job_id, reason, message, content_sha256, at) "
                              "VALUES(?,?,?,?,?,?)", (client_id, job_id, reason, message, content_sha256, now))
            self.conn.execute("UPDATE clients SET rejected=rejected+1 WHERE client_id=?", (client_id,))
            self.audit_write(now, client_id, job_id, version, "rejected", reason, content_sha256, message)

    def refused_jobs(self, client_id: str, job_ids: list[str]) -> frozenset[str]:
        """Which of ``job_ids`` this client already had a result refused for (reissue them to someone else)."""
        if not job_ids:
            return frozenset()
        marks = ",".join("?" * len(job_ids))
        rows = self.conn.execute(f"SELECT DISTINCT job_id FROM rejections WHERE client_id=? AND job_id IN ({marks})",
                                 (client_id, *job_ids)).fetchall()
        return frozenset(r["job_id"] for r in rows)

    def audit_write(self, at: float, client_id: str, job_id: str | None, version: int | None, outcome: str,
                    reason: str, content_sha256: str | None, detail: str = "") -> None:
        """One audit line; callers run it inside the transaction that makes the outcome durable."""
        self.conn.execute("INSERT INTO audit(at, client_id, job_id, version, outcome, reason, content_sha256, detail) "
                          "VALUES(?,?,?,?,?,?,?,?)", (at, client_id, job_id, version, outcome, reason,
                                                      content_sha256, detail[:2048]))

    def audit(self, *, client_id: str | None = None, job_id: str | None = None, outcome: str | None = None,
              reason: str | None = None, since: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Audit lines matching every given filter, newest first (at most ``limit``, capped at 10,000)."""
        where: list[str] = []
        args: list[Any] = []
        for col, val in (("client_id", client_id), ("job_id", job_id), ("outcome", outcome), ("reason", reason)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        if since is not None:
            where.append("at>=?")
            args.append(since)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        return [dict(r) for r in self.conn.execute(sql, (*args, max(1, min(limit, 10_000)))).fetchall()]

    def pending(self) -> list[Pending]:
        """Accepted results neither trained on nor set aside as too stale."""
        rows = self.conn.execute("SELECT job_id, version, received_at FROM results WHERE ingested_step IS NULL "
                                 "AND stale_at IS NULL").fetchall()
        return [Pending(r["job_id"], int(r["version"]), float(r["received_at"])) for r in rows]

    def live_leases(self, now: float) -> int:
        row = self.conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE state='leased' AND lease_deadline > ?",
                                (now,)).fetchone()
        return int(row["n"])

    def result_rows(self, job_ids: list[str]) -> list[ResultRow]:
        marks = ",".join("?" * len(job_ids))
        rows = self.conn.execute(f"SELECT job_id, client_id, version, payload, rewards FROM results WHERE job_id IN "
                                 f"({marks})", job_ids).fetchall()
        by_id = {r["job_id"]: r for r in rows}
        return [ResultRow(j, by_id[j]["client_id"], int(by_id[j]["version"]), bytes(by_id[j]["payload"]),
                          json.loads(by_id[j]["rewards"])) for j in job_ids]

    def mark_stale(self, job_ids: list[str], at_version: int) -> None:
        """Set results aside that are older than the staleness bound: credited, never trained on."""
        with self._tx():
            self.conn.executemany("UPDATE results SET stale_at=? WHERE job_id=? AND ingested_step IS NULL",
                                  [(at_version, j) for j in job_ids])

    def commit_step(self, *, step: int, trained_version: int, job_ids: list[str], new_version: int,
                    manifest_sha: str, mean_reward: float, metrics: dict[str, Any], now: float) -> None:
        """One transaction: the batch is ingested and the new version exists — or neither."""
        with self._tx():
            marked = self.conn.executemany(
                "UPDATE results SET ingested_step=? WHERE job_id=? AND ingested_step IS NULL AND stale_at IS NULL",
                [(step, j) for j in job_ids])
            if marked != len(job_ids):
                raise RuntimeError(f"step {step}: {marked} of {len(job_ids)} results were still pending")
            self.conn.execute("INSERT INTO versions(version, manifest_sha256, created_at) VALUES(?,?,?)",
                              (new_version, manifest_sha, now))
            self.conn.execute("INSERT INTO steps(step, trained_version, mean_reward, metrics, at) VALUES(?,?,?,?,?)",
                              (step, trained_version, mean_reward, json.dumps(metrics), now))

    def record_eval(self, version: int, accuracy: float, n: int, now: float) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO evals(version, accuracy, n, at) VALUES(?,?,?,?) ON CONFLICT(version) DO "
                              "UPDATE SET accuracy=excluded.accuracy, n=excluded.n, at=excluded.at",
                              (version, accuracy, n, now))

    # -- work queue: verification and evaluation requests between role processes (coordinator.run.workqueue) --
    def work_submit(self, kind: WorkKind, version: int, request: bytes, now: float, requester: str = "api") -> int:
        with _Tx(self.light_conn):
            row = self.light_conn.execute("INSERT INTO work(kind, version, request, created_at, state, requester) "
                                          "VALUES(?,?,?,?,'queued',?) RETURNING id",
                                          (kind, version, request, now, requester)).fetchone()
        return int(row[0])

    def work_claim(self, worker: str, kinds: tuple[str, ...], limit: int, until: float, now: float
                   ) -> list[Row]:
        """Claim up to ``limit`` queued items (or items whose claim ran out: a worker that died), oldest first."""
        marks = ",".join("?" * len(kinds))
        waiting = (f"SELECT id FROM work WHERE kind IN ({marks}) AND (state='queued' OR (state='claimed' AND "
                   f"claim_until < ?)) ORDER BY id LIMIT ?")
        if not self.conn.execute(waiting, (*kinds, now, 1)).fetchone():
            return []  # the common case, polled often: no write lock taken
        with _Tx(self.light_conn):  # several verifier workers claim at once: each skips what another is claiming
            rows = self.light_conn.execute(waiting + self.light_conn.skip_locked, (*kinds, now, limit)).fetchall()
            ids = [int(r["id"]) for r in rows]
            self.light_conn.executemany("UPDATE work SET state='claimed', worker=?, claim_until=?, attempts=attempts+1 "
                                  "WHERE id=?", [(worker, until, i) for i in ids])
        if not ids:
            return []
        return self.light_conn.execute(f"SELECT * FROM work WHERE id IN ({','.join('?' * len(ids))}) ORDER BY id",
                                 ids).fetchall()

    def work_renew(self, worker: str, ids: list[int], until: float) -> None:
        with _Tx(self.light_conn):
            self.light_conn.executemany("UPDATE work SET claim_until=? WHERE id=? AND worker=? AND state='claimed'",
                                  [(until, i, worker) for i in ids])

    def work_unclaim(self, worker: str) -> int:
        """A restarted worker hands back what its previous life had claimed, without waiting for the claims to
        run out."""
        with _Tx(self.light_conn):
            cur = self.light_conn.execute("UPDATE work SET state='queued', worker=NULL, claim_until=NULL "
                                    "WHERE worker=? AND state='claimed'", (worker,))
        return cur.rowcount

    def work_finish(self, item_id: int, worker: str, answer: bytes | None, error: str | None = None) -> bool:
        """Record an answer (or a failure) — only by the worker that holds the claim."""
        with _Tx(self.light_conn):
            cur = self.light_conn.execute("UPDATE work SET state=?, answer=?, error=? WHERE id=? AND worker=? AND "
                                    "state='claimed'", ("failed" if error is not None else "done", answer, error,
                                                        item_id, worker))
        return cur.rowcount == 1

    def work_item(self, item_id: int) -> Row | None:
        return self.light_conn.execute("SELECT * FROM work WHERE id=?", (item_id,)).fetchone()

    def work_delete(self, item_ids: list[int]) -> None:
        with _Tx(self.light_conn):
            self.light_conn.executemany("DELETE FROM work WHERE id=?", [(i,) for i in item_ids])

    def work_drop(self, kinds: tuple[str, ...], requester: str | None = None) -> int:
        """Forget every item of these kinds (of ``requester``, if given): their requester restarted and no longer
        waits for them."""
        who, args = ("", kinds) if requester is None else (" AND requester=?", (*kinds, requester))
        with _Tx(self.light_conn):
            cur = self.light_conn.execute(f"DELETE FROM work WHERE kind IN ({','.join('?' * len(kinds))}){who}", args)
        return cur.rowcount

    def work_counts(self) -> dict[str, int]:
        rows = self.light_conn.execute("SELECT state, COUNT(*) AS n FROM work GROUP BY state").fetchall()
        return {str(r["state"]): int(r["n"]) for r in rows}

    # -- role status: what each role process reports for the others and the status page -------------------
    def set_role_status(self, role: str, status: dict[str, Any]) -> None:
        with _Tx(self.light_conn):
            self.light_conn.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                                    "value=excluded.value", (f"role:{role}", json.dumps(status, default=str)))

    def role_status(self, role: str) -> dict[str, Any] | None:
        raw = self.get_meta(f"role:{role}")
        return None if raw is None else dict(json.loads(raw))

    def role_statuses(self) -> dict[str, dict[str, Any]]:
        rows = self.light_conn.execute("SELECT key, value FROM meta WHERE key LIKE 'role:%' ORDER BY key").fetchall()
        return {str(r["key"])[5:]: json.loads(r["value"]) for r in rows}

    # -- the trust boundary's state (coordinator.api.guard keeps the rules; its rows live here) -------------------
    def trust_row(self, client_id: str, bclass: str) -> Row | None:
        return self.conn.execute("SELECT * FROM trust WHERE client_id=? AND backend_class=?",
                                 (client_id, bclass)).fetchone()

    def put_trust(self, client_id: str, bclass: str, consecutive_valid: int, consecutive_invalid: int,
                  quarantines: int, quarantined_until: float, valid: bool) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO trust(client_id, backend_class) VALUES(?,?) ON CONFLICT DO NOTHING",
                              (client_id, bclass))
            self.conn.execute(
                "UPDATE trust SET consecutive_valid=?, consecutive_invalid=?, quarantines=?, quarantined_until=?, "
                f"{'valid_total=valid_total+1' if valid else 'invalid_total=invalid_total+1'} "
                "WHERE client_id=? AND backend_class=?",
                (consecutive_valid, consecutive_invalid, quarantines, quarantined_until, client_id, bclass))

    def quarantined_until(self, client_id: str) -> float:
        row = self.conn.execute("SELECT MAX(quarantined_until) AS q FROM trust WHERE client_id=?",
                                (client_id,)).fetchone()
        return float(row["q"] or 0.0)

    def reward_groups(self, client_id: str) -> list[tuple[str, int, int, float, float]]:
        """(client, version, results, sum and sum of squares of their mean rewards) for every identity, at each
        version ``client_id`` has results at: the selective-reporting rule's input (core.reporting.VersionGroup)."""
        rows = self.conn.execute(
            "SELECT client_id, version, COUNT(*) AS n, SUM(mean_reward) AS s, SUM(mean_reward*mean_reward) AS q "
            "FROM results WHERE version IN (SELECT DISTINCT version FROM results WHERE client_id=?) "
            "GROUP BY client_id, version", (client_id,)).fetchall()
        return [(str(r["client_id"]), int(r["version"]), int(r["n"]), float(r["s"]), float(r["q"])) for r in rows]

    def lease_counts(self, client_id: str) -> tuple[int, int]:
        """(leases granted, leases that ended without a result) of one identity."""
        row = self.conn.execute("SELECT leased, unreturned FROM clients WHERE client_id=?", (client_id,)).fetchone()
        return (0, 0) if row is None else (int(row["leased"]), int(row["unreturned"]))

    def record_flag(self, client_id: str, now: float, reason: str, detail: str) -> None:
        """An audit line for a lowering of trust that is no refusal (outcome core.reporting.FLAGGED)."""
        with self._tx():
            self.audit_write(now, client_id, None, None, FLAGGED, reason, None, detail)

    def flag_count(self, client_id: str, reason: str) -> int:
        row = self.conn.execute("SELECT COUNT(*) AS n FROM audit WHERE client_id=? AND outcome=? AND reason=?",
                                (client_id, FLAGGED, reason)).fetchone()
        return int(row["n"])

    def last_flag(self, client_id: str, reason: str) -> float | None:
        row = self.conn.execute("SELECT MAX(at) AS at FROM audit WHERE client_id=? AND outcome=? AND reason=?",
                                (client_id, FLAGGED, reason)).fetchone()
        return None if row is None or row["at"] is None else float(row["at"])

    def standings(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM trust ORDER BY client_id, backend_class")]

    def client_class_row(self, client_id: str) -> Row | None:
        return self.conn.execute("SELECT backend_class, profile FROM clients WHERE client_id=?",
                                 (client_id,)).fetchone()

    def leases_held(self, client_id: str, now: float) -> int:
        """Live (unexpired) leases of one client."""
        row = self.conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE state='leased' AND lease_client=? AND "
                                "lease_deadline>?", (client_id, now)).fetchone()
        return int(row["n"])

    # -- read models for status ---------------------------------------------------------------------------
    def steps(self) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT * FROM steps ORDER BY step").fetchall()
        return [dict(r) | {"metrics": json.loads(r["metrics"])} for r in rows]

    def last_step(self) -> dict[str, Any] | None:
        """The newest step's number, mean reward and time, or None before the first."""
        row = self.conn.execute("SELECT step, mean_reward, at FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return None if row is None else dict(row)

    def reward_curve(self) -> list[float]:
        """Every step's mean rollout reward, in step order."""
        return [float(r[0]) for r in self.conn.execute("SELECT mean_reward FROM steps ORDER BY step").fetchall()]

    def step_metrics_after(self, step: int) -> list[tuple[int, dict[str, Any]]]:
        """(step, metrics) of every step after ``step``, in order (what a scrape has not counted yet)."""
        rows = self.conn.execute("SELECT step, metrics FROM steps WHERE step > ? ORDER BY step", (step,)).fetchall()
        return [(int(r["step"]), json.loads(r["metrics"])) for r in rows]

    def evals(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM evals ORDER BY version").fetchall()]

    def totals(self) -> dict[str, int]:
        acc = self.conn.execute("SELECT COUNT(*) AS n FROM results").fetchone()["n"]
        rej = self.conn.execute("SELECT COUNT(*) AS n FROM rejections").fetchone()["n"]
        reissued = self.conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE issue_count > 1").fetchone()["n"]
        stale = self.conn.execute("SELECT COUNT(*) AS n FROM results WHERE stale_at IS NOT NULL").fetchone()["n"]
        return {"accepted": int(acc), "rejected": int(rej), "reissued_jobs": int(reissued), "too_stale": int(stale)}

    def results_summary(self) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT job_id, client_id, version, content_sha256, mean_reward, ingested_step "
                                 "FROM results ORDER BY received_at").fetchall()
        return [dict(r) for r in rows]

    def rejections(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self.conn.execute("SELECT * FROM rejections ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [dict(r) for r in rows]


class _Abort(Exception):
    """Raised inside a transaction to roll it back."""


def _carry_nonces(db: Db, rows: list[tuple[Any, Any]]) -> None:
    """(nonce, expires) pairs from an older layout into the nonce database, in one transaction."""
    with _Tx(db):
        db.executemany("INSERT INTO nonces(nonce, expires) VALUES(?,?) ON CONFLICT DO NOTHING", rows)


class _Tx:
    """BEGIN (SQLite: IMMEDIATE) … COMMIT, rolled back on any exception (which then propagates)."""

    def __init__(self, conn: Db) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.conn.commit()
            return False
        self.conn.rollback()
        return False
