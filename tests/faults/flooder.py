"""A connection flood from one address, as its own process (used by tests/faults/test_flood.py).

    python -m tests.faults.flooder URL --kind slowloris|idle --conns N --until STOPFILE --seconds S
                                   [--source 127.0.0.2] --out F

Keeps ``--conns`` connections open until the file ``--until`` appears (``--seconds`` at most, a bound should
the test die), reopening any the server closes (at most ``--rate`` new connections a second after the first
wave): ``idle`` ones send nothing; ``slowloris`` ones send a request line and then one header byte every 0.2 s,
never finishing. Its JSON report — connections opened, closed by the server, refused at connect, most held at
once — is rewritten (atomically) every second while it runs, so the test can wait on what the flood has done
instead of on a fixed window, and written a last time, with ``"done": true``, when it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import selectors
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

TRICKLE_S = 0.2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--kind", choices=("slowloris", "idle"), required=True)
    p.add_argument("--conns", type=int, required=True)
    p.add_argument("--until", type=Path, required=True, help="stop once this file exists")
    p.add_argument("--seconds", type=float, required=True, help="stop after this long at most")
    p.add_argument("--source", default="")
    p.add_argument("--rate", type=float, default=200.0, help="new connections per second at most")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    parts = urlsplit(args.url)
    target = (parts.hostname or "127.0.0.1", parts.port or 80)
    sel = selectors.DefaultSelector()
    stats = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "most_open": 0}
    live: dict[socket.socket, float] = {}

    def open_one() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if args.source:
                s.bind((args.source, 0))
            s.settimeout(2.0)
            s.connect(target)
            s.setblocking(False)
        except OSError:
            s.close()
            stats["connect_failed"] += 1
            return
        if args.kind == "slowloris":
            s.send(b"POST /v1/results HTTP/1.1\r\nHost: x\r\n")
        sel.register(s, selectors.EVENT_READ)
        live[s] = time.monotonic()
        stats["opened"] += 1

    def report(done: bool = False) -> None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats | {"done": done}))
        tmp.replace(args.out)

    end = time.monotonic() + args.seconds
    next_trickle = next_report = time.monotonic()
    started = time.monotonic()
    while time.monotonic() < end and not args.until.exists():
        if time.monotonic() >= next_report:
            next_report = time.monotonic() + 1.0
            report()
        allowed = args.rate * (time.monotonic() - started) + args.conns  # the first wave at once, then --rate
        while len(live) < args.conns and stats["opened"] + stats["connect_failed"] < allowed:
            open_one()
        stats["most_open"] = max(stats["most_open"], len(live))
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server closed it (a refusal's canned reply is read first, then EOF)
                sel.unregister(s)
                s.close()
                live.pop(s, None)
                stats["closed_by_server"] += 1
        if args.kind == "slowloris" and time.monotonic() >= next_trickle:
            next_trickle = time.monotonic() + TRICKLE_S
            for s in list(live):
                with contextlib.suppress(OSError):
                    s.send(b"X")
    for s in list(live):
        s.close()
    report(done=True)


if __name__ == "__main__":
    main()
