"""Benchmark: what a signed request's nonce write waits for while another role commits durably under heavy disk I/O.

Every signed request remembers its nonce. Until schema 5 the nonce was a row in the main SQLite database, so the
insert took the file's single write lock — which the learner, verifiers and result intake hold through a
synchronous=FULL commit, an fsync that takes seconds while the publisher writes a multi-gigabyte snapshot to the
same disk (the 0.5 B scale bench measured signed-request p99 of 193–344 ms). Now nonces have their own file
(``coordinator.store.store.Store.nonce_path``).

This bench reproduces the pressure with real processes and the real ``Store``: one process writes ``--gib`` of data
and fsyncs it, over and over (a publisher); another commits a small synchronous=FULL transaction to the main
database every 0.1 s (a learner and result intake). Meanwhile, side by side in one run, it measures

- **shared file** (the layout before): a nonce insert into the main database through a synchronous=NORMAL
  connection, as ``remember_nonce`` (now ``Store.nonces.remember``) did;
- **own file** (now): ``Store.nonces.remember``.

    python bench/nonce_contention.py --seconds 20 --rounds 2

Prints p50/p99/max per variant and writes a table into docs/benchmarks.md (``--no-docs`` to skip).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.store.store import Store  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "## Signed requests under snapshot I/O: the nonce file (`bench/nonce_contention.py`)"


def _publisher(folder: str, gib: float, stop: mp.synchronize.Event) -> None:
    chunk = os.urandom(64 << 20)
    n = max(1, int(gib * 16))
    i = 0
    while not stop.is_set():
        with open(os.path.join(folder, f"blob{i % 2}"), "wb") as f:
            for _ in range(n):
                f.write(chunk)
                if stop.is_set():
                    break
            f.flush()
            os.fsync(f.fileno())
        i += 1


def _durable_writer(db: str, stop: mp.synchronize.Event) -> None:
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS bench_steps(v BLOB)")
    while not stop.wait(0.1):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO bench_steps(v) VALUES (?)", (os.urandom(256),))
        conn.execute("COMMIT")
    conn.close()


def _percentiles(ms: list[float]) -> tuple[float, float, float]:
    ms = sorted(ms)
    return ms[len(ms) // 2], ms[min(len(ms) - 1, int(len(ms) * 0.99))], ms[-1]


def run_round(folder: Path, seconds: float, gib: float) -> dict[str, list[float]]:
    store = Store(folder / "coordinator.sqlite")
    shared = sqlite3.connect(str(store.path), isolation_level=None, timeout=30)
    shared.execute("PRAGMA synchronous=NORMAL")
    shared.execute("CREATE TABLE IF NOT EXISTS old_nonces(nonce BLOB PRIMARY KEY, expires REAL NOT NULL)")
    stop = mp.Event()
    procs = [mp.Process(target=_publisher, args=(str(folder), gib, stop)),
             mp.Process(target=_durable_writer, args=(str(store.path), stop))]
    for p in procs:
        p.start()
    out: dict[str, list[float]] = {"shared file": [], "own file": []}
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # alternate, so both variants see the same pressure
            t0 = time.perf_counter()
            shared.execute("BEGIN IMMEDIATE")
            shared.execute("INSERT INTO old_nonces VALUES (?, ?)", (os.urandom(16), time.time() + 300))
            shared.execute("COMMIT")
            out["shared file"].append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            store.nonces.remember(os.urandom(16), time.time() + 300)
            out["own file"].append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)  # a request every ~20 ms per variant
    finally:
        stop.set()
        for p in procs:
            p.join(60)
        shared.close()
        store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring time per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gib", type=float, default=1.5, help="size of each snapshot file the publisher writes")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on the run's disk)")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="nonce-bench-") as tmp:
            res = run_round(Path(tmp), args.seconds, args.gib)
        for name, ms in res.items():
            p50, p99, mx = _percentiles(ms)
            rows.append((r + 1, name, len(ms), p50, p99, mx))
            print(f"round {r + 1} {name:12s} n={len(ms):5d}  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {mx:7.1f} ms",
                  flush=True)
    if args.no_docs:
        return
    table = ["| round | nonce in | requests | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    table += [f"| {r} | {n} | {k} | {a:.1f} | {b:.1f} | {c:.1f} |" for r, n, k, a, b, c in rows]
    body = (f"{SECTION}\n\n`python bench/nonce_contention.py --seconds {args.seconds:g} --rounds {args.rounds} "
            f"--gib {args.gib:g}` ({time.strftime('%Y-%m-%d')}): a publisher process rewriting {args.gib:g} GiB files "
            "with fsync and a synchronous=FULL commit every 0.1 s in another process, as during a 0.5 B run's "
            "publication; both variants measured alternately in one run.\n\n" + "\n".join(table) + "\n")
    text = DOCS.read_text()
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    DOCS.write_text(text)
    print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()
