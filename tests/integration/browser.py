"""A real headless Chromium (Debian's ``chromium`` package, installed by `make browser`) driven over the
Chrome DevTools Protocol with aiohttp's websocket client: navigate, evaluate JavaScript, take screenshots."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str:
    exe = os.environ.get("ECHO_SWARM_CHROMIUM") or next((p for c in CANDIDATES if (p := shutil.which(c))), None)
    if exe is None:
        raise AssertionError("no Chromium found: `make browser` installs Debian's chromium package "
                             "(or set $ECHO_SWARM_CHROMIUM to a Chromium/Chrome executable)")
    return exe


class Chromium:
    """One headless browser process with its own profile folder; stopped by :meth:`stop` (by its pid)."""

    def __init__(self, profile_dir: Path, log: Path, width: int = 1280, height: int = 1500) -> None:
        self._log = open(log, "w")  # noqa: SIM115 — closed in stop()
        self.endpoint = threading.Event()
        self.ws_url = ""
        argv = [find_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
                "--remote-allow-origins=*", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
                "about:blank"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()
        if not self.endpoint.wait(60) or not self.ws_url:
            self.stop()
            raise AssertionError(f"chromium did not start; see {log}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._log.write(line)
            if "DevTools listening on " in line:
                self.ws_url = line.split("DevTools listening on ")[1].strip()
                self.endpoint.set()
        self.endpoint.set()

    @property
    def http(self) -> str:
        return "http://" + self.ws_url.split("://")[1].split("/")[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._pump.join(10)
        self._log.close()


class Page:
    """A DevTools session on one tab: ``send`` a command and wait for its answer (events are skipped)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, timeout_s: float = 30.0) -> None:
        self.ws = ws
        self.timeout_s = timeout_s
        self._id = 0

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        await self.ws.send_str(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = await asyncio.wait_for(self.ws.receive(), self.timeout_s)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"DevTools connection closed during {method}: {msg.type}")
            data = json.loads(msg.data)
            if data.get("id") == self._id:
                if "error" in data:
                    raise AssertionError(f"{method} failed: {data['error']}")
                return data["result"]

    async def evaluate(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"page script failed: {r['exceptionDetails'].get('text')} in {expression!r}")
        return r["result"].get("value")

    async def screenshot(self, path: Path) -> int:
        r = await self.send("Page.captureScreenshot", format="png")
        data = base64.b64decode(r["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return len(data)


async def open_page(session: aiohttp.ClientSession, browser: Chromium) -> Page:
    async with session.get(f"{browser.http}/json/list", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        targets = await resp.json(content_type=None)
    page = next(t for t in targets if t.get("type") == "page")
    ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 2**20,
                                  timeout=aiohttp.ClientWSTimeout(ws_close=10))
    p = Page(ws)
    await p.send("Page.enable")
    await p.send("Runtime.enable")
    return p


async def open_control_page(session: aiohttp.ClientSession, browser: Chromium, home: Path,
                            timeout_s: float = 60.0) -> tuple[Page, str]:
    """A client's local control page in ``browser``, opened as `echo-swarm client open` does (its URL and token
    from the client ``home``), once the page has polled the client; returns the tab and the page's base URL."""
    from swarm_client.webcontrol import PAGE_FILE, TOKEN_FILE

    base = json.loads((home / PAGE_FILE).read_text())["url"].rstrip("/")
    token = (home / TOKEN_FILE).read_text().strip()
    page = await open_page(session, browser)
    await page.send("Page.navigate", url=f"{base}/?token={token}")
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await page.evaluate("window.echoControl && window.echoControl.polls >= 1"):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the control page at {base} did not poll the client within {timeout_s:.0f} s")
        await asyncio.sleep(0.25)
    return page, base


def on_control_page(folder: Path, home: Path, action: Callable[[Page], Awaitable[T]]) -> T:
    """Start a Chromium (profile and log in ``folder``), open the control page of the client in ``home``, run
    ``action`` on the tab and return what it returns; the browser is stopped whatever happens."""
    browser = Chromium(folder / "chromium-profile", folder / "chromium.log")
    try:
        async def drive() -> T:
            async with aiohttp.ClientSession() as session:
                page, _ = await open_control_page(session, browser, home)
                return await action(page)

        return asyncio.run(drive())
    finally:
        browser.stop()
