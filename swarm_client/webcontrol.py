"""The local control page: a small web page served by `echo-swarm join` itself, for volunteers who do not live in
a terminal (Folding@home's Web Control is the model). It shows the client's state, the job's progress, speed,
credit and recent results, and has buttons to pause, resume, finish, snooze and cap the bandwidth.

Safety, since it controls the volunteer's machine:
- it listens on 127.0.0.1 only (there is no setting for another address), on ``--control-port`` (0: the port this
  home's page had last time when it is free — so a bookmark keeps working across restarts — else any free port;
  written to ``control-page.json`` in the client home while it runs, remembered in ``control-page.port``);
- every request needs the token in ``control-page.token`` (the client home, mode 0600, made once): `echo-swarm
  client open` opens ``/?token=…``, which trades it for an HttpOnly, SameSite=Strict cookie and redirects to
  ``/`` (so the token leaves the address bar); scripts may send ``Authorization: Bearer <token>`` instead;
- requests naming another Host than 127.0.0.1 / localhost with this port are refused (DNS rebinding), actions
  must be POSTs with a JSON body (a cross-site form cannot send one without a CORS preflight, which is never
  granted), and every reply carries a strict Content-Security-Policy and no-referrer.

Actions write the same control file as `echo-swarm client pause` etc. (swarm_client.control), so the page, the
commands and a restart all agree; the client notices each within one poll (about a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from swarm_client.control import controls_view, set_paused, snooze, update_controls

TOKEN_FILE = "control-page.token"
PAGE_FILE = "control-page.json"
PORT_FILE = "control-page.port"  # the port the page had last (kept after the client stops: the next start reuses it)
COOKIE = "echo_swarm_control"
HOST = "127.0.0.1"
WEB_DIR = Path(__file__).with_name("web")
MAX_SNOOZE_MIN = 7 * 24 * 60
OPEN_PAGE_S = 5.0  # a page that polled within this long is open (it polls every second)
HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
           "Cache-Control": "no-store"}


def _remembered_port(home: Path) -> int | None:
    try:
        port = int((home / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def load_or_create_token(home: Path) -> str:
    """The page's token: created once (0600) and kept, so a bookmark of ``client open``'s URL keeps working."""
    path = Path(home) / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    os.replace(tmp, path)
    return token


def page_info(home: Path) -> dict[str, Any] | None:
    """What `echo-swarm client open` needs: the running page's URL and pid (None when no page has run)."""
    try:
        data = json.loads((Path(home) / PAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("url"), str) else None


@dataclass
class PageSource:
    """What the page reads and changes: the client home (its control and status files), the live state, and a
    hook that applies a changed control at once (e.g. a new bandwidth cap to a download in progress)."""

    home: Path
    state: Callable[[], dict[str, Any]]
    applied: Callable[[], object]


class ControlPage:
    def __init__(self, source: PageSource) -> None:
        self.source = source
        self.token = load_or_create_token(source.home)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._looked = asyncio.Event()  # set by each state request: a page is open and polling
        self._last_look = -1e9  # monotonic time of the last state request

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1:``port`` (0: the remembered port if it is free, else any); returns the URL to open."""
        remembered = _remembered_port(self.source.home) if port == 0 else None
        if remembered is not None:
            try:
                return await self._listen(remembered)
            except OSError:  # taken meanwhile (another client, another program): any free port
                pass
        url = await self._listen(port)
        if port == 0:
            tmp = self.source.home / f".{PORT_FILE}.{os.getpid()}.tmp"
            tmp.write_text(str(self.port))
            os.replace(tmp, self.source.home / PORT_FILE)
        return url

    async def _listen(self, port: int) -> str:
        app = web.Application(middlewares=[self._guard], client_max_size=4096)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_post("/api/{action}", self._act)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, HOST, port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        info = {"url": f"http://{HOST}:{self.port}/", "port": self.port, "pid": os.getpid()}
        path = self.source.home / PAGE_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)
        return f"http://{HOST}:{self.port}/"

    async def stop(self, linger_s: float = 0.0) -> None:
        """Stop serving. ``linger_s``: a client stopped by an error first waits (at most that long) for an open
        page's next poll, so the page shows why it stopped before it can reach the client no more; a page polled
        within the last few seconds is open, otherwise nobody is looking and nothing waits."""
        if linger_s > 0 and self._runner is not None and time.monotonic() - self._last_look < OPEN_PAGE_S:
            self._looked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._looked.wait(), linger_s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        info = page_info(self.source.home)
        if info is not None and info.get("pid") == os.getpid():
            (self.source.home / PAGE_FILE).unlink(missing_ok=True)

    # -- access --------------------------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        offered = request.cookies.get(COOKIE, "")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            offered = header[len("Bearer "):].strip()
        return bool(offered) and hmac.compare_digest(offered.encode(), self.token.encode())

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.host not in (f"{HOST}:{self.port}", f"localhost:{self.port}"):
            return self._refuse(421, "this page answers only as 127.0.0.1 or localhost")
        token = request.query.get("token")
        if request.method == "GET" and request.path == "/" and token is not None:
            if not hmac.compare_digest(token.encode(), self.token.encode()):
                return self._refuse(403, "wrong token: open the page with `echo-swarm client open`")
            moved = web.HTTPSeeOther("/", headers=HEADERS)
            moved.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict", path="/")
            return moved
        if not self._authorized(request):
            return self._refuse(401, "this page needs its token: open it with `echo-swarm client open`")
        response: web.StreamResponse = await handler(request)
        response.headers.update(HEADERS)
        return response

    @staticmethod
    def _refuse(status: int, message: str) -> web.Response:
        return web.json_response({"error": message}, status=status, headers=HEADERS)

    # -- pages -----------------------------------------------------------------------------------------------
    async def _index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB_DIR / "control.html")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ("control.js", "control.css"):
            raise web.HTTPNotFound()
        return web.FileResponse(WEB_DIR / name)

    async def _state(self, request: web.Request) -> web.Response:
        response = web.json_response(self.source.state() | {"controls": controls_view(self.source.home)},
                                     headers=HEADERS)
        await response.prepare(request)  # sent before a lingering stop() may go on and close the connection
        await response.write_eof()
        self._last_look = time.monotonic()
        self._looked.set()
        return response

    async def _act(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return self._refuse(415, "send actions as application/json")
        try:
            body = await request.json()
        except ValueError:
            return self._refuse(400, "the body is not JSON")
        if not isinstance(body, dict):
            return self._refuse(400, "the body must be a JSON object")
        action = request.match_info["action"]
        home = self.source.home
        if action == "pause":
            set_paused(home, True)
        elif action == "resume":
            set_paused(home, False)
        elif action == "finish":
            update_controls(home, finish=True)
        elif action == "snooze":
            minutes = body.get("minutes")
            if not isinstance(minutes, int | float) or isinstance(minutes, bool) or not 0 < minutes <= MAX_SNOOZE_MIN:
                return self._refuse(400, f"minutes must be a number above 0 and at most {MAX_SNOOZE_MIN}")
            snooze(home, float(minutes) * 60)
        elif action == "bandwidth":
            mbps = body.get("mbps")
            if mbps is not None and (not isinstance(mbps, int | float) or isinstance(mbps, bool)
                                     or not math.isfinite(mbps) or not 0 < mbps <= 1e5):
                return self._refuse(400, "mbps must be a number above 0 (MB/s), or null for no cap")
            update_controls(home, max_mbps=None if mbps is None else float(mbps))
        else:
            raise web.HTTPNotFound()
        self.source.applied()
        return web.json_response({"ok": True, "controls": controls_view(home)})
