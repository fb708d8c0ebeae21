"""A private PostgreSQL server on loopback, for the demo (``echo-swarm demo --store postgresql`` without a URL),
the tests and the benchmarks: the operating system's own PostgreSQL binaries (Debian: ``apt-get install
postgresql``), a fresh data directory, a free port on 127.0.0.1, trust authentication for one superuser (nothing
listens beyond loopback), stopped by :meth:`LocalPostgres.stop`.

PostgreSQL refuses to run as root; when root starts it, the server runs as the ``postgres`` system user (which
the Debian package creates) and the data directory is handed to that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from shared.errors import EchoSwarmError

SUPERUSER = "echo_swarm"
START_TIMEOUT_S = 60


class PostgresUnavailable(EchoSwarmError):
    """No PostgreSQL server binaries, or the server would not start."""


def find_bindir() -> Path:
    """The directory holding initdb and pg_ctl: $ECHO_SWARM_PG_BINDIR, PATH, or Debian's versioned folders."""
    env = os.environ.get("ECHO_SWARM_PG_BINDIR")
    candidates = [env] if env else []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for c in candidates:
        if c and (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    raise PostgresUnavailable("no PostgreSQL server binaries found (initdb, pg_ctl); install them "
                              "(Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql), or set "
                              "ECHO_SWARM_PG_BINDIR to their folder, or give a store URL of a running server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reachable_by(path: Path, uid: int) -> bool:
    """Whether user ``uid`` (not root, not in root's group) may enter every existing folder above ``path``."""
    import stat

    for folder in [p for p in Path(path).resolve().parents if p.exists()]:
        st = folder.stat()
        if not st.st_mode & (stat.S_IXUSR if st.st_uid == uid else stat.S_IXOTH):
            return False
    return True


class LocalPostgres:
    """``durable=False`` turns fsync off (tests: a crash of the machine loses the throwaway cluster anyway)."""

    def __init__(self, root: Path | None = None, *, durable: bool = True) -> None:
        self.bindir = find_bindir()
        self._owned_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="echo-swarm-pg-")) if root is None else Path(root)
        self.data = self.root / "data"
        self.durable = durable
        self.port = 0
        self._run_as: str | None = None
        if os.geteuid() == 0:  # postgres refuses root: run it as the system user the package created
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable("running as root, and there is no 'postgres' system user to run the "
                                          "server as; install the postgresql package or run as another user"
                                          ) from None
            self._run_as = "postgres"
            if not self._owned_root and not _reachable_by(self.root, pwd.getpwnam("postgres").pw_uid):
                # e.g. under pytest's 0700 temp folders: the server's user could not reach its own data directory
                self.root = Path(tempfile.mkdtemp(prefix="echo-swarm-pg-"))
                self.data = self.root / "data"
                self._owned_root = True

    def _run(self, *args: str, timeout: float = START_TIMEOUT_S) -> None:
        done = subprocess.run([str(self.bindir / args[0]), *args[1:]], user=self._run_as, capture_output=True,
                              text=True, timeout=timeout, cwd=self.root)
        if done.returncode != 0:
            raise PostgresUnavailable(f"{args[0]} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")

    def start(self) -> LocalPostgres:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._run_as is not None:
            entry = pwd.getpwnam(self._run_as)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
                      "--locale=C", *(() if self.durable else ("--no-sync",)))
        self.port = _free_port()
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200 "
                f"-c shared_buffers=64MB" + ("" if self.durable else " -c fsync=off -c synchronous_commit=off"))
        self._run("pg_ctl", "start", "-w", "-t", str(START_TIMEOUT_S), "-D", str(self.data), "-l",
                  str(self.root / "server.log"), "-o", opts, timeout=START_TIMEOUT_S + 10)
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def create_schema(self, name: str, database: str = "postgres") -> str:
        """A new empty schema in ``database``; a URL whose connections use it (search_path)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return self.url(database) + f"?options=-csearch_path%3D{name}"

    def drop_schema(self, name: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    def stop(self) -> None:
        if self.port:
            try:
                self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data))
            except (PostgresUnavailable, subprocess.TimeoutExpired):
                self._run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(self.data))
            self.port = 0
        if self._owned_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
