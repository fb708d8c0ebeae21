"""The coordinator's durable state: one SQLite database (WAL) in the run directory, or one PostgreSQL database
(``store.url``) that roles on several hosts share.

What is promised to a client (an accepted result) and what the learner trained (a step) is made power-safe
before anyone relies on it: on SQLite by :meth:`Store.sync` after the commit (the API before its reply, the
learner before it prunes), an fsync outside the write lock (coordinator.store.db, durability); reply-path state that
can be re-created (leases, nonces, the work queue, role reports) is never synced for its own sake (see
Store.__init__, Store._nonce_db, coordinator.store.job_rows.Jobs.lease).

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
The SQL is written once for both engines; :mod:`coordinator.store.db` holds what differs between them.

The Store owns the connections, the schema and its migrations (``SCHEMA_VERSION``), durability (:meth:`Store.sync`)
and the ``meta`` table; each aggregate's rows are read and written by one small repository over those same
connections, which the Store builds and exposes as an attribute (one class per aggregate keeps each of them, and the
Store, small enough to read):

- ``store.clients`` (coordinator.store.clients): the volunteers' identities;
- ``store.nonces`` (coordinator.store.nonces): replay protection, in the nonce database;
- ``store.versions`` (coordinator.store.versions): the committed policy versions;
- ``store.jobs`` (coordinator.store.job_rows): the job stream and its leases (a job's replica lease included);
- ``store.results`` (coordinator.store.results): accepted and refused results (a replica's credited one included);
- ``store.steps``, ``store.evals`` (coordinator.store.training): the learner's steps, held-out evaluations;
- ``store.work`` (coordinator.store.work_rows): the work queue between role processes;
- ``store.role_status`` (coordinator.store.role_status): what each role reports;
- ``store.trust`` (coordinator.store.trust_rows): the trust boundary's reads and writes;
- ``store.audit`` (coordinator.store.audit): the audit log, written inside the other aggregates' transactions.

An operation that spans tables (an accepted result: job, result, client, audit; a learner step: results, version,
step) is one transaction in the aggregate that owns it. Only this package writes SQL for the run's tables.
Within a process all access happens from the event-loop thread; nothing here is shared across threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.core.leases import JobState
from coordinator.store.audit import Audit
from coordinator.store.clients import Clients
from coordinator.store.db import Db, is_postgres_url, pg_ddl, sql_in
from coordinator.store.hops import WORK_KINDS
from coordinator.store.job_rows import Jobs
from coordinator.store.nonces import Nonces
from coordinator.store.results import Results
from coordinator.store.role_status import RoleStatus
from coordinator.store.tmpfs import run_folder
from coordinator.store.training import Evals, Steps
from coordinator.store.trust_rows import TrustRows
from coordinator.store.versions import Versions
from coordinator.store.work_rows import WorkRows, WorkState

#: The work queue (coordinator.run.workqueue), on its own: schema 6 rebuilds it on SQLite (Store._retire_replication).
WORK_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS work(
  id INTEGER PRIMARY KEY, kind TEXT NOT NULL CHECK(kind IN ({sql_in(k.name for k in WORK_KINDS)})),
  version INTEGER NOT NULL, request BLOB NOT NULL, created_at REAL NOT NULL,
  state TEXT NOT NULL CHECK(state IN ({sql_in(WorkState)})),
  worker TEXT, claim_until REAL, attempts INTEGER NOT NULL DEFAULT 0, answer BLOB, error TEXT,
  requester TEXT NOT NULL DEFAULT 'api');
CREATE INDEX IF NOT EXISTS work_by_state ON work(state, kind, id)"""
SCHEMA = f"""
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
  state TEXT NOT NULL CHECK(state IN ({sql_in(JobState)})),
  lease_id TEXT, lease_client TEXT, lease_deadline REAL, issue_count INTEGER NOT NULL DEFAULT 0,
  lease_precision TEXT);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS results(
  job_id TEXT PRIMARY KEY REFERENCES jobs(job_id), client_id TEXT NOT NULL, lease_id TEXT NOT NULL,
  version INTEGER NOT NULL, received_at REAL NOT NULL, content_sha256 TEXT NOT NULL, payload BLOB NOT NULL,
  rewards TEXT NOT NULL, mean_reward REAL NOT NULL, n_tokens INTEGER NOT NULL, ingested_step INTEGER,
  stale_at INTEGER);
CREATE INDEX IF NOT EXISTS results_pending ON results(ingested_step, stale_at);
CREATE INDEX IF NOT EXISTS results_by_client ON results(client_id, received_at);
CREATE INDEX IF NOT EXISTS results_by_version ON results(version, client_id);
CREATE TABLE IF NOT EXISTS dropped(
  job_id TEXT NOT NULL, client_id TEXT NOT NULL, version INTEGER NOT NULL, PRIMARY KEY(job_id, client_id, version));
CREATE INDEX IF NOT EXISTS dropped_by_client ON dropped(client_id);
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
CREATE TABLE IF NOT EXISTS replica_leases(
  job_id TEXT PRIMARY KEY REFERENCES jobs(job_id), lease_id TEXT NOT NULL, client_id TEXT NOT NULL,
  deadline REAL NOT NULL, version INTEGER NOT NULL, precision TEXT);
CREATE INDEX IF NOT EXISTS replica_leases_by_client ON replica_leases(client_id, deadline);
CREATE INDEX IF NOT EXISTS replica_leases_by_deadline ON replica_leases(deadline);
CREATE TABLE IF NOT EXISTS replica_results(
  job_id TEXT NOT NULL REFERENCES jobs(job_id), client_id TEXT NOT NULL, lease_id TEXT NOT NULL,
  version INTEGER NOT NULL, received_at REAL NOT NULL, content_sha256 TEXT NOT NULL, completions_sha256 TEXT,
  mean_reward REAL NOT NULL, n_tokens INTEGER NOT NULL, credit REAL NOT NULL, PRIMARY KEY(job_id, client_id));
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
#: 7: jobs.lease_precision, the precision a lease named (LeaseRequest.precision): what its result is recomputed in.
#: 8: dropped, the leases that ended without their holder's result, by job, client and version (the
#: selective-reporting rule compares what a client returned with what the jobs it dropped scored in others' hands).
#: 9: replica_leases, a second lease on a job whose first holder's pace is unmeasured, and replica_results, the
#: results of a job's other holder once its first result was accepted: credited, never trained
#: (coordinator.core.leases, issue 37). New tables only: a schema-8 database gains them as they are, empty.
SCHEMA_VERSION = 9
#: Replay protection: on SQLite in its own database file beside the main one, on PostgreSQL a table of the
#: main database (see Store._nonce_db).
NONCE_SCHEMA = "CREATE TABLE IF NOT EXISTS nonces(nonce BLOB PRIMARY KEY, expires REAL NOT NULL)"


class Store:
    """One role process's handle on the run's database: its connections, schema, durability and ``meta`` rows,
    and the aggregates' repositories over them (module docstring)."""

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
        # One repository per aggregate, each over these same connections: an operation that spans tables (an
        # accepted result, a learner step) is one transaction of the aggregate that owns it.
        self.audit = Audit(self.conn)
        self.clients = Clients(self.conn)
        self.nonces = Nonces(self._nonce_db)
        self.versions = Versions(self.conn)
        self.jobs = Jobs(self.conn, self.light_conn)
        self.results = Results(self.conn, self.audit)
        self.steps = Steps(self.conn)
        self.evals = Evals(self.conn)
        self.work = WorkRows(self.conn, self.light_conn)
        self.role_status = RoleStatus(self.conn, self.light_conn)
        self.trust = TrustRows(self.conn, self.audit)

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

    # -- meta ---------------------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self.conn.transaction():
            self.conn.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                              "value=excluded.value", (key, value))

    def add_to_counter(self, key: str, delta: int) -> None:
        """Add ``delta`` to a counter kept in meta (e.g. snapshot bytes served): counters the status page shows
        survive restarts, and several API processes on one store each add their own share."""
        with self.light_conn.transaction():
            self.light_conn.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET "
                                    "value=CAST(CAST(meta.value AS BIGINT) + ? AS TEXT)", (key, str(delta), delta))

    def counter(self, key: str) -> int:
        raw = self.get_meta(key)
        return 0 if raw is None else int(raw)

    # -- migrations -----------------------------------------------------------------------------------------
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
        # schema 7: the precision the current lease named (NULL: the run's default, or a lease from before)
        if "lease_precision" not in self.conn.columns("jobs"):
            self.conn.execute("ALTER TABLE jobs ADD COLUMN lease_precision TEXT")
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
            self.conn.execute("ALTER TABLE work ADD CONSTRAINT work_kind_check "
                              f"CHECK(kind IN ({sql_in(k.name for k in WORK_KINDS)}))")
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

    # -- across the aggregates ----------------------------------------------------------------------------
    def totals(self) -> dict[str, int]:
        """Counts for the status page: accepted and rejected results, reissued jobs, results set aside as stale.
        ``accepted`` counts every result a client was told was accepted — a replicated job's credited second result
        (``replicas``) too — so that it equals the sum of the clients' own counts."""
        acc = self.conn.execute("SELECT COUNT(*) AS n FROM results").fetchone()["n"]
        replicas = self.conn.execute("SELECT COUNT(*) AS n FROM replica_results").fetchone()["n"]
        rej = self.conn.execute("SELECT COUNT(*) AS n FROM rejections").fetchone()["n"]
        reissued = self.conn.execute("SELECT COUNT(*) AS n FROM jobs WHERE issue_count > 1").fetchone()["n"]
        stale = self.conn.execute("SELECT COUNT(*) AS n FROM results WHERE stale_at IS NOT NULL").fetchone()["n"]
        return {"accepted": int(acc) + int(replicas), "rejected": int(rej), "reissued_jobs": int(reissued),
                "too_stale": int(stale), "replicas": int(replicas)}


def _carry_nonces(db: Db, rows: list[tuple[Any, Any]]) -> None:
    """(nonce, expires) pairs from an older layout into the nonce database, in one transaction."""
    with db.transaction():
        db.executemany("INSERT INTO nonces(nonce, expires) VALUES(?,?) ON CONFLICT DO NOTHING", rows)
